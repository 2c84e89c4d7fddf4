"""Per-block CPU cost of our TCP path's own work, without a network: where a 256 KiB block's time goes.

    python scripts/bench_transfer_blocks.py [--arena-mib 256] [--repeat 5]

For each block size, on one arena of random blocks, CPU time (process time,
best of `repeat`, so other processes' load hardly counts) per block of:
  - memcpy      one copy of the block (what the kernel does per side per block);
  - xxh3        the checksum alone (what verification costs per side);
  - holder      TcpServer's per-block work minus the socket: pin, then
                BlockSource.records (checksum, header) and packing the header;
  - receiver    the receive loop minus the socket: the scatter buffers, then
                _Records.consume (header parse and check, verify, commit).
The syscalls and the kernel's copies are what the raw socket pays too; this
isolates what ours adds. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import xxhash

from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.record import header_for
from prefixpool.transfer.sink import BlockSink
from prefixpool.transfer.source import BlockSource
from prefixpool.testing.bench_arenas import BLOCK_SIZES, arena_for, filled_arena, keys_for, raw_view
from prefixpool.transfer.tcp import _record_buffers, _Records


def cpu_best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.process_time()
        fn()
        best = min(best, time.process_time() - began)
    return best


def holding(arena, keys) -> BlockSource:
    blocks = NodeBlocks(BlockPool(arena.num_blocks))
    hold = blocks.acquire(())
    blocks.allocate(hold, arena.num_blocks)
    blocks.commit(hold, 0, keys)
    blocks.release(hold)
    return BlockSource(blocks, arena)


def holder_pass(source: BlockSource, keys) -> None:
    async def serve() -> None:
        async with source.pinned(keys) as outgoing:
            async for header, payload in source.records(outgoing):
                header.pack()

    asyncio.run(serve())


def receiver_pass(arena, keys, wire_headers: list[bytes]) -> None:
    """The payloads are already in place (as recvmsg_into leaves them); headers are copied in like the kernel would."""
    sink = BlockSink(NodeBlocks(BlockPool(arena.num_blocks)), arena, keys)
    num_blocks = sink.expect(len(keys), arena.block_bytes)
    buffers, records = list(_record_buffers(sink, num_blocks)), _Records(sink)
    for index, header in enumerate(wire_headers):
        buffers[2 * index][:] = header
    for start in range(0, len(buffers), 64):  # one consume per scatter window, as tcp._receive does
        assert records.consume(buffers[start : start + 64])
    sink.finish()


def row(block_bytes: int, arena_bytes: int, repeat: int) -> list[float]:
    source_arena, arena = filled_arena(block_bytes, arena_bytes), arena_for(block_bytes, arena_bytes)
    keys, view = keys_for(source_arena.num_blocks), raw_view(source_arena)
    blocks = [view[i : i + block_bytes] for i in range(0, arena_bytes, block_bytes)]
    raw_view(arena)[:] = view
    wire = [header_for(key, block).pack() for key, block in zip(keys, blocks)]
    scratch = bytearray(block_bytes)
    source = holding(source_arena, keys)
    timings = [
        cpu_best(lambda: [scratch.__setitem__(slice(None), block) for block in blocks], repeat),
        cpu_best(lambda: [xxhash.xxh3_64_intdigest(block) for block in blocks], repeat),
        cpu_best(lambda: holder_pass(source, keys), repeat),
        cpu_best(lambda: receiver_pass(arena, keys, wire), repeat),
    ]
    return [t / len(blocks) * 1e6 for t in timings]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("CPU microseconds per block (process time, best of", args.repeat, "passes over a", args.arena_mib,
          "MiB arena)\n")
    print("| block | memcpy | xxh3 | holder | receiver | holder beyond xxh3 | receiver beyond xxh3 |")
    print("|---|---|---|---|---|---|---|")
    for label, block_bytes in BLOCK_SIZES.items():
        copy, digest, holder, receiver = row(block_bytes, args.arena_mib << 20, args.repeat)
        print(f"| {label} | {copy:.1f} | {digest:.1f} | {holder:.1f} | {receiver:.1f} | "
              f"{holder - digest:.1f} | {receiver - digest:.1f} |", flush=True)


if __name__ == "__main__":
    main()
