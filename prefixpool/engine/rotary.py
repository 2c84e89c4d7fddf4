"""Rotary position embeddings, computed as transformers does.

    inv_freq[i] = 1 / theta^(2i / head_dim)          (fp32, as HF computes it)
       └─ scaling: none | linear (/ factor) | llama3 (low frequencies / factor, a smooth ramp between)
    angle(p, i) = p * inv_freq[i]                     cos/sin cast to the input's dtype, rotate-half layout

The scalings themselves, and how a config.json names them, live in
prefixpool.model.rope_scaling. Knows nothing of attention, arenas or checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from prefixpool.model.rope_scaling import RopeScaling


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
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1).mul_(sin)
    return rotated.add_(x * cos)  # x * cos + rotated * sin, summed into one of the fresh tensors
