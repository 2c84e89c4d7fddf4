"""One attention call for a whole step equals attending request by request over contiguous K,V,
for decodes, cold and cached prefill chunks and sliding windows mixed in one step; an engine
step makes exactly one SDPA call per layer."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.engine.paged_attention import QUERY_TILE, Span, attend, build_layout, store
from prefixpool.engine.sampling import SamplingParams
from tests.support.engine import make_engine, tokens

BLOCK, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 4, 4, 2, 8, 64


def make_spans():
    """(offset, start, end, store_from) per request; blocks handed out from a shuffled free list."""
    shapes = [(40, 41, 40), (0, 5, 0), (17, 90, 16), (9, 10, 9), (0, 1, 0), (12, 13, 13)]
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    spans, offset = [], 0
    for start, end, store_from in shapes:
        count = -(-end // BLOCK)
        spans.append(Span(offset, start, end, store_from, tuple(order[:count])))
        order = order[count:]
        offset += end - start
    return spans, offset


def reference(q, kv, span, window):
    """The request alone: its keys read contiguously, causal (and windowed) by position."""
    keys = kv[list(span.block_ids), 0].flatten(0, 1)[: span.end].transpose(0, 1)
    values = kv[list(span.block_ids), 1].flatten(0, 1)[: span.end].transpose(0, 1)
    query_pos = torch.arange(span.start, span.end).unsqueeze(1)
    key_pos = torch.arange(span.end).unsqueeze(0)
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    rows = slice(span.offset, span.offset + span.num_tokens)
    return F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=mask,
                                          enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 6])
def test_one_call_for_the_step_equals_request_by_request(window):
    torch.manual_seed(1)
    spans, rows = make_spans()
    layer_kv = torch.randn(NUM_BLOCKS, 2, BLOCK, KV_HEADS, DIM)
    q, k, v = torch.randn(rows, HEADS, DIM), torch.randn(rows, KV_HEADS, DIM), torch.randn(rows, KV_HEADS, DIM)
    layout = build_layout(spans, BLOCK, torch.device("cpu"))
    assert layout.query_rows.shape[1] == QUERY_TILE          # a 73-row chunk beside decodes is cut into tiles
    assert layout.query_rows.shape[0] == 1 + 1 + 3 + 1 + 1 + 1
    store(layer_kv, layout, k, v)
    out = attend(q, k, v, layer_kv, layout, layout.mask(window, HEADS // KV_HEADS, q.dtype))
    for span in spans:
        torch.testing.assert_close(out[span.offset:span.offset + span.num_tokens],
                                   reference(q, layer_kv, span, window), rtol=1e-5, atol=1e-5)
    chunk = spans[2]                                         # positions 17..89 written, 16 was cached
    assert torch.equal(layer_kv[chunk.block_ids[89 // BLOCK], 0, 89 % BLOCK], k[chunk.offset + 89 - 17])
    assert torch.equal(layer_kv[spans[1].block_ids[1], 1, 0], v[spans[1].offset + 4])
    assert layout.store_rows.numel() == rows - 1             # the last request is query-only (store_from 13)


def test_a_single_cold_prefill_uses_sdpa_causal_mask():
    torch.manual_seed(2)
    span = Span(0, 0, 37, 0, tuple(range(10)))
    layout = build_layout([span], BLOCK, torch.device("cpu"))
    assert layout.causal and layout.mask(None, 2, torch.float32) is None
    assert layout.mask(8, 2, torch.float32) is not None      # a window shorter than the prompt needs the mask
    layer_kv = torch.randn(NUM_BLOCKS, 2, BLOCK, KV_HEADS, DIM)
    q, k, v = torch.randn(37, HEADS, DIM), torch.randn(37, KV_HEADS, DIM), torch.randn(37, KV_HEADS, DIM)
    store(layer_kv, layout, k, v)
    torch.testing.assert_close(attend(q, k, v, layer_kv, layout, None), reference(q, layer_kv, span, None),
                               rtol=1e-5, atol=1e-5)


def test_the_mask_repeats_each_query_row_for_the_heads_of_its_group():
    layout = build_layout([Span(0, 5, 7, 5, (0, 1)), Span(2, 2, 3, 2, (2,))], BLOCK, torch.device("cpu"))
    mask = layout.mask(None, 3, torch.float32)               # [tiles, 1, tile * groups, keys]
    assert mask.shape == (2, 1, 2 * 3, 7)
    visible = (mask[:, 0] == 0).sum(-1).tolist()             # keys each row sees: position + 1
    assert visible == [[6, 6, 6, 7, 7, 7], [3, 3, 3, 3, 3, 3]]   # the short tile's padding row repeats position 2
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}


def test_an_engine_step_makes_one_attention_call_per_layer():
    model = random_model(preset("tiny"), seed=2)
    engine = make_engine(model, chunk_size=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for length in (5, 9, 3):
        engine.submit(tokens(length, length), params)
    engine.step()                                            # three cold prefills
    engine.submit(tokens(40, 4), params)                     # joins the three decodes next step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch = engine.schedule()
        engine.finish(batch, engine.forward(batch))
    assert len(batch.spans) == 4
    calls = [e for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]
    assert len(calls) == model.config.num_layers
