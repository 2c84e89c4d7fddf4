"""A worker refuses a request it cannot serve whole, before anything streams; the router passes the refusal on.

    decode_request(body, type, limits)   the contract: every field, against the worker's model and pool
    POST /generate                       a 400 error JSON (OpenAI shape, with the field), never 200 + Failed
    WorkerClient.generate                that 400 becomes one Failed(message, 400): the router's 4xx, not a retry
    the router's own /v1/completions     ids outside int32 are a 400, like ids outside the vocabulary
    the router's /v1/admin/pin           ids outside the vocabulary are a 400, never forwarded

The worker is real (tiny model, pool, arena, HTTP API) on 127.0.0.1, in this process.
"""

import asyncio

import msgspec
import numpy as np
import pytest
from aiohttp import web

from prefixpool.contract.worker_api import (MSGPACK, Failed, FetchPlan, GenerateRequest, RequestLimits, RequestRefused,
                                            SamplingParams, decode_request, encode_request)
from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.node.exchange import BlockExchange
from prefixpool.router.admin_pin import decode_pin, forward_pin
from prefixpool.router.cost_model import CostModel
from prefixpool.router.errors import APIError, InvalidRequest
from prefixpool.router.openai_schema import CompletionBody, RouteBody, decode
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import TOKEN_DTYPE, Namespace
from prefixpool.transfer.fetcher import Fetcher
from prefixpool.worker.http_api import build_app
from prefixpool.worker.service import Worker
from tests.support.engine import make_engine

LIMITS = RequestLimits(vocab_size=259, max_model_len=64, block_size=4, num_blocks=10)
GOOD = {"request_id": "r", "tokens": list(range(20)), "sampling": {"max_tokens": 4}}


def refused(**changes) -> tuple[str, str | None]:
    """(message, param) of the refusal of GOOD with `changes`; fails if it decodes and checks clean."""
    document = {**GOOD, **changes}
    raw = msgspec.json.encode(document)
    with pytest.raises((msgspec.ValidationError, RequestRefused)) as caught:
        decode_request(raw, "application/json", LIMITS)
    return str(caught.value), getattr(caught.value, "param", None)


def test_a_good_request_passes_and_the_checks_are_tight_at_their_edges():
    assert decode_request(msgspec.json.encode(GOOD), "application/json", LIMITS).num_tokens == 20
    edge = {"tokens": [258] * 24, "sampling": {"max_tokens": 16, "stop_token_ids": [0, 258]},  # 39 positions: 10 blocks
            "fetch": {"peer": "w", "transfer_url": "tcp://[::1]:7001", "start": 6, "end": 6}}
    assert decode_request(msgspec.json.encode({**GOOD, **edge}), "application/json", LIMITS).fetch.end == 6


@pytest.mark.parametrize("changes, words", [
    ({"tokens": [1, 259]}, "259 is outside the vocabulary"),
    ({"tokens": [-1, 2]}, "tokens"),
    ({"tokens": [1, 2**31]}, "tokens"),
    ({"tokens": [1, 10**30]}, "tokens"),
    ({"tokens": [1.0]}, "tokens"),
    ({"tokens": []}, "non-empty"),
    ({"tokens": list(range(61))}, "exceed the model's 64 positions"),
    ({"sampling": {"max_tokens": 0}}, "max_tokens"),
    ({"sampling": {"max_tokens": 2**40}}, "positions"),
    ({"tokens": list(range(38))}, "needs 11 blocks, the pool has 10"),
    ({"sampling": {"temperature": -0.5}}, "temperature"),
    ({"sampling": {"top_p": 0}}, "top_p"),
    ({"sampling": {"seed": 2**64}}, "seed"),
    ({"sampling": {"stop_token_ids": [300]}}, "300 is outside the vocabulary"),
    ({"fetch": {"peer": "w", "transfer_url": "tcp://h:1", "start": 3, "end": 2}}, "fetch plan [3, 2)"),
    ({"fetch": {"peer": "w", "transfer_url": "tcp://h:1", "start": 0, "end": 6}}, "5 full blocks"),
    ({"fetch": {"peer": "w", "transfer_url": "http://h:1", "start": 0, "end": 1}}, "scheme://host:port"),
    ({"fetch": {"peer": "w", "transfer_url": "tcp://h:99999", "start": 0, "end": 1}}, "transfer_url"),
    ({"fetch": {"peer": "", "transfer_url": "tcp://h:1", "start": 0, "end": 1}}, "no peer"),
    ({"cache_salt": "s" * 257}, "cache_salt"),
])
def test_each_bad_field_is_refused_with_its_reason(changes, words):
    message, _ = refused(**changes)
    assert words in message


def test_packed_ids_are_checked_like_listed_ones():
    packed = np.array([5, 259], dtype=TOKEN_DTYPE).tobytes()
    request = GenerateRequest(request_id="r", tokens=packed, sampling=SamplingParams())
    with pytest.raises(RequestRefused, match="259 is outside the vocabulary"):
        decode_request(encode_request(request), MSGPACK, LIMITS)
    negative = msgspec.structs.replace(request, tokens=np.array([-7], dtype=TOKEN_DTYPE).tobytes())
    with pytest.raises(RequestRefused, match="-7 is outside the vocabulary"):
        decode_request(encode_request(negative), MSGPACK, LIMITS)


def test_nan_temperature_is_refused_on_decode():
    raw = msgspec.msgpack.encode({**GOOD, "sampling": {"temperature": float("nan")}})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        decode_request(raw, MSGPACK, LIMITS)


class _NoEtcd:
    def publish(self, stored=(), removed=(), tier="device", tails=None) -> None:
        pass


def test_the_worker_answers_400_before_any_stream_and_the_router_client_passes_it_on():
    async def scenario():
        engine = make_engine(random_model(preset("tiny"), seed=3), num_blocks=16)
        fetcher = Fetcher()
        worker = Worker(engine, BlockExchange(engine.blocks, engine.arena, _NoEtcd(), fetcher))
        runner = web.AppRunner(build_app(worker), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        worker.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = WorkerClient()
        try:
            bad = GenerateRequest(request_id="b", tokens=[1, 2, 4000], sampling=SamplingParams(max_tokens=2))
            async with client._client().post(f"{url}/generate", data=encode_request(bad),
                                             headers={"Content-Type": MSGPACK}) as response:
                assert response.status == 400 and response.content_type == "application/json"
                error = (await response.json())["error"]
            assert "4000 is outside the vocabulary [0, 259)" in error["message"] and error["param"] == "tokens"
            assert [event async for event in client.generate(url, bad)] == [Failed(error["message"], 400)]
            huge = b"[" + b" " * (64 * 1024 * 1024)  # past client_max_size: aiohttp's own 413 is plain text
            for method, path in (("POST", "/generate"), ("POST", "/admin/pin")):
                async with client._client().request(method, url + path, data=huge) as response:
                    assert response.status == 413 and "too large" in (await response.json())["error"]["message"]
            good = msgspec.structs.replace(bad, tokens=[1, 2, 4])
            events = [event async for event in client.generate(url, good)]
            assert len(events) == 3 and events[-1].usage.completion_tokens == 2
        finally:
            await client.close()
            await runner.cleanup()
            await worker.stop()
            await fetcher.close()
        engine.blocks.check_integrity()
        assert engine.blocks.pool.ref_count == [0] * 16

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", [CompletionBody, RouteBody])
@pytest.mark.parametrize("prompt", [[65, 2**31], [-1], [10**30, 1]])
def test_the_router_answers_400_for_ids_outside_int32(kind, prompt):
    with pytest.raises(APIError) as caught:
        decode(msgspec.json.encode({"model": "m", "prompt": prompt}), kind)
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert "outside int32" in caught.value.message


def test_fetch_plans_built_by_the_router_are_not_checked_on_construction():
    assert FetchPlan("peer", "weird://", 5, 1).start == 5  # a plan is checked where it is decoded, by the worker


class _NoWorkersToAsk:
    """Fault injector: the router must refuse before it looks for a worker to forward the pin to."""

    def workers(self):
        raise AssertionError("an out-of-vocabulary pin was about to be forwarded")


@pytest.mark.parametrize("tokens", [[1] * 8 + [259], [1] * 8 + [2**31], [-1] * 8, [10**30] * 8])
def test_the_router_refuses_a_pin_of_ids_outside_the_vocabulary_before_forwarding(tokens):
    config = RouterConfig(model="tiny", namespace=Namespace("tiny", block_size=4), max_context=4096, vocab_size=259)
    router = Router(config, ByteTokenizer(), _NoWorkersToAsk(), WorkerClient(), CostModel(block_size=4))
    body = decode_pin(msgspec.json.encode({"tokens": tokens}))
    with pytest.raises(InvalidRequest, match=r"vocabulary \[0, 259\)") as caught:
        asyncio.run(forward_pin(router, body, unpin=False))
    assert caught.value.status == 400 and caught.value.param == "tokens"
