"""Helpers shared by the node tests (not a test module): blocks committed with random bytes."""

import torch

from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks


def commit_random(blocks: NodeBlocks, arena: KVArena, keys, seed: int = 0) -> None:
    """Commit random bytes under `keys` in fresh blocks, cached and unheld (evicting what it must)."""
    generator = torch.Generator().manual_seed(seed)
    hold = blocks.acquire(())
    blocks.allocate(hold, len(keys))
    for block_id in hold.block_ids:
        data = torch.randint(0, 256, (arena.block_bytes,), dtype=torch.uint8, generator=generator)
        arena.write_bytes(block_id, data.numpy().tobytes())
    assert blocks.commit(hold, 0, keys) == list(keys)
    blocks.release(hold)
