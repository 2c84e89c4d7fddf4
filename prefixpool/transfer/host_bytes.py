"""Zero-copy byte views of an arena's blocks in host memory, cut from one view of the whole arena.

`KVArena.writable_bytes(block_id)` builds a tensor view, a numpy array and a
memoryview per call (several microseconds); for 256 KiB blocks streamed at
line rate that is a real share of the time budget. One memoryview of the
whole arena, sliced per block, costs a fraction of a microsecond. Relies on
the arena's layout: block i is the contiguous byte range
[i * block_bytes, (i + 1) * block_bytes). Knows nothing of keys, pools or networks.
"""

from __future__ import annotations

from typing import Callable

import torch

from prefixpool.store.arena import KVArena


def host_blocks(arena: KVArena) -> Callable[[int], memoryview] | None:
    """block_id -> writable view of its bytes, or None where the arena is not in host memory."""
    if arena.device.type != "cpu" or not arena.tensor.is_contiguous():
        return None
    whole = memoryview(arena.tensor.view(-1).view(torch.uint8).numpy()).cast("B")
    size = arena.block_bytes
    return lambda block_id: whole[block_id * size : (block_id + 1) * size]
