"""Rotary position embeddings and the RoPE scalings we support, computed as transformers does.

    inv_freq[i] = 1 / theta^(2i / head_dim)          (fp32, as HF computes it)
       └─ scaling: none | linear (/ factor) | llama3 (low frequencies / factor, a smooth ramp between)
    angle(p, i) = p * inv_freq[i]                     cos/sin cast to the input's dtype, rotate-half layout

`parse_rope` reads a config.json's `rope_parameters` (transformers 5) or
`rope_scaling` (older files) and refuses a rope type it does not know, naming
the field: wrong positions would give wrong numbers, silently. Knows nothing
of attention, arenas or checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


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
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


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


class Rotary(nn.Module):
    """cos/sin of each position, computed per step (no table: 128k-position models stay cheap).

    inv_freq is a plain fp32 attribute, not a buffer, so casting the model to
    bf16 (or building it on the meta device) leaves it exact.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        self.inv_freq = scaling.apply(inv_freq) if scaling is not None else inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, 1, head_dim] each, in `dtype`, to broadcast over heads."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] rotated in place of its dtype, HF's rotate-half layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
