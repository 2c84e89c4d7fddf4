"""Attention for a whole step in one call: every request's queries against K,V read from its blocks.

    spans (one per request)     A: positions 40..41 (decode)   B: positions 0..70 (prefill)
    query tiles (<= tile rows)  [A 40]  [B 0..31]  [B 32..63]  [B 64..69 + padding]
    block tables, one per tile  A's blocks, B's, B's, B's      padded to the longest, never read past a tile's mask
    mask [tiles, 1, tile * groups, keys]   key position <= query position (and > query - window on sliding layers)
    one SDPA call               [tiles, kv_heads, tile * groups, dim] x [tiles, kv_heads, keys, dim]
                                (the `groups` query heads of a KV head as rows of it) -> rows back in packed order

A step's queries are cut into tiles so that a decode row does not pay for a
prefill chunk's length: a tile holds up to `tile` rows of one request. With
one request, or only short spans, each request is one tile; a single tile
that starts at position 0 (a cold prefill) is the call transformers makes:
SDPA's own causal mask with GQA over the step's K,V as computed, since its
context is exactly its own rows (is_causal needs row = position).
Padding rows repeat a real row and are dropped after the call; padded keys
are masked. K,V of the step's new positions are written into the arena before
the call, so a request attends to itself. Knows nothing of pools, keys,
weights or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_TILE = 32  # rows per tile when a step mixes long and short spans


@dataclass(frozen=True, slots=True)
class Span:
    offset: int                 # first row of this span in the packed tokens
    start: int                  # sequence position of that row
    end: int                    # one past the last position computed
    store_from: int             # positions >= store_from get their K,V written
    block_ids: tuple[int, ...]  # covering positions [0, end)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Index tensors for one step: where K,V are written, what each query tile reads."""

    store_blocks: torch.Tensor     # [S] block of each K,V written this step
    store_slots: torch.Tensor      # [S] slot within that block
    store_rows: torch.Tensor       # [S] packed row it comes from
    block_tables: torch.Tensor     # [tiles, max_blocks]
    query_rows: torch.Tensor       # [tiles, tile] packed row of each query
    query_positions: torch.Tensor  # [tiles, tile]
    output_index: torch.Tensor     # [rows] where each packed row's output sits in the flattened tiles
    num_keys: int                  # key positions [0, num_keys) cover every tile
    causal: bool                   # one tile, positions [0, num_keys): SDPA's is_causal

    def mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[tiles, 1, tile * groups, num_keys] additive (0 or -inf), or None where is_causal says it all.

        Each query row is repeated for the `groups` query heads that share a KV head
        (the row layout `attend` uses). Built once per step, in the model's dtype:
        SDPA converts a boolean mask on every call, which tripled the time of a
        cached 128-token chunk's attention over 2k keys (measured). Its size, tile * groups
        per tile and key, stays below the 2 * kv_heads * head_dim of the K,V gathered for it.
        """
        if self.causal and (window is None or window >= self.num_keys):
            return None
        keys = torch.arange(self.num_keys, device=self.query_positions.device)
        queries = self.query_positions.repeat_interleave(groups, dim=1).unsqueeze(-1)
        allowed = keys <= queries
        if window is not None:
            allowed &= keys > queries - window
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def build_layout(spans: list[Span], block_size: int, device: torch.device) -> PagedLayout:
    longest = max(span.num_tokens for span in spans)
    tile = longest if len(spans) == 1 or longest <= QUERY_TILE else QUERY_TILE
    num_keys = max(span.end for span in spans)
    max_blocks = -(-num_keys // block_size)
    tables: list[list[int]] = []
    rows: list[list[int]] = []
    positions: list[list[int]] = []
    output_index: list[int] = []
    for span in spans:
        table = list(span.block_ids[:max_blocks]) + [0] * (max_blocks - len(span.block_ids))
        for first in range(span.start, span.end, tile):
            count = min(tile, span.end - first)
            output_index.extend(range(len(tables) * tile, len(tables) * tile + count))
            row = span.offset + first - span.start
            rows.append(list(range(row, row + count)) + [row + count - 1] * (tile - count))
            positions.append(list(range(first, first + count)) + [first + count - 1] * (tile - count))
            tables.append(table)
    blocks, slots, store_rows = _stores(spans, block_size)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return PagedLayout(as_tensor(blocks), as_tensor(slots), as_tensor(store_rows), as_tensor(tables),
                       as_tensor(rows), as_tensor(positions), as_tensor(output_index), num_keys,
                       causal=len(tables) == 1 and spans[0].start == 0)


def _stores(spans: list[Span], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """(block, slot, packed row) of every position whose K,V this step writes."""
    blocks: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    for span in spans:
        for position in range(max(span.start, span.store_from), span.end):
            blocks.append(span.block_ids[position // block_size])
            slots.append(position % block_size)
            rows.append(span.offset + position - span.start)
    return blocks, slots, rows


def store(layer_kv: torch.Tensor, layout: PagedLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write this step's K,V [rows, kv_heads, dim] into one layer's arena view [blocks, 2, block_size, ...]."""
    if layout.store_rows.numel():
        layer_kv[layout.store_blocks, 0, layout.store_slots] = k[layout.store_rows]
        layer_kv[layout.store_blocks, 1, layout.store_slots] = v[layout.store_rows]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor, layout: PagedLayout,
           mask: torch.Tensor | None) -> torch.Tensor:
    """q [rows, heads, dim] against the K,V its tiles' block tables hold; [rows, heads, dim] back.

    k, v [rows, kv_heads, dim] are this step's own, already stored; read directly only when
    mask is None: one cold prefill from position 0, whose context is exactly these rows.
    """
    if mask is None:
        return _attend_causal(q, k, v)
    keys, values = (_gather(layer_kv[:, i], layout) for i in (0, 1))
    out = _attend_grouped(q[layout.query_rows], keys, values, mask)  # query [tiles, tile, heads, dim]
    return out.flatten(0, 1)[layout.output_index]


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's own causal mask over the step's K,V as computed, the call transformers makes.

    No gather from the arena, no K,V repeated per query head, no query or output reindexing:
    those copies (36 MB a layer at 2k tokens, fp32) are work transformers' prefill does not do
    (the cause of our 7% gap to it, with fresh tensors where in place would do; benchmarks/engine.md).
    """
    query, key, value = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # 4-D: 3-D takes the math path
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def _attend_grouped(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA without copying K,V: the query heads of one KV head become rows of that head.

        query [tiles, tile, kv_heads * groups, dim] -> [tiles, kv_heads, tile * groups, dim]
        mask  [tiles, 1, tile * groups, keys]          row r * groups + g: query row r, head g of its group

    A decode tile (one row) needs no copy at all; repeating K,V for every query head
    did, and took a quarter of a batch-16 decode step (4 query heads per KV head, measured).
    """
    tiles, tile, heads, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    grouped = (query.view(tiles, tile, kv_heads, groups, dim).transpose(1, 2)
               .reshape(tiles, kv_heads, tile * groups, dim))
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.view(tiles, kv_heads, tile, groups, dim).transpose(1, 2).reshape(tiles, tile, heads, dim)


def _gather(cache: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """[tiles, kv_heads, num_keys, dim]: the tiles' blocks in order."""
    return cache[layout.block_tables].flatten(1, 2)[:, :layout.num_keys].transpose(1, 2)
