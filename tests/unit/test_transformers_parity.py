"""The engine matches transformers on checkpoints transformers itself writes: Llama with llama3
RoPE scaling, Qwen2 (q/k/v bias, tied embeddings, a sliding-window layer), Mistral (sliding
window). Same greedy tokens and allclose logits for a cold prompt, a prefix reused from the
local pool, and a prefix whose raw block bytes were copied from another engine (a fetch).
Random weights, saved with save_pretrained (safetensors) into a temp dir; nothing downloaded.
Our engine runs on PREFIXPOOL_TEST_DEVICE (cpu by default, cuda on the GPU machine); the fp32
oracle stays on the CPU, and transformers' half-precision run is on our device."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from prefixpool.engine.checkpoint import load_checkpoint
from prefixpool.engine.model import Transformer
from prefixpool.engine.sampling import SamplingParams
from prefixpool.store.keys import chain
from tests.support.engine import BLOCK, DEVICE, assert_clean, copy_blocks, make_engine, tokens

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")

NUM_NEW = 8
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    # wavelengths of head_dim 16 fall in all three llama3 regimes for an original context of 64
    "llama3-rope": lambda: transformers.LlamaConfig(**SMALL, max_position_embeddings=512, rope_scaling={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-tied": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen2-sliding-layer": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=6,
                                                            max_window_layers=1),
    "mistral-sliding": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),
}
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
PREFIX, SUFFIX = tokens(18, 1), tokens(7, 2)   # 4 full blocks of 4 are shared; 25-token prompt


def spread_weights(model, seed):
    """Weights that spread the logits (HF's 0.02 init makes near-ties), norms off 1 so they count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(HF model in fp32, the directory it saved itself to)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    spread_weights(hf, seed=7)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    assert list(directory.glob("*.safetensors")), "transformers wrote safetensors"
    return hf, directory


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt], device=hf.device)).logits[0].float().cpu()


def hf_greedy(hf, prompt, num_new=NUM_NEW):
    """transformers' own forward, one full pass per token (no cache to get wrong)."""
    out = list(prompt)
    for _ in range(num_new):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(prompt):]


def run_engine(model, how):
    """(last prompt logits, stats, greedy tokens) for PREFIX + SUFFIX, cold / reused / fetched."""
    prompt = PREFIX + SUFFIX
    engine = make_engine(model)
    if how == "reused":
        engine.generate(PREFIX + tokens(5, 3), GREEDY)
    elif how == "fetched":
        holder = make_engine(model)
        holder.generate(PREFIX + tokens(5, 3), GREEDY)
        copy_blocks(holder, engine, chain(PREFIX, holder.namespace))
        assert_clean(holder)
    logits, stats = engine.prefill_logits(prompt)
    output, _ = engine.generate(prompt, GREEDY)
    assert_clean(engine)
    return logits.cpu(), stats, output


@pytest.mark.parametrize("how", ["cold", "reused", "fetched"])
def test_float32_matches_transformers(checkpoint, how):
    hf, directory = checkpoint
    model = load_checkpoint(directory, device=DEVICE)
    logits, stats, output = run_engine(model, how)
    assert stats.num_cached_tokens == (0 if how == "cold" else len(PREFIX) // BLOCK * BLOCK)
    torch.testing.assert_close(logits, hf_logits(hf, PREFIX + SUFFIX)[-1], rtol=1e-4, atol=1e-4)
    assert output == hf_greedy(hf, PREFIX + SUFFIX)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_is_as_close_to_float32_as_transformers_own(checkpoint, dtype):
    """Half precision cannot match bit for bit (op order differs); the tolerance is transformers'
    own error: our logits may stray from the fp32 answer at most 2x (+0.02) as far as theirs do."""
    hf, directory = checkpoint
    exact = hf_logits(hf, PREFIX + SUFFIX)[-1]
    hf_half = hf_logits(copy.deepcopy(hf).to(device=DEVICE, dtype=dtype), PREFIX + SUFFIX)[-1]
    logits, _, output = run_engine(load_checkpoint(directory, dtype=dtype, device=DEVICE), "fetched")
    theirs = (hf_half - exact).abs().max().item()
    ours = (logits - exact).abs().max().item()
    assert ours <= 2 * theirs + 0.02, f"ours {ours:.4f} vs transformers' {theirs:.4f} off fp32"
    assert output[:2] == hf_greedy(hf, PREFIX + SUFFIX, num_new=2)


def test_the_parity_check_would_catch_ignored_rope_scaling(tmp_path):
    """The bug this replaces: llama3 scaling read and then ignored. Without it logits differ."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama3-rope"]()).eval()
    spread_weights(hf, seed=7)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, device=DEVICE)
    assert model.config.rope_scaling is not None
    unscaled = Transformer(replace(model.config, rope_scaling=None)).to(DEVICE)
    unscaled.load_state_dict(model.state_dict())
    logits, _, _ = run_engine(unscaled, "cold")
    assert not torch.allclose(logits, hf_logits(hf, PREFIX + SUFFIX)[-1], rtol=1e-3, atol=1e-3)
