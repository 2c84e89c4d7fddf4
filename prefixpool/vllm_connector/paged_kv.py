"""vLLM's paged KV cache seen as pool blocks: copy whole blocks (all layers, or one layer) between the two.

    vLLM, per layer:  a tensor with one dimension of size num_blocks, anywhere
                      (CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim];
                       flash attention on GPU: [2, num_blocks, block_size, kv_heads, head_dim])
    pool block:       [num_layers, per-layer block elements], one contiguous slot of the arena

              vLLM block b                         pool block p
    layer 0   layer0.select(block_dim, b)   <->    arena[p, 0, :]
    layer 1   layer1.select(block_dim, b)   <->    arena[p, 1, :]
    ...

The bytes of one pool block are therefore the same on every node that runs the
same model, dtype and block size with the same attention backend, which is what
the key namespace promises. Copies go a batch of blocks per layer at a time
(index_select / index_copy_) through a host staging buffer of that batch's rows;
the arena lives in host memory, so on a GPU that is one device-to-host (or
host-to-device) copy per layer per batch, and the staging buffer is pinned: the
copy engine reads and writes it directly, and a load's host-to-device copy runs
asynchronously (PyTorch's caching host allocator keeps a pinned buffer from reuse
until the copies that read it have run). On the CPU the same code runs unpinned.
Knows nothing of keys, etcd or the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prefixpool.store.arena import ArenaShape, KVArena


class UnsupportedLayout(ValueError):
    """A KV cache this connector cannot map to pool blocks (no block dimension, mixed dtypes...)."""


@dataclass(frozen=True)
class Layer:
    tensor: torch.Tensor
    block_dim: int

    @property
    def block_elements(self) -> int:
        return self.tensor.numel() // self.tensor.shape[self.block_dim]


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise UnsupportedLayout(f"no dimension of size {num_blocks} (the block count) "
                                f"in KV shape {tuple(tensor.shape)}")
    return dims[0]  # a leading [2, ...] split comes first; the blocks dimension is the first of that size


class PagedKV:
    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int) -> None:
        ordered = sorted(kv_caches.items(), key=_layer_order)
        self.names = [name for name, _ in ordered]  # vLLM's layer names, as wait_for_layer_load gets them
        self.layers = [Layer(t, _block_dim(t, num_blocks)) for _, t in ordered]
        if not self.layers:
            raise UnsupportedLayout("vLLM registered no KV cache layers")
        sizes = {layer.block_elements for layer in self.layers}
        dtypes = {layer.tensor.dtype for layer in self.layers}
        if len(sizes) != 1 or len(dtypes) != 1:
            raise UnsupportedLayout(f"layers differ in block size {sizes} or dtype {dtypes}")
        self.block_size = block_size
        self.block_elements = sizes.pop()
        self.dtype = dtypes.pop()
        self.device = self.layers[0].tensor.device
        self.pinned = self.device.type == "cuda"
        if self.block_elements % (2 * block_size):
            raise UnsupportedLayout(f"{self.block_elements} elements per layer block "
                                    f"is not K and V of {block_size} tokens")

    def arena_shape(self, num_blocks: int) -> ArenaShape:
        """A pool arena whose blocks hold exactly one vLLM block of every layer."""
        head_dim = self.block_elements // (2 * self.block_size)
        return ArenaShape(num_blocks, len(self.layers), self.block_size, 1, head_dim)

    def staging(self, num_blocks: int) -> torch.Tensor:
        """Host rows for one layer's batch of blocks, pinned next to a GPU."""
        return torch.empty((num_blocks, self.block_elements), dtype=self.dtype, pin_memory=self.pinned)

    def save(self, vllm_ids: Sequence[int], arena: KVArena, pool_ids: Sequence[int]) -> None:
        """vLLM blocks -> pool blocks, pairwise."""
        if not vllm_ids:
            return
        source = torch.tensor(list(vllm_ids), device=self.device)
        target = torch.tensor(list(pool_ids), device=arena.device)
        slots = arena.tensor.view(arena.num_blocks, len(self.layers), -1)
        rows = self.staging(len(vllm_ids))  # reused layer after layer: each copy into it is complete on return
        for i, layer in enumerate(self.layers):
            blocks = layer.tensor.index_select(layer.block_dim, source).movedim(layer.block_dim, 0)
            rows.view(blocks.shape).copy_(blocks)
            slots[target, i] = rows

    def load(self, arena: KVArena, pool_ids: Sequence[int], vllm_ids: Sequence[int]) -> None:
        """Pool blocks -> vLLM blocks, pairwise, every layer."""
        for index in range(len(self.layers)):
            self.load_layer(index, arena, pool_ids, vllm_ids)

    def load_layer(self, index: int, arena: KVArena, pool_ids: Sequence[int], vllm_ids: Sequence[int]) -> None:
        """Pool blocks -> vLLM blocks, pairwise, layer `index` only (a layer-wise load runs one per layer)."""
        if not vllm_ids:
            return
        layer = self.layers[index]
        source = torch.tensor(list(pool_ids), device=arena.device)
        target = torch.tensor(list(vllm_ids), device=self.device)
        slots = arena.tensor.view(arena.num_blocks, len(self.layers), -1)
        shape = list(layer.tensor.shape)
        shape.pop(layer.block_dim)
        rows = torch.index_select(slots[:, index], 0, source, out=self.staging(len(vllm_ids)))
        blocks = rows.to(self.device, non_blocking=self.pinned).reshape(len(vllm_ids), *shape)
        layer.tensor.index_copy_(layer.block_dim, target, blocks.movedim(0, layer.block_dim))


def _layer_order(item: tuple[str, torch.Tensor]) -> tuple:
    """Layer names in model order ("model.layers.10..." after "model.layers.9..."), not text order."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in item[0].split("."))
