"""The engine's scheduling and block bookkeeping: batching, chunking, waiting for blocks,
aborts, the split step, pool events, keys given from outside, sampling and stops."""


import pytest
import torch

from prefixpool.engine.checkpoint import random_model
from prefixpool.engine.scheduler import Engine, RequestTooLarge
from prefixpool.model.config import arena_shape_for, namespace_for, preset
from prefixpool.engine.sampling import SamplingParams
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import chain, chain_ids
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from tests.support.engine import BLOCK, assert_clean, make_engine, tokens

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=2)


def run(engine):
    """Step until idle; every request's tokens and final event."""
    outputs, finals = {}, {}
    while engine.has_work():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event.token)
            if event.finished:
                finals[event.request_id] = event
        engine.blocks.check_integrity()
    return outputs, finals


def test_decodes_share_steps_and_a_long_prefill_is_chunked_around_them(model):
    engine = make_engine(model, chunk_size=8)
    short = [engine.submit(tokens(5, i), SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(2)]
    engine.step()                                   # prefills: 5 + 3 tokens
    engine.step()                                   # decode of the first, last 2 prompt tokens of the second
    assert [engine.stats(i).num_output_tokens for i in short] == [2, 1]
    long_id = engine.submit(tokens(30, 9), GREEDY)
    batch = engine.schedule()
    widths = {span.seq.request_id: span.end - span.start for span in batch.spans}
    assert widths == {short[0]: 1, short[1]: 1, long_id: 6}   # two decodes ride along the first chunk
    engine.finish(batch, engine.forward(batch))
    outputs, _ = run(engine)
    assert len(outputs[long_id]) == 5
    assert_clean(engine)


def test_continuous_batching_gives_each_request_its_solo_output(model):
    prompts = [tokens(n, 20 + n) for n in (3, 9, 14, 6)]
    solo = [make_engine(model).generate(p, GREEDY)[0] for p in prompts]
    engine = make_engine(model, chunk_size=6, max_batch_size=3)
    ids = [engine.submit(p, GREEDY) for p in prompts]
    outputs, finals = run(engine)
    assert [outputs[i] for i in ids] == solo
    assert all(finals[i].finish_reason == "length" for i in ids)
    assert_clean(engine)


def test_a_request_waits_for_blocks_instead_of_failing(model):
    engine = make_engine(model, num_blocks=6)
    params = SamplingParams(max_tokens=4, ignore_eos=True)    # 17 + 3 positions = 5 blocks each
    first, second = tokens(17, 30), tokens(17, 31)
    expected = [make_engine(model).generate(p, params)[0] for p in (first, second)]
    ids = [engine.submit(p, params) for p in (first, second)]
    batch = engine.schedule()
    assert (engine.num_running, engine.num_queued) == (1, 1)
    head = engine.finish(batch, engine.forward(batch))
    outputs, _ = run(engine)
    assert [e.token for e in head] + outputs[ids[0]] == expected[0]
    assert outputs[ids[1]] == expected[1]
    assert_clean(engine)


def test_a_request_that_can_never_fit_is_refused_at_submit(model):
    engine = make_engine(model, num_blocks=4)
    with pytest.raises(RequestTooLarge, match="needs 5 blocks, the pool has 4"):
        engine.submit(tokens(17, 1), SamplingParams(max_tokens=1))
    with pytest.raises(RequestTooLarge, match="positions"):
        engine.submit([1] * 8190, SamplingParams(max_tokens=8))
    with pytest.raises(RequestTooLarge):
        engine.submit([], GREEDY)
    assert not engine.has_work()


def test_abort_waiting_running_and_in_flight_requests_frees_everything(model):
    engine = make_engine(model, max_batch_size=1)
    running = engine.submit(tokens(9, 40), SamplingParams(max_tokens=50, ignore_eos=True))
    waiting = engine.submit(tokens(9, 41), GREEDY)
    engine.step()
    assert engine.abort(waiting) and engine.num_queued == 0
    batch = engine.schedule()
    assert engine.abort(running)                    # in flight: freed by finish, no event
    assert engine.finish(batch, engine.forward(batch)) == []
    assert not engine.abort(running)
    assert_clean(engine)
    late = engine.submit(tokens(6, 42), GREEDY)
    engine.step()
    assert engine.abort(late)
    assert_clean(engine)


def test_a_failed_forward_drops_its_requests_and_frees_their_blocks(model):
    engine = make_engine(model, chunk_size=8, max_batch_size=2)
    ids = [engine.submit(tokens(6, 45 + i), GREEDY) for i in range(3)]
    batch = engine.schedule()
    assert engine.fail(batch) == ids[:2]
    assert (engine.num_running, engine.num_queued) == (0, 1)
    outputs, _ = run(engine)
    assert list(outputs) == [ids[2]]
    assert_clean(engine)


class PoolTripwire:
    """Fault injector: any pool call during forward() is a bug."""

    def __getattr__(self, name):
        raise AssertionError(f"forward() touched the pool ({name})")


def test_forward_touches_no_pool_and_the_pool_may_change_meanwhile(model):
    engine = make_engine(model, chunk_size=6, max_batch_size=2)
    prompt = tokens(15, 50)
    expected = make_engine(model).generate(prompt, GREEDY)[0]
    request_id = engine.submit(prompt, GREEDY)
    output = []
    while engine.has_work():
        batch = engine.schedule()
        blocks, engine.blocks = engine.blocks, PoolTripwire()
        result = engine.forward(batch)
        engine.blocks = blocks
        other = blocks.acquire(())                   # the worker uses the pool while forward runs
        blocks.allocate(other, 1)
        blocks.release(other)
        output += [e.token for e in engine.finish(batch, result) if e.request_id == request_id]
    assert output == expected
    assert_clean(engine)


def test_pool_events_report_stored_and_evicted_keys(model):
    engine = make_engine(model, num_blocks=8)
    prompt = tokens(12, 60)
    engine.generate(prompt, SamplingParams(max_tokens=1))
    stored, evicted, tails = engine.take_pool_events()
    assert stored == chain(prompt, engine.namespace) and evicted == [] and tails == stored[-1:]
    assert engine.take_pool_events() == ([], [], [])
    engine.generate(tokens(29, 61), SamplingParams(max_tokens=1))   # needs all 8 blocks
    stored, evicted, _ = engine.take_pool_events()
    assert sorted(evicted) == sorted(chain(prompt, engine.namespace))
    assert all(engine.blocks.lookup(key) is not None for key in stored)
    engine.generate(prompt, SamplingParams(max_tokens=1))           # stores prompt's keys again ...
    engine.generate(tokens(29, 63), SamplingParams(max_tokens=1))   # ... and evicts them in the same interval
    stored, evicted, tails = engine.take_pool_events()
    assert set(chain(prompt, engine.namespace)) <= set(evicted)     # the latest event wins
    assert tails == stored[-1:]                                     # prompt's tail was evicted: not one any more
    assert stored == chain(tokens(29, 63), engine.namespace)
    assert not set(stored) & set(evicted)
    assert all(engine.blocks.lookup(key) is not None for key in stored)
    assert all(engine.blocks.lookup(key) is None for key in evicted)
    assert_clean(engine)


def test_a_request_names_its_tail_when_it_ends_unless_evicted_by_then(model):
    engine = make_engine(model, num_blocks=8, chunk_size=8)
    prompt = tokens(12, 64)
    request_id = engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()                                                   # the prompt's 3 blocks stored, decoding
    stored, evicted, tails = engine.take_pool_events()
    assert stored == chain(prompt, engine.namespace) and evicted == [] and tails == []   # not ended: no tail
    while engine.has_work():
        engine.step()
    stored, evicted, tails = engine.take_pool_events()
    assert len(stored) == 1 and tails == stored                     # its last generated block: the one tail
    assert engine.take_pool_events() == ([], [], [])
    other = tokens(12, 66)
    request_id = engine.submit(other, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()                                                   # its prompt's 3 blocks stored
    stored, _, tails = engine.take_pool_events()                    # (its allocation evicted older blocks)
    assert stored == chain(other, engine.namespace) and tails == []
    assert engine.abort(request_id)                                 # ends its chain: a tail ...
    engine.generate(tokens(29, 65), SamplingParams(max_tokens=1))   # ... evicted in the same interval: none
    stored, evicted, tails = engine.take_pool_events()
    assert chain(other, engine.namespace)[-1] in evicted
    assert tails == stored[-1:] and stored == chain(tokens(29, 65), engine.namespace)
    assert_clean(engine)


def test_keys_given_by_the_caller_are_used_as_is(model):
    engine = make_engine(model)
    prompt = tokens(13, 70)
    opaque = chain_ids([7, 8, 9], engine.namespace)
    engine.generate(prompt, GREEDY, keys=opaque)
    assert [engine.blocks.lookup(k) is not None for k in opaque] == [True] * 3
    _, stats = engine.generate(prompt, GREEDY, keys=opaque[:2])   # block 2 chained from opaque[1] by tokens
    assert stats.num_cached_tokens == 8
    assert engine.blocks.lookup(chain(prompt[8:12], engine.namespace)[0]) is None
    assert engine.take_pool_events()[0][-1] not in opaque
    with pytest.raises(ValueError, match="4 keys given"):
        engine.submit(prompt, GREEDY, keys=chain_ids([1, 2, 3, 4], engine.namespace))
    assert_clean(engine)


def test_seeded_sampling_repeats_and_stop_ids_end_a_request(model):
    prompt = tokens(11, 80)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True)
    first, _ = make_engine(model).generate(prompt, sampled)
    engine = make_engine(model)
    engine.submit(tokens(7, 81), SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    assert engine.generate_batch([prompt], sampled)[0][0] == first
    greedy, _ = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.generate(prompt, SamplingParams(max_tokens=8, top_p=1e-6, temperature=1.0, seed=3,
                                                  ignore_eos=True))[0] == greedy
    stop = greedy[2]
    stopped_id = engine.submit(prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    outputs, finals = run(engine)
    assert outputs[stopped_id] == greedy[: greedy.index(stop) + 1]
    assert finals[stopped_id].finish_reason == "stop"
    assert finals[stopped_id].stats.num_output_tokens == len(outputs[stopped_id])
    assert_clean(engine)


def test_bfloat16_engine_reuses_its_cache(model):
    bf16 = random_model(preset("tiny"), seed=2, dtype=torch.bfloat16)
    engine = make_engine(bf16)
    assert engine.namespace.dtype == "bfloat16"
    prompt = tokens(14, 90)
    cold, _ = engine.prefill_logits(prompt)
    warm, stats = engine.prefill_logits(prompt)
    assert stats.num_cached_tokens == 12
    torch.testing.assert_close(warm, cold, rtol=0.05, atol=0.05)
    fp32, _ = make_engine(model).prefill_logits(prompt)
    torch.testing.assert_close(cold, fp32, rtol=0.1, atol=0.3)
    assert_clean(engine)


def test_engine_rejects_an_arena_or_namespace_of_another_model(model):
    config = model.config
    with pytest.raises(ValueError, match="dtypes differ"):
        Engine(model, NodeBlocks(BlockPool(4)), KVArena(arena_shape_for(config, 4, BLOCK)),
               namespace_for(config, "bfloat16", BLOCK))
    with pytest.raises(ValueError, match="does not fit the model"):
        Engine(model, NodeBlocks(BlockPool(4)), KVArena(arena_shape_for(config, 4, BLOCK * 2)),
               namespace_for(config, "float32", BLOCK))
    with pytest.raises(ValueError, match="decodes would starve prefill"):
        make_engine(model, chunk_size=4, max_batch_size=8)
