"""Fetch while queued: a request whose plan names a fetch queues at once, deferred, and is
admitted in its place when the fetch ends, so the transfer overlaps the wait.

The engine test is a state machine over a real tiny model. The worker test uses a real
Worker and engine; the one fake is a stalled transfer (a fetcher that waits for the test
and then fails, the fault being injected), so the order of events is forced, not timed.
"""

import asyncio

import pytest

from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.engine.sampling import SamplingParams
from prefixpool.node.exchange import BlockExchange
from prefixpool.worker.service import Worker
from prefixpool.contract.worker_api import FetchPlan, GenerateRequest, Token
from prefixpool.transfer.errors import TransferError
from tests.support.engine import assert_clean, make_engine, tokens

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=5)


def _drain(engine) -> dict[int, list[int]]:
    outputs: dict[int, list[int]] = {}
    while engine.has_work():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event.token)
        engine.blocks.check_integrity()
    return outputs


def test_a_deferred_request_keeps_its_place_and_is_passed_over_until_resumed(model):
    engine = make_engine(model, max_batch_size=2)
    deferred = engine.submit(tokens(9, 1), GREEDY, deferred=True)
    later = engine.submit(tokens(9, 2), GREEDY)
    engine.step()
    assert [s.request_id for s in engine.running] == [later] and engine.num_queued == 1
    engine.resume(deferred)
    outputs = _drain(engine)
    assert set(outputs) == {deferred, later}
    plain = make_engine(model)
    alone = plain.submit(tokens(9, 1), GREEDY)
    assert _drain(plain)[alone] == outputs[deferred]  # deferring changes when, never what
    assert_clean(engine)


def test_a_deferred_request_can_be_aborted(model):
    engine = make_engine(model)
    deferred = engine.submit(tokens(9, 3), GREEDY, deferred=True)
    assert engine.abort(deferred) and not engine.has_work()
    engine.resume(deferred)  # resuming what is gone is harmless
    assert_clean(engine)


class _Published:
    def publish(self, stored=(), removed=(), tier="device", tails=None) -> None:
        pass


class _StalledFetcher:
    """The fault: a transfer that hangs until the test lets it fail."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.fail = asyncio.Event()

    async def fetch(self, url, keys, blocks, arena, *, deadline_s):
        self.started.set()
        await self.fail.wait()
        raise TransferError("peer went away")


async def _collect(stream) -> list[int]:
    return [event.token async for event in stream if isinstance(event, Token)]


def test_worker_queues_a_fetching_request_before_its_transfer_ends(model):
    async def scenario():
        engine = make_engine(model, max_batch_size=4)
        fetcher = _StalledFetcher()
        worker = Worker(engine, BlockExchange(engine.blocks, engine.arena, _Published(), fetcher))
        worker.start()
        try:
            prompt = tokens(24, 7)
            request = GenerateRequest(request_id="f", tokens=prompt, sampling=GREEDY,
                                      fetch=FetchPlan("peer", "tcp://127.0.0.1:1", 0, 6))
            fetching = asyncio.ensure_future(_collect(worker.generate(request)))
            await asyncio.wait_for(fetcher.started.wait(), 30)
            assert engine.num_queued == 1  # queued while its blocks are still on the way
            other = await _collect(worker.generate(GenerateRequest(request_id="o", tokens=tokens(10, 8),
                                                                   sampling=GREEDY)))
            assert len(other) == 3 and not fetching.done()  # a later request went past the deferred one
            fetcher.fail.set()  # the transfer fails: the deferred request recomputes
            got = await asyncio.wait_for(fetching, 60)
            oracle = await _collect(worker.generate(GenerateRequest(request_id="c", tokens=prompt, sampling=GREEDY)))
            assert got == oracle and len(got) == 3
        finally:
            await worker.stop()
        assert_clean(engine)

    asyncio.run(scenario())
