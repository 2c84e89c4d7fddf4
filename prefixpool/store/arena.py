"""The KV arena: one tensor holding every block's keys and values.

    shape [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

A block id selects a contiguous slice: a zero-copy view for attention, and
its raw bytes for transfer. On CPU those bytes are a writable memoryview of
the tensor itself, so a socket can `recv_into` a block directly; on CUDA they
are staged through host memory. Knows nothing of keys, ref counts or networks.
"""

from __future__ import annotations

import torch

from prefixpool.store.arena_shape import ArenaShape


class BlockSizeMismatch(ValueError):
    """Bytes offered for a block do not have the block's exact size."""


class KVArena:
    def __init__(self, shape: ArenaShape, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self.tensor = torch.zeros((shape.num_blocks, *shape.block_dims), dtype=dtype, device=self.device)
        self.block_bytes = self.tensor[0].numel() * self.tensor.element_size()

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    def view(self, block_id: int) -> torch.Tensor:
        """Zero-copy view of one block: [num_layers, 2, block_size, kv_heads, head_dim]."""
        return self.tensor[block_id]

    def _raw(self, block_id: int) -> torch.Tensor:
        return self.tensor[block_id].view(-1).view(torch.uint8)

    def read_bytes(self, block_id: int) -> memoryview:
        """The block's bytes: zero-copy on CPU, one device-to-host copy on CUDA."""
        raw = self._raw(block_id)
        if raw.device.type != "cpu":
            raw = raw.cpu()
        return memoryview(raw.numpy()).cast("B")

    def writable_bytes(self, block_id: int) -> memoryview | None:
        """A writable memoryview straight into the block, or None where the arena is not in host memory."""
        if self.device.type != "cpu":
            return None
        return memoryview(self._raw(block_id).numpy()).cast("B")

    def write_bytes(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one block with exactly `block_bytes` bytes."""
        size = memoryview(data).nbytes
        if size != self.block_bytes:
            raise BlockSizeMismatch(f"block is {self.block_bytes} bytes, got {size}")
        source = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        self._raw(block_id).copy_(source)
