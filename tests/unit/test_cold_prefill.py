"""A cold prefill does the work transformers does and no more: SDPA's flash kernel on the step's own
K,V with GQA (no arena gather, no K,V repeated per query head), the vocab projection for the sampled
row only, and in-place activations that leave the weights and the answer as they were."""

import torch
from torch.profiler import ProfilerActivity, profile

from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.engine.sampling import SamplingParams
from tests.support.engine import assert_clean, make_engine, tokens

PROMPT = tokens(37, 5)
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def profiled_prefill(model):
    engine = make_engine(model)
    engine.submit(PROMPT, ONE)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        batch = engine.schedule()
        output = engine.forward(batch)
    engine.finish(batch, output)
    assert_clean(engine)
    return prof.events(), output.logits


def test_cold_prefill_attention_is_one_flash_gqa_call_per_layer_on_its_own_kv():
    model = random_model(preset("tiny"), seed=3)
    config = model.config
    assert config.num_kv_heads < config.num_heads        # GQA, so a K,V repeat would show
    events, _ = profiled_prefill(model)
    names = [e.name for e in events]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == config.num_layers
    assert "aten::_scaled_dot_product_attention_math" not in names    # a 3-D call falls back to it
    assert "aten::repeat_interleave" not in names
    calls = [e for e in events if e.name == "aten::scaled_dot_product_attention"]
    for call in calls:                                    # query, key, value: [1, heads, rows, dim]
        query, key, value = call.input_shapes[:3]
        assert query == [1, config.num_heads, len(PROMPT), config.head_dim]
        assert key == value == [1, config.num_kv_heads, len(PROMPT), config.head_dim]


def test_the_vocab_projection_runs_on_the_sampled_row_only_and_gives_the_same_logits():
    model = random_model(preset("tiny"), seed=3)
    config = model.config
    events, logits = profiled_prefill(model)
    vocab_products = [e.input_shapes for e in events
                      if e.name == "aten::mm" and e.input_shapes[1] == [config.hidden_size, config.vocab_size]]
    assert vocab_products == [[[1, config.hidden_size], [config.hidden_size, config.vocab_size]]]
    every_row = full_logits(model, PROMPT)
    torch.testing.assert_close(logits[0], every_row[-1], rtol=1e-5, atol=1e-5)
    assert int(logits[0].argmax()) == int(every_row[-1].argmax())


def full_logits(model, prompt):
    """The reference: the same layers, then logits of every position (what a plain forward returns)."""
    engine = make_engine(model)
    engine.submit(prompt, ONE)
    batch = engine.schedule()
    tokens_in, positions, layout, _ = batch.model_inputs(model.device, engine.block_size)
    every = torch.arange(len(prompt))
    logits = model(tokens_in, positions, layout, engine.arena.tensor, every)
    engine.fail(batch)
    return logits


def test_in_place_activations_leave_weights_and_answers_unchanged():
    model = random_model(preset("tiny"), seed=4)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    first = make_engine(model).prefill_logits(PROMPT)[0]
    second = make_engine(model).prefill_logits(PROMPT)[0]
    assert torch.equal(first, second)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
