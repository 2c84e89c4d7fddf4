"""Model geometry: the frozen ModelConfig, its named presets, and what follows from it.

    preset        layers hidden heads/kv  vocab    use
    tiny               2     64    4/2      259    CPU tests (seconds)
    small              4    256    8/2      259    CPU benchmarks (mid-size)
    llama-3-8b        32   4096   32/8   128256    sizing, GPU runs
    qwen2.5-7b        28   3584   28/4   152064    sizing, GPU runs

A config reads from and writes to an HF-style `config.json` dict of the
llama, qwen2 or mistral family, and refuses at once, naming the field,
whatever it would get wrong (another model_type, activation, rope type,
quantization, MLP bias). Also here: the KV arena's shape and the cache
namespace a config implies, and the dtypes a setting may name, kept as names
(prefixpool.engine.torch_dtype turns one into torch's): the router reads configs
and never imports torch. Knows nothing of weights or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from prefixpool.model.rope_scaling import RopeError, RopeScaling, parse_rope, rope_to_hf
from prefixpool.store.arena_shape import ArenaShape
from prefixpool.store.keys import Namespace

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a setting may name


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
    attention_bias: bool = False      # q, k, v projections carry a bias (qwen2; llama's attention_bias)
    o_proj_bias: bool = False         # so does o_proj (llama's attention_bias only)
    eos_token_id: int | None = None
    model_type: str = "llama"
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers that attend only to the last `sliding_window` positions

    def window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: {self.num_heads} heads not a multiple of {self.num_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: rotary embeddings need an even head_dim, got {self.head_dim}")

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def to_hf(self) -> dict[str, Any]:
        sliding = set(self.sliding_layers)
        return {
            "model_type": self.model_type,
            "_name_or_path": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_parameters": rope_to_hf(self.rope_theta, self.rope_scaling),
            "sliding_window": self.sliding_window,
            "layer_types": ["sliding_attention" if i in sliding else "full_attention" for i in range(self.num_layers)],
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            **FAMILIES[self.model_type].bias_to_hf(self),
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
        """Read an HF `config.json` of the llama / qwen2 / mistral family; ConfigError names what it refuses."""
        family = FAMILIES.get(str(hf.get("model_type")))
        if family is None:
            raise ConfigError(f"model_type {hf.get('model_type')!r} is not supported "
                              f"(supported: {', '.join(FAMILIES)})")
        _refuse_unsupported(hf)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            num_layers = int(hf["num_hidden_layers"])
            theta, scaling = parse_rope(hf)
            eos = hf.get("eos_token_id")
            return cls(
                name=name,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                max_position=int(hf.get("max_position_embeddings", 8192)),
                rope_theta=theta,
                rope_scaling=scaling,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
                model_type=str(hf["model_type"]),
                **family.biases(hf),
                **_sliding(hf, family, num_layers),
            )
        except KeyError as err:
            raise ConfigError(f"config.json of {name!r} lacks {err.args[0]!r}") from err
        except RopeError as err:
            raise ConfigError(str(err)) from err


@dataclass(frozen=True)
class Family:
    """What differs between the supported model types: biases and which layers slide by default."""

    biases: Callable[[dict[str, Any]], dict[str, bool]]
    bias_to_hf: Callable[[ModelConfig], dict[str, Any]]
    default_sliding: Callable[[dict[str, Any], int], tuple[int, ...]]


FAMILIES: dict[str, Family] = {
    "llama": Family(
        biases=lambda hf: {"attention_bias": bool(hf.get("attention_bias")),
                           "o_proj_bias": bool(hf.get("attention_bias"))},
        bias_to_hf=lambda c: {"attention_bias": c.attention_bias},
        default_sliding=lambda hf, n: ()),
    "mistral": Family(
        biases=lambda hf: {},
        bias_to_hf=lambda c: {},
        default_sliding=lambda hf, n: tuple(range(n))),
    "qwen2": Family(
        biases=lambda hf: {"attention_bias": True},
        bias_to_hf=lambda c: {"use_sliding_window": bool(c.sliding_layers)},
        default_sliding=lambda hf, n: tuple(range(int(hf.get("max_window_layers") or 0), n))
        if hf.get("use_sliding_window") else ()),
}

UNSUPPORTED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("quantization_config", lambda v: v is not None, "quantized checkpoints are not supported"),
    ("hidden_act", lambda v: v not in (None, "silu"), "only silu is supported"),
    ("mlp_bias", lambda v: bool(v), "MLP biases are not supported"),
]


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    for field, refused, why in UNSUPPORTED:
        if refused(hf.get(field)):
            value = hf[field].get("quant_method", hf[field]) if isinstance(hf[field], dict) else hf[field]
            raise ConfigError(f"{field} {value!r}: {why}")


def _sliding(hf: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """The window and the layers that use it: `layer_types` when given, else the family's rule."""
    window = hf.get("sliding_window")
    if window is None or (hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window")):
        return {}
    if window <= 0:
        raise ConfigError(f"sliding_window {window!r} must be positive")
    types = hf.get("layer_types")
    if types is not None:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown or len(types) != num_layers:
            raise ConfigError(f"layer_types {sorted(unknown) or len(types)!r} not understood for {num_layers} layers")
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    else:
        layers = family.default_sliding(hf, num_layers)
    return {"sliding_window": int(window), "sliding_layers": layers} if layers else {}


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
                              rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, eos_token_id=151643,
                              model_type="qwen2"),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def with_name(config: ModelConfig, name: str) -> ModelConfig:
    return replace(config, name=name)


def dtype_bytes(name: str) -> int:
    """The size of one element of the dtype `name`; ConfigError for a dtype we do not serve."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def arena_shape_for(config: ModelConfig, num_blocks: int, block_size: int) -> ArenaShape:
    return ArenaShape(num_blocks=num_blocks, num_layers=config.num_layers, block_size=block_size,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)


def namespace_for(config: ModelConfig, dtype: str, block_size: int, revision: str = "main") -> Namespace:
    """The cache namespace: KV from another model, dtype or block size never matches."""
    dtype_bytes(dtype)  # refuses a dtype we do not serve
    return Namespace(model=config.name, revision=revision, dtype=dtype, block_size=block_size)
