"""Benchmark promotion host -> device and SSD -> device against memcpy and a sequential disk read.

    python scripts/bench_tiers.py [--mib 256] [--block-mib 2] [--dir DIR]

Every row moves the same bytes (--mib, in blocks of --block-mib) and prints
GB/s and the ratio to a one-call memcpy. "device" is the KV arena on
whatever device this machine has (CPU here). SSD rows are run twice: warm
(the files are still in the page cache right after writing) and cold (each
file fsynced and dropped from the page cache with posix_fadvise DONTNEED,
which needs no root; the disk may still have its own cache).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import TierChain


def best_of(fn, setup=lambda: None, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build(num_blocks: int, block_bytes: int, host_blocks: int, directory: Path | None) -> NodeBlocks:
    elements = block_bytes // 4
    shape = ArenaShape(num_blocks, num_layers=1, block_size=1, num_kv_heads=1, head_dim=elements)
    arena = KVArena(shape, device="cuda" if torch.cuda.is_available() else "cpu")
    arena.tensor.fill_(1.0)  # fault the arena's pages in, as a serving engine's would be
    host = HostTier(host_blocks, arena.block_bytes) if host_blocks else None
    disk = DiskTier(directory, arena.block_bytes, num_blocks * 2, queue_blocks=num_blocks * 2) if directory else None
    return NodeBlocks(BlockPool(num_blocks), TierChain(arena, host, disk))


def compute(tiered: NodeBlocks, keys, fill: bool) -> None:
    hold = tiered.acquire(())
    tiered.allocate(hold, len(keys))
    for block_id in hold.block_ids if fill else ():
        tiered.tiers.arena.view(block_id).fill_(float(block_id))
    tiered.commit(hold, 0, keys)
    tiered.release(hold)
    tiered.take_changes()  # nobody publishes here


def fill_lower(tiered: NodeBlocks, keys) -> None:
    """Compute `keys` on the device, then push them all down by filling the device with others."""
    for offset in range(0, len(keys), tiered.num_blocks):
        compute(tiered, keys[offset : offset + tiered.num_blocks], fill=True)
    compute(tiered, chain(range(10**6, 10**6 + tiered.num_blocks), NS), fill=False)
    if tiered.tiers.disk is not None:
        tiered.tiers.disk.flush()


NS = Namespace("bench", block_size=1)


def promote_seconds(tiered: NodeBlocks, keys, before=lambda: None) -> float:
    before()
    start = time.perf_counter()
    tiered.promote(keys)
    if tiered.tiers.arena.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see benchmarks/tiers.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    total = args.mib << 20
    block_bytes = int(args.block_mib * (1 << 20))
    num_blocks = total // block_bytes
    keys = chain(range(num_blocks), NS)
    rows: list[tuple[str, float]] = []

    # The lambdas take the buffers as defaults: the `del` below frees them once measured.
    src, dst = torch.ones(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    rows.append(("memcpy: torch copy_, one call", best_of(lambda dst=dst, src=src: dst.copy_(src))))
    a, b = np.ones(total, np.uint8), np.empty(total, np.uint8)
    rows.append(("memcpy: numpy copyto, one call", best_of(lambda b=b, a=a: np.copyto(b, a))))
    del src, dst, a, b

    host = build(num_blocks, block_bytes, num_blocks, None)
    times = []
    for _ in range(3):
        fill_lower(host, keys)
        times.append(promote_seconds(host, keys))
    rows.append((f"promote host -> {host.tiers.arena.device.type} (NodeBlocks.promote)", min(times)))
    del host

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        base = Path(directory)
        big = base / "sequential.bin"
        big.write_bytes(np.ones(total, np.uint8).tobytes())
        buffer = bytearray(total)

        def read_big():
            with open(big, "rb", buffering=0) as file:
                file.readinto(buffer)

        rows.append(("sequential read, one file, page cache warm", best_of(read_big)))
        rows.append(("sequential read, one file, cold (fadvise)", best_of(read_big, lambda: drop_cache([big]))))
        big.unlink()

        disk = build(num_blocks, block_bytes, 0, base / "blocks")
        files = lambda: list((base / "blocks").glob("*.blk"))  # noqa: E731
        warm, cold = [], []
        for _ in range(3):
            fill_lower(disk, keys)
            warm.append(promote_seconds(disk, keys))
            fill_lower(disk, keys)
            cold.append(promote_seconds(disk, keys, lambda: drop_cache(files())))
        disk.close()
        rows.append((f"promote SSD -> {disk.tiers.arena.device.type}, page cache warm (verify + copy)", min(warm)))
        rows.append((f"promote SSD -> {disk.tiers.arena.device.type}, cold (fadvise)", min(cold)))

    base_gbs = total / rows[0][1] / 1e9
    print(f"### Promotion cost: {args.mib} MiB in {num_blocks} blocks of {args.block_mib:g} MiB, "
          f"torch threads {args.threads}\n")
    print("| path | ms | GB/s | x memcpy |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        gbs = total / seconds / 1e9
        print(f"| {name} | {seconds * 1e3:.1f} | {gbs:.2f} | {gbs / base_gbs:.2f} |")


if __name__ == "__main__":
    main()
