"""Arenas of random KV bytes and keys for the transfer benchmarks (scripts/bench_transfer*.py).

    arena = filled_arena(2 << 20, 256 << 20)   # 128 blocks of 2 MiB, seeded by the block size
    raw_view(arena)                            # its bytes, for raw sockets and digests

Knows nothing of sockets or of what is measured.
"""

from __future__ import annotations

import torch

from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.keys import BlockKey, Namespace, chain_ids

BLOCK_SIZES = {"256 KiB": 256 << 10, "2 MiB": 2 << 20, "16 MiB": 16 << 20}


def arena_for(block_bytes: int, arena_bytes: int) -> KVArena:
    """float32 blocks of 16 tokens x 128 dims; layers make up the block size."""
    layers = block_bytes // (4 * 2 * 16 * 128)
    return KVArena(ArenaShape(arena_bytes // block_bytes, layers, 16, 1, 128))


def raw_view(arena: KVArena) -> memoryview:
    return memoryview(arena.tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def filled_arena(block_bytes: int, arena_bytes: int) -> KVArena:
    arena = arena_for(block_bytes, arena_bytes)
    generator = torch.Generator().manual_seed(block_bytes)
    arena.tensor.view(-1).view(torch.uint8).copy_(
        torch.randint(0, 256, (arena_bytes,), dtype=torch.uint8, generator=generator)
    )
    return arena


def keys_for(count: int) -> list[BlockKey]:
    return chain_ids(range(count), Namespace("bench"))
