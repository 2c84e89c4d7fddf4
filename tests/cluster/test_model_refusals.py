"""What the engine cannot reproduce is refused at startup, in one line naming the field:
another model_type, rope type, activation, quantization, MLP bias; never wrong numbers."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixpool.engine.checkpoint import load_checkpoint, random_model, write_checkpoint
from prefixpool.model.config_file import CheckpointError, read_config
from prefixpool.model.config import ModelConfig, preset
from prefixpool.model.rope_scaling import Llama3Scaling

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
REFUSED = {
    "model_type": ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    "rope yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
    "rope dynamic, old field": ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                                "rope_scaling.rope_type 'dynamic'"),
    "llama3 without factor": ({"rope_parameters": {**LLAMA3, "factor": None}}, "rope_scaling.factor is required"),
    "partial rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config 'gptq'"),
    "activation": ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    "mlp bias": ({"mlp_bias": True}, "mlp_bias True"),
    "layer types": ({"model_type": "mistral", "sliding_window": 4, "layer_types": ["chunked_attention"] * 2},
                    "layer_types"),
}


def tiny_dir(tmp_path, **changes):
    directory = write_checkpoint(random_model(preset("tiny")), tmp_path / "ckpt")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, **changes}))
    return directory


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, case):
    changes, message = REFUSED[case]
    with pytest.raises(CheckpointError) as caught:
        read_config(tiny_dir(tmp_path, **changes))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_old_and_new_rope_fields_read_the_same():
    new = {**preset("tiny").to_hf(), "rope_parameters": LLAMA3}
    old = {**preset("tiny").to_hf(), "rope_parameters": None, "rope_theta": 500000.0,
           "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")},
                            "type": "llama3"}}
    config = ModelConfig.from_hf(new, "m")
    assert config == ModelConfig.from_hf(old, "m")
    assert config.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192) and config.rope_theta == 500000.0
    assert ModelConfig.from_hf(config.to_hf(), "m") == config


def test_integer_weights_are_refused_by_name(tmp_path):
    directory = tiny_dir(tmp_path)
    [file] = directory.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: torch\.int8 tensors"):
        load_checkpoint(directory)


@pytest.mark.parametrize("command", ["worker", "router"])
def test_the_cli_refuses_at_startup_in_one_line(tmp_path, command):
    directory = tiny_dir(tmp_path, rope_parameters={"rope_type": "longrope"})
    result = subprocess.run([sys.executable, "-m", "prefixpool.deploy.cli", command, "--model-path", str(directory),
                             "--etcd-endpoints", "127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"prefixpool {command}: ") and "rope_scaling.rope_type 'longrope'" in lines[0]
