"""Model geometry: the frozen ModelConfig, its named presets, and what follows from it.

    preset        layers hidden heads/kv  vocab    use
    tiny               2     64    4/2      259    CPU tests (seconds)
    small              4    256    8/2      259    CPU benchmarks (mid-size)
    llama-3-8b        32   4096   32/8   128256    sizing, GPU runs
    qwen2.5-7b        28   3584   28/4   152064    sizing, GPU runs

A config reads from and writes to an HF-style `config.json` dict. Also here:
the KV arena's shape and the cache namespace a config implies, and the torch
dtype and device named by a setting. Knows nothing of weights or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from store.arena import ArenaShape
from store.keys import Namespace

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """A config.json (or preset name) that does not describe a model we can run."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: {self.num_heads} heads not a multiple of {self.num_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: rotary embeddings need an even head_dim, got {self.head_dim}")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    def to_hf(self) -> dict[str, Any]:
        return {
            "model_type": "qwen2" if self.attention_bias else "llama",
            "_name_or_path": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
        """Read an HF `config.json` of the Llama / Qwen2 family."""
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            return cls(
                name=name,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                max_position=int(hf.get("max_position_embeddings", 8192)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as err:
            raise ConfigError(f"config.json of {name!r} lacks {err.args[0]!r}") from err


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", vocab_size=259, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=257),
    "small": ModelConfig("small", vocab_size=259, hidden_size=256, intermediate_size=512, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=32, eos_token_id=257),
    "llama-3-8b": ModelConfig("llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position=8192,
                              rope_theta=500000.0, eos_token_id=128001),
    "qwen2.5-7b": ModelConfig("qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position=32768,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, eos_token_id=151643),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def with_name(config: ModelConfig, name: str) -> ModelConfig:
    return replace(config, name=name)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` is CUDA when present, else CPU; anything else is passed to torch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def arena_shape_for(config: ModelConfig, num_blocks: int, block_size: int) -> ArenaShape:
    return ArenaShape(num_blocks=num_blocks, num_layers=config.num_layers, block_size=block_size,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)


def namespace_for(config: ModelConfig, dtype: torch.dtype, block_size: int, revision: str = "main") -> Namespace:
    """The cache namespace: KV from another model, dtype or block size never matches."""
    return Namespace(model=config.name, revision=revision, dtype=dtype_name(dtype), block_size=block_size)
