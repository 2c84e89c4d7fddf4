"""Model weights: load an HF-style checkpoint directory, write one, or seed a preset.

    <dir>/config.json          HF config of the llama / qwen2 / mistral family
    <dir>/*.safetensors        tensors named model.layers.{i}.self_attn.q_proj.weight, ..., lm_head.weight

Loading checks every tensor against the shapes the config implies before any
weight is used, and names each missing, unexpected, misshapen or integer
(quantized) tensor in one CheckpointError. A preset's random weights come from a CPU generator seeded
by `seed`, so every worker builds bit-identical weights. Knows nothing of
pools, requests or tokenizers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefixpool.model.config_file import CheckpointError, read_config
from prefixpool.engine.model import Transformer
from prefixpool.model.config import ModelConfig, preset, with_name
from prefixpool.engine.torch_dtype import torch_dtype

HF_PREFIX = "model."


def hf_name(name: str) -> str:
    """Our parameter name -> the HF checkpoint's (everything but lm_head sits under `model.`)."""
    return name if name.startswith("lm_head.") else HF_PREFIX + name


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    """Build the model config.json describes and fill it from the directory's safetensors."""
    directory = Path(path)
    config = read_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    with torch.device("meta"):
        model = Transformer(config)
    expected = {hf_name(name): tuple(p.shape) for name, p in model.named_parameters()}
    tensors = _read_tensors(files)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints carry the copy anyway
    _check_tensors(directory, expected, tensors)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[hf_name(name)])
    return model


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one file ({file.name})")
                tensors[name] = handle.get_tensor(name)
    return tensors


def _check_tensors(directory: Path, expected: dict[str, tuple[int, ...]],
                   tensors: dict[str, torch.Tensor]) -> None:
    problems = [f"missing {name} {list(shape)}" for name, shape in expected.items() if name not in tensors]
    problems += [f"unexpected {name} {list(t.shape)}" for name, t in tensors.items() if name not in expected]
    problems += [f"{name}: config.json implies {list(shape)}, file has {list(tensors[name].shape)}"
                 for name, shape in expected.items() if name in tensors and tuple(tensors[name].shape) != shape]
    problems += [f"{name}: {t.dtype} tensors (quantized weights) are not supported"
                 for name, t in tensors.items() if not t.is_floating_point()]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{directory}: tensors do not match config.json: {shown}")


def random_model(config: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Transformer:
    """Seeded random weights, scaled so logits spread (greedy decoding rarely meets a tie)."""
    generator = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "embed_tokens.weight":
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
    return model.to(device=device, dtype=dtype)


def write_checkpoint(model: Transformer, path: str | Path, *, num_files: int = 1) -> Path:
    """Write config.json and the weights as HF-named safetensors split over `num_files` files."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = {hf_name(name): p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    names = list(state)
    per_file = math.ceil(len(names) / num_files)
    for index in range(num_files):
        part = {name: state[name] for name in names[index * per_file:(index + 1) * per_file]}
        save_file(part, str(directory / f"model-{index + 1:05d}-of-{num_files:05d}.safetensors"))
    return directory


def build_model(model: str, model_path: str, dtype: str, device: torch.device, seed: int) -> Transformer:
    """`model_path`'s checkpoint (served as `model`), else the preset `model` with weights seeded by `seed`."""
    if model_path:
        loaded = load_checkpoint(model_path, dtype=torch_dtype(dtype), device=device)
        loaded.config = with_name(loaded.config, model)
        return loaded
    return random_model(preset(model), seed=seed, dtype=torch_dtype(dtype), device=device)
