"""The KV arena's shape: how many blocks, and the dimensions of one.

    block_dims = [num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

Plain numbers, apart from prefixpool.store.arena's tensor, so whoever only sizes an arena
(a model config, the router) does not import torch. Knows nothing of dtypes or devices.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArenaShape:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_dims(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
