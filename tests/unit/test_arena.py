"""The KV arena: block views are zero-copy and bytes round-trip exactly."""

import pytest
import torch

from prefixpool.store.arena import ArenaShape, BlockSizeMismatch, KVArena

SHAPE = ArenaShape(num_blocks=4, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_round_trip_between_arenas(dtype):
    a, b = KVArena(SHAPE, dtype), KVArena(SHAPE, dtype)
    a.view(1).copy_(torch.randn(SHAPE.block_dims).to(dtype))
    b.write_bytes(3, a.read_bytes(1))
    assert torch.equal(a.view(1), b.view(3))
    assert a.block_bytes == 2 * 2 * 16 * 2 * 8 * a.tensor.element_size()


def test_views_are_zero_copy():
    arena = KVArena(SHAPE)
    arena.view(2).fill_(1.5)
    assert arena.tensor[2].eq(1.5).all()
    raw = arena.writable_bytes(0)
    raw[:4] = torch.tensor([2.0]).numpy().tobytes()
    assert arena.tensor[0].flatten()[0].item() == 2.0


def test_wrong_size_is_rejected_and_changes_nothing():
    arena = KVArena(SHAPE)
    with pytest.raises(BlockSizeMismatch):
        arena.write_bytes(0, b"\x01" * (arena.block_bytes - 1))
    assert arena.tensor.eq(0).all()
