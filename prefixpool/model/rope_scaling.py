"""RoPE as config.json describes it: theta, the scalings we support, and their HF spelling.

    rope_type: default | linear (inv_freq / factor) | llama3 (low frequencies / factor, a smooth ramp between)

`parse_rope` reads a config.json's `rope_parameters` (transformers 5) or
`rope_scaling` (older files) and refuses a rope type it does not know, naming
the field: wrong positions would give wrong numbers, silently. A scaling's
`apply` works on whatever tensor it is given through the tensor's own methods,
so this module (and the router, which reads configs) never imports torch.
Knows nothing of attention, arenas or checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


class RopeError(ValueError):
    """A rope configuration this engine cannot reproduce."""


@dataclass(frozen=True)
class LinearScaling:
    factor: float

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's: wavelengths above original/low_freq_factor slow down by `factor`, below
    original/high_freq_factor stay, and those between are interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = (inv_freq / self.factor).where(wavelen > low_freq_wavelen, inv_freq)
        smooth = ((self.original_max_position / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return smoothed.where(is_medium, scaled)


RopeScaling = LinearScaling | Llama3Scaling


def _field(params: dict[str, Any], name: str, rope_type: str) -> Any:
    if params.get(name) is None:
        raise RopeError(f"rope_scaling.{name} is required for rope_type {rope_type!r}")
    return params[name]


def _linear(params: dict[str, Any], max_position: int) -> LinearScaling:
    return LinearScaling(float(_field(params, "factor", "linear")))


def _llama3(params: dict[str, Any], max_position: int) -> Llama3Scaling:
    return Llama3Scaling(
        factor=float(_field(params, "factor", "llama3")),
        low_freq_factor=float(_field(params, "low_freq_factor", "llama3")),
        high_freq_factor=float(_field(params, "high_freq_factor", "llama3")),
        original_max_position=int(params.get("original_max_position_embeddings") or max_position),
    )


SCALINGS: dict[str, Callable[[dict[str, Any], int], RopeScaling | None]] = {
    "default": lambda params, max_position: None,
    "linear": _linear,
    "llama3": _llama3,
}


def parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from an HF config dict; RopeError for what we cannot reproduce."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SCALINGS:
        raise RopeError(f"rope_scaling.rope_type {rope_type!r} is not supported (supported: {', '.join(SCALINGS)})")
    if float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0) != 1.0:
        raise RopeError("partial_rotary_factor != 1 is not supported")
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    return theta, SCALINGS[rope_type](params, int(hf.get("max_position_embeddings") or 8192))


def rope_to_hf(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The `rope_parameters` dict transformers 5 writes."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if isinstance(scaling, LinearScaling):
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}
