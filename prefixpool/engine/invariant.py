"""The batch-invariant mode: a token's results are the same bits whatever chunk, batch or cached length it has.

    kernels.rows(fn, x, ...)   per-token work in tiles of `tile_rows` rows, every call the same shape:
        x [rows, ...] ─▶ [tile 0][tile 1]...[last tile + zero rows] ─▶ fn(tile) each ─▶ rows back, padding dropped
    kernels.attention(...)     fixed-split attention (prefixpool/engine/split_attention.py)

A matrix multiply rounds differently for different row counts in bf16 (on a
GPU already from 38 rows on; the kernel choice depends on the shape), so a
token's K,V, hidden state and logits would depend on how many tokens shared
its call. Here every matmul, norm and rotary call sees exactly `tile_rows`
rows, and a row's result depends on its own values only. The tile is a
constant of the mode per device type: workers that exchange blocks must use
the same one. Costs: padding (a decode step of one request computes a whole
tile), one call per tile, and attention in fp32 over fixed splits. Knows
nothing of weights, pools or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from prefixpool.engine.paged_attention import PagedLayout
from prefixpool.engine.split_attention import Pairs, Splits, SubTiles, attend_split, pairs_for, sub_tiles

if TYPE_CHECKING:  # the protocols these classes meet; prefixpool.engine.kernels picks them
    from prefixpool.engine.kernels import StepAttention


@dataclass(frozen=True)
class SplitAttention:
    """The step's sub-tiles and, per sliding window, the (sub-tile, split) pairs to compute."""

    tiles: SubTiles
    pairs: dict[int | None, Pairs]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
               window: int | None) -> torch.Tensor:
        return attend_split(q, layer_kv, self.tiles, self.pairs[window], window)


@dataclass(frozen=True)
class InvariantKernels:
    tile_rows: int   # rows of every per-token call
    splits: Splits   # the attention's sub-tiles, key splits and pairs per call

    @classmethod
    def for_device(cls, device: torch.device) -> "InvariantKernels":
        return BY_DEVICE.get(torch.device(device).type, BY_DEVICE["cpu"])

    def rows(self, fn: Callable[..., Any], *per_row: torch.Tensor) -> Any:
        num_rows = per_row[0].shape[0]
        if num_rows == 0:  # e.g. the lm_head of a step whose chunks all end mid-prompt
            return fn(*per_row)
        outputs: list[torch.Tensor] | None = None
        for begin in range(0, num_rows, self.tile_rows):
            result = fn(*(self._tile(t, begin) for t in per_row))
            parts = result if isinstance(result, tuple) else (result,)
            if outputs is None:
                outputs = [part.new_empty((-(-num_rows // self.tile_rows) * self.tile_rows, *part.shape[1:]))
                           for part in parts]
            for out, part in zip(outputs, parts):
                out[begin:begin + self.tile_rows] = part
        assert outputs is not None
        trimmed = tuple(out[:num_rows] for out in outputs)
        return trimmed if len(trimmed) > 1 else trimmed[0]

    def _tile(self, t: torch.Tensor, begin: int) -> torch.Tensor:
        tile = t[begin:begin + self.tile_rows]
        missing = self.tile_rows - tile.shape[0]
        if missing == 0:
            return tile
        return torch.cat([tile, tile.new_zeros((missing, *tile.shape[1:]))])

    def attention(self, layout: PagedLayout, windows: set[int | None], groups: int, dtype: torch.dtype,
                  block_size: int) -> StepAttention:
        tiles = sub_tiles(layout, self.splits)
        device = layout.query_rows.device
        return SplitAttention(tiles, {window: pairs_for(tiles, window, block_size, device) for window in windows})


# Constants of the mode, per device type (prefixpool/engine/split_attention.py says what each costs). A GPU: a
# matmul costs about the same for 128 rows as for 1, and each call is a kernel launch; a CPU: pay per row, not per call.
BY_DEVICE = {"cuda": InvariantKernels(tile_rows=128, splits=Splits(rows=16, keys=256, pairs=16)),
             "cpu": InvariantKernels(tile_rows=16, splits=Splits(rows=8, keys=256, pairs=1))}
