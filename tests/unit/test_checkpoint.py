"""Checkpoints: a written tiny checkpoint loads back to the same logits; a directory whose
tensors do not match its config.json is refused with an error naming the tensors."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixpool.engine.checkpoint import load_checkpoint, random_model, write_checkpoint
from prefixpool.model.config_file import CheckpointError, read_config
from prefixpool.engine.scheduler import Engine
from prefixpool.engine.torch_dtype import dtype_name, torch_dtype
from prefixpool.model.config import (DTYPE_BYTES, ConfigError, ModelConfig, arena_shape_for, namespace_for, preset)
from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool


def last_logits(model, prompt):
    arena = KVArena(arena_shape_for(model.config, 16, 4), model.dtype)
    engine = Engine(model, NodeBlocks(BlockPool(16)), arena, namespace_for(model.config, dtype_name(model.dtype), 4))
    return engine.prefill_logits(prompt)[0]


@pytest.mark.parametrize("config", [preset("tiny"),
                                    replace(preset("tiny"), attention_bias=True, model_type="qwen2"),
                                    replace(preset("tiny"), tie_word_embeddings=True)],
                         ids=["llama", "qwen2-bias", "tied"])
def test_a_written_checkpoint_loads_to_the_same_logits(tmp_path, config):
    model = random_model(config, seed=3)
    write_checkpoint(model, tmp_path / "ckpt", num_files=2)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 2
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == replace(config, name="ckpt")
    prompt = [5, 80, 13, 200, 7, 7, 1, 99, 42]
    assert torch.equal(last_logits(loaded, prompt), last_logits(model, prompt))
    if config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_loading_in_bfloat16(tmp_path):
    model = random_model(preset("tiny"), seed=3)
    loaded = load_checkpoint(write_checkpoint(model, tmp_path / "c"), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight.bfloat16())


def test_tensors_that_do_not_match_config_are_refused_by_name(tmp_path):
    directory = write_checkpoint(random_model(preset("tiny")), tmp_path / "c")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: config\.json implies "
                                              r"\[96, 64\], file has \[128, 64\]"):
        load_checkpoint(directory)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    directory = write_checkpoint(random_model(preset("tiny")), tmp_path / "c")
    [file] = directory.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.9.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    assert "missing model.norm.weight [64]" in str(caught.value)
    assert "unexpected model.layers.9.extra.weight" in str(caught.value)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    directory = write_checkpoint(random_model(preset("tiny")), tmp_path / "c", num_files=2)
    first = sorted(directory.glob("*.safetensors"))[0]
    save_file({"model.norm.weight": torch.ones(64)}, str(directory / "zz-extra.safetensors"))
    save_file(load_file(first), str(first))
    with pytest.raises(CheckpointError, match="more than one file"):
        load_checkpoint(directory)


def test_a_directory_without_config_or_weights_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="lacks 'num_attention_heads'"):
        read_config(tmp_path)


def test_real_geometries_size_the_kv_cache():
    llama, qwen = preset("llama-3-8b"), preset("qwen2.5-7b")
    assert llama.kv_bytes_per_token("bfloat16") == 128 * 1024
    assert qwen.kv_bytes_per_token("bfloat16") == 56 * 1024
    shape = arena_shape_for(llama, num_blocks=1, block_size=16)
    with torch.device("meta"):
        block = torch.empty(shape.block_dims, dtype=torch.bfloat16)
    assert block.numel() * 2 == 2 * 1024 * 1024
    for config in (llama, qwen):
        assert ModelConfig.from_hf(config.to_hf(), name=config.name) == config
    assert namespace_for(llama, "bfloat16", 16).dtype == "bfloat16"


def test_bad_geometry_and_unknown_presets_are_config_errors():
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="not a multiple"):
        replace(preset("tiny"), num_kv_heads=3)


def test_the_vocab_projection_follows_a_change_of_the_lm_head_weight():
    model = random_model(preset("tiny"), seed=4)
    prompt = [5, 80, 13, 200, 7]
    before = last_logits(model, prompt)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)                 # in place: the cached [hidden, vocab] copy must not survive
    torch.testing.assert_close(last_logits(model, prompt), 2 * before)
    model.to(torch.bfloat16)                         # a stale fp32 copy would fail against bf16 activations
    torch.testing.assert_close(last_logits(model, prompt), 2 * before, rtol=0.05, atol=0.05)


def test_dtype_names_size_elements_as_torch_does():
    for name, size in DTYPE_BYTES.items():
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(ConfigError, match="unsupported dtype 'int8'"):
        namespace_for(preset("tiny"), "int8", 16)
