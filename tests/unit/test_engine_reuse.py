"""Reused KV gives the same answer as recompute: computed in the same call, reused from
the pool after another request, or copied as raw bytes into a second pool and arena.
On PREFIXPOOL_TEST_DEVICE (cpu by default, cuda on the GPU machine)."""


import pytest
import torch

from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.engine.sampling import SamplingParams
from prefixpool.store.keys import chain
from tests.support.engine import BLOCK, DEVICE, assert_clean, copy_blocks, make_engine, tokens

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=1, device=DEVICE)


def reference(model, prompt):
    """(a) everything computed in one call, on a cold engine."""
    engine = make_engine(model)
    logits, stats = engine.prefill_logits(prompt)
    output, _ = engine.generate(prompt, GREEDY)
    assert stats.num_cached_tokens == 0
    return logits, output


# (prefix length, suffix length): exactly N blocks, partial last block, one-token suffix, all cached
CASES = [(8, 3), (10, 5), (12, 1), (16, 0), (13, 0)]


@pytest.mark.parametrize("prefix_len,suffix_len", CASES)
def test_reuse_from_pool_matches_recompute(model, prefix_len, suffix_len):
    prefix, suffix = tokens(prefix_len, 1), tokens(suffix_len, 2)
    prompt = prefix + suffix
    ref_logits, ref_output = reference(model, prompt)

    engine = make_engine(model)
    engine.generate(prefix + tokens(7, 3), GREEDY)      # another request computes the prefix
    logits, stats = engine.prefill_logits(prompt)
    output, out_stats = engine.generate(prompt, GREEDY)

    full_blocks = prefix_len // BLOCK * BLOCK
    assert stats.num_cached_tokens == min(full_blocks, len(prompt) - 1)
    assert stats.num_computed_tokens == len(prompt) - stats.num_cached_tokens
    assert out_stats.num_cached_tokens >= stats.num_cached_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert output == ref_output
    assert_clean(engine)


@pytest.mark.parametrize("prefix_len,suffix_len", CASES)
def test_reuse_of_bytes_copied_to_another_pool_matches_recompute(model, prefix_len, suffix_len):
    prefix, suffix = tokens(prefix_len, 4), tokens(suffix_len, 5)
    prompt = prefix + suffix
    ref_logits, ref_output = reference(model, prompt)

    holder, receiver = make_engine(model), make_engine(model, num_blocks=48)
    holder.generate(prefix + tokens(5, 6), GREEDY)
    keys = chain(prefix, holder.namespace)
    copy_blocks(holder, receiver, keys)
    logits, stats = receiver.prefill_logits(prompt)
    output, _ = receiver.generate(prompt, GREEDY)

    assert stats.num_cached_tokens == min(len(keys) * BLOCK, len(prompt) - 1)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert output == ref_output
    assert_clean(holder)
    assert_clean(receiver)


def test_entirely_cached_prompt_recomputes_only_its_last_token(model):
    prompt = tokens(16, 7)
    engine = make_engine(model)
    first, _ = engine.generate(prompt, GREEDY)
    again, stats = engine.generate(prompt, GREEDY)
    assert again == first
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (15, 1)
    assert_clean(engine)


def test_batch_mixing_cached_and_cold_requests(model):
    shared = tokens(12, 8)
    prompts = [shared + tokens(3, 9), tokens(14, 10), shared + tokens(6, 11), tokens(9, 12) + shared]
    expected = [reference(model, p)[1] for p in prompts]

    engine = make_engine(model, chunk_size=7, max_batch_size=3)
    engine.generate(shared + tokens(2, 13), GREEDY)
    results = engine.generate_batch(prompts, GREEDY)

    assert [output for output, _ in results] == expected
    assert [stats.num_cached_tokens for _, stats in results] == [12, 0, 12, 0]
    assert_clean(engine)


def test_chunked_prefill_equals_unchunked(model):
    prompt = tokens(37, 14)
    whole = make_engine(model, chunk_size=512)
    chunked = make_engine(model, chunk_size=5, max_batch_size=2)
    logits_whole, _ = whole.prefill_logits(prompt)
    logits_chunked, _ = chunked.prefill_logits(prompt)
    torch.testing.assert_close(logits_chunked, logits_whole, rtol=1e-4, atol=1e-4)
    assert chunked.generate(prompt, GREEDY)[0] == whole.generate(prompt, GREEDY)[0]
    assert_clean(whole)
    assert_clean(chunked)


def test_evicting_a_middle_block_makes_the_rest_recompute(model):
    prompt = tokens(22, 15)
    ref_logits, ref_output = reference(model, prompt)
    engine = make_engine(model)
    engine.generate(prompt, GREEDY)
    keys = chain(prompt, engine.namespace)
    assert engine.blocks.pool.drop(keys[2])

    logits, stats = engine.prefill_logits(prompt)
    assert stats.num_cached_tokens == 2 * BLOCK
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert engine.generate(prompt, GREEDY)[0] == ref_output
    assert engine.blocks.lookup(keys[2]) is not None, "the recomputed block is cached again"
    assert_clean(engine)


def test_generated_tokens_fill_blocks_that_a_later_turn_reuses(model):
    prompt = tokens(10, 16)
    engine = make_engine(model)
    output, _ = engine.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    next_turn = prompt + output + tokens(3, 17)
    _, stats = engine.prefill_logits(next_turn)
    # prompt + output = 19 tokens; the last output token's K,V is never written: 18 stored, 4 blocks full
    assert stats.num_cached_tokens == 16
    assert_clean(engine)
