"""Attention whose every query row comes out the same bits whatever shares its step: fixed-split attention.

    the layout's query tiles ─▶ sub-tiles of R rows (one request each; padding repeats a real row)
    keys, by absolute position ─▶ splits [0, S) [S, 2S) ...       a row reads the splits its keys fall in
    pairs (sub-tile, split) ─▶ calls of P pairs each (the last call padded by repeating its last pair)
        scores  [P, kv_heads, R * groups, S] = q · Kᵀ · scale     fp32, one batched matmul
        masked (key > row, or out of the window) ─▶ -inf;  m = max,  l = Σ exp(s - m),  o = exp(s - m) · V
    merge, per sub-tile, in split order 0, 1, 2, ...:  M = max m;  out = Σ e^(m-M)·o / Σ e^(m-M)·l

Every matmul and reduction of a split runs on tensors of one shape, whatever
the chunk, the batch or the cached length (elementwise ops give each element
the same bits at any shape); a row's splits start at fixed key positions,
and a split that holds none of a row's keys adds exact zeros to it.
So a row's output depends only on its query, its position and the K,V of its
keys (the reduction SDPA does differently for different query counts, and a
GPU's kernel choice, do not enter). Costs: a decode row computes a whole
sub-tile, a row's last split is read whole, a call is padded to P pairs, and
K,V are gathered per pair. R, S and P (Splits) are constants of the mode:
engines that exchange blocks use the same. Knows nothing of weights, pools or
scheduling; reads the K,V `store` wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prefixpool.engine.paged_attention import PagedLayout


@dataclass(frozen=True, slots=True)
class Splits:
    rows: int   # R: query rows of a sub-tile
    keys: int   # S: keys of a split, from key position 0
    pairs: int  # P: (sub-tile, split) pairs per matmul call (fewer calls, more padding)


@dataclass(frozen=True, slots=True)
class SubTiles:
    """The step's queries regrouped in R-row sub-tiles; index tensors on the model's device."""

    splits: Splits
    rows: torch.Tensor           # [sub, R] packed row of each query
    positions: torch.Tensor      # [sub, R] (host)
    tables: torch.Tensor         # [sub, max_blocks] block table of each sub-tile (host)
    output_index: torch.Tensor   # [packed rows] where each row's output sits in the flattened sub-tiles
    row_positions: torch.Tensor  # [sub, R] on the device


def sub_tiles(layout: PagedLayout, splits: Splits) -> SubTiles:
    """Cut the layout's tiles into R-row sub-tiles, dropping those that hold only padding."""
    size = splits.rows
    positions, rows = layout.query_positions.cpu(), layout.query_rows.cpu()
    num_tiles, width = positions.shape
    real = torch.zeros(num_tiles * width, dtype=torch.bool)
    real[layout.output_index.cpu()] = True
    padded = -(-width // size) * size  # a layout tile's width, rounded up to whole sub-tiles
    pad = lambda t: torch.cat([t, t[:, -1:].expand(-1, padded - width)], 1).view(-1, size)  # noqa: E731
    keep = pad(real.view(num_tiles, width)).any(1).nonzero().flatten()
    renumber = torch.full((num_tiles * padded // size,), -1, dtype=torch.int64)
    renumber[keep] = torch.arange(len(keep))
    flat = layout.output_index.cpu()
    in_padded = flat // width * padded + flat % width
    output_index = renumber[in_padded // size] * size + in_padded % size
    tables = layout.block_tables.cpu()[keep * size // padded]
    device = layout.query_rows.device
    kept_positions = pad(positions)[keep]
    return SubTiles(splits, pad(rows)[keep].to(device), kept_positions, tables, output_index.to(device),
                    kept_positions.to(device))


@dataclass(frozen=True, slots=True)
class Pairs:
    """The (sub-tile, split) pairs one window's attention computes, in calls of P, and how to merge them."""

    sub: torch.Tensor            # [calls * P] sub-tile of each pair
    key_blocks: torch.Tensor     # [calls * P, S] block of each key
    key_slots: torch.Tensor      # [calls * P, S] slot in that block
    key_positions: torch.Tensor  # [calls * P, S]
    merge: torch.Tensor          # [sub, most splits] pair of each sub-tile's k-th split; num_pairs: none (zeros)
    num_pairs: int


def pairs_for(tiles: SubTiles, window: int | None, block_size: int, device: torch.device) -> Pairs:
    """Every split some row of a sub-tile reads under `window`, sub-tile by sub-tile, splits in order."""
    keys, per_call = tiles.splits.keys, tiles.splits.pairs
    last = tiles.positions.amax(1) // keys
    first = torch.zeros_like(last) if window is None else (tiles.positions.amin(1) - window + 1).clamp(min=0) // keys
    counts = last - first + 1
    sub = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    split = first[sub] + torch.arange(len(sub)) - starts[sub]
    num_pairs = len(sub)
    padding = -(-num_pairs // per_call) * per_call - num_pairs
    sub = torch.cat([sub, sub[-1:].expand(padding)])
    split = torch.cat([split, split[-1:].expand(padding)])
    positions = split.unsqueeze(1) * keys + torch.arange(keys)
    table = tiles.tables[sub]
    columns = (positions // block_size).clamp(max=table.shape[1] - 1)  # past the table: masked for every row
    merge = torch.full((len(counts), int(counts.max())), num_pairs, dtype=torch.int64)
    merge[sub[:num_pairs], torch.arange(num_pairs) - starts[sub[:num_pairs]]] = torch.arange(num_pairs)
    to = lambda t: t.to(device)  # noqa: E731
    return Pairs(to(sub), to(table.gather(1, columns)), to(positions % block_size), to(positions), to(merge),
                 num_pairs)


def attend_split(q: torch.Tensor, layer_kv: torch.Tensor, tiles: SubTiles, pairs: Pairs,
                 window: int | None) -> torch.Tensor:
    """q [rows, heads, dim] against the K,V in one layer's arena view; [rows, heads, dim] in q's dtype back."""
    num_sub, size, per_call = tiles.rows.shape[0], tiles.splits.rows, tiles.splits.pairs
    heads, dim = q.shape[1:]
    kv_heads = layer_kv.shape[-2]
    groups = heads // kv_heads
    query = (q[tiles.rows].float().view(num_sub, size, kv_heads, groups, dim).transpose(1, 2)
             .reshape(num_sub, kv_heads, size * groups, dim))
    row_positions = tiles.row_positions.repeat_interleave(groups, 1)  # [sub, R * groups]
    parts = [_partial(query, row_positions, layer_kv, pairs, slice(begin, begin + per_call), window)
             for begin in range(0, len(pairs.sub), per_call)]
    out = _merge(*(torch.cat(column) for column in zip(*parts)), pairs)  # [sub, kv_heads, R * groups, dim]
    out = out.view(num_sub, kv_heads, size, groups, dim).transpose(1, 2).reshape(num_sub * size, heads, dim)
    return out[tiles.output_index].to(q.dtype)


def _partial(query: torch.Tensor, row_positions: torch.Tensor, layer_kv: torch.Tensor, pairs: Pairs,
             part: slice, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, Σ exp, Σ exp · V) of P pairs, each row over one split: [P, kv_heads, R * groups(, dim)]."""
    sub = pairs.sub[part]
    blocks, slots = pairs.key_blocks[part], pairs.key_slots[part]
    keys = layer_kv[blocks, 0, slots].float().permute(0, 2, 3, 1)    # [P, kv_heads, dim, S]
    values = layer_kv[blocks, 1, slots].float().transpose(1, 2)      # [P, kv_heads, S, dim]
    scores = torch.matmul(query[sub], keys).mul_(1.0 / math.sqrt(query.shape[-1]))
    rows = row_positions[sub].unsqueeze(-1)                          # [P, R * groups, 1]
    key_positions = pairs.key_positions[part].unsqueeze(1)           # [P, 1, S]
    hidden = key_positions > rows
    if window is not None:
        hidden |= key_positions <= rows - window
    scores.masked_fill_(hidden.unsqueeze(1), float("-inf"))
    maxima = scores.amax(-1)
    safe = torch.where(maxima == float("-inf"), torch.zeros_like(maxima), maxima)  # a split all hidden: zeros
    weights = torch.exp(scores.sub_(safe.unsqueeze(-1)))
    return maxima, weights.sum(-1), torch.matmul(weights, values)


def _merge(maxima: torch.Tensor, sums: torch.Tensor, outputs: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """Combine each sub-tile's splits in split order; the index num_pairs stands for a split with nothing."""
    maxima = torch.cat([maxima[:pairs.num_pairs], torch.full_like(maxima[:1], float("-inf"))])
    sums = torch.cat([sums[:pairs.num_pairs], torch.zeros_like(sums[:1])])
    outputs = torch.cat([outputs[:pairs.num_pairs], torch.zeros_like(outputs[:1])])
    per_split = maxima[pairs.merge]                                  # [sub, most splits, kv_heads, R * groups]
    scales = torch.exp(per_split - per_split.amax(1, keepdim=True))
    total = torch.zeros_like(scales[:, 0])
    out = torch.zeros(total.shape + outputs.shape[-1:], dtype=outputs.dtype, device=outputs.device)
    for k in range(pairs.merge.shape[1]):
        index = pairs.merge[:, k]
        total += sums[index] * scales[:, k]
        out += outputs[index] * scales[:, k].unsqueeze(-1)
    return out / total.unsqueeze(-1)

