"""How a step's numbers are computed: the shapes its per-token work and its attention run in.

    model.forward(..., kernels)
        kernels.rows(fn, *per_row)     per-token work (norms, rotary, projections, MLP, lm_head) over rows
        kernels.attention(layout, ...) the step's attention, built once, then .attend(...) by each layer

StandardKernels, the default, runs each piece on the whole step at once and
attention through SDPA: the fastest shapes torch picks, whose bf16 results
depend on what shares the step (prefixpool/engine/invariant.py has the mode that
does not). An engine picks its kernels once, at construction. Knows nothing of
weights, pools or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from prefixpool.engine.invariant import InvariantKernels
from prefixpool.engine.paged_attention import PagedLayout, attend


class StepAttention(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
               window: int | None) -> torch.Tensor:
        """q [rows, heads, dim] (k, v: this step's own, already stored) -> [rows, heads, dim]."""


class Kernels(Protocol):
    def rows(self, fn: Callable[..., Any], *per_row: torch.Tensor) -> Any:
        """fn(*per_row): tensors with one row per token in, a tensor or a tuple of them out."""

    def attention(self, layout: PagedLayout, windows: set[int | None], groups: int, dtype: torch.dtype,
                  block_size: int) -> StepAttention:
        """The step's attention for layers with these sliding windows (None: full), `groups` query heads
        per KV head, in the model's `dtype`, over an arena of `block_size`-token blocks."""


@dataclass(frozen=True)
class MaskedAttention:
    """SDPA over the layout's tiles, with one additive mask per window built for the whole step."""

    layout: PagedLayout
    masks: dict[int | None, torch.Tensor | None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
               window: int | None) -> torch.Tensor:
        return attend(q, k, v, layer_kv, self.layout, self.masks[window])


class StandardKernels:
    """Every piece on the whole step in one call."""

    def rows(self, fn: Callable[..., Any], *per_row: torch.Tensor) -> Any:
        return fn(*per_row)

    def attention(self, layout: PagedLayout, windows: set[int | None], groups: int, dtype: torch.dtype,
                  block_size: int) -> StepAttention:
        return MaskedAttention(layout, {window: layout.mask(window, groups, dtype) for window in windows})


STANDARD = StandardKernels()


def kernels_for(batch_invariant: bool, device: torch.device) -> Kernels:
    """An engine's kernels: batch-invariant ones (tile sizes by device type), else the standard ones."""
    return InvariantKernels.for_device(device) if batch_invariant else STANDARD
