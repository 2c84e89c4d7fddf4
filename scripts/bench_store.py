"""Benchmark block hashing and the block pool; prints markdown tables.

    python scripts/bench_store.py [--tokens 131072] [--blocks 1000000]

Hashing: our `chain` against the floor (hashing the same bytes in one call)
and a naive loop (per-block Python packing of each token). Pool: match /
allocate / free operations per second with 1M blocks, and the pool's
metadata bytes per block. Owner: the same request-level operations made
straight on a BlockPool and through NodeBlocks (the one owner every caller
goes through), side by side.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np
import xxhash

from prefixpool.store import keys
from prefixpool.store.keys import Namespace, chain, pack_tokens
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool


def best_of(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_pair(first, second, repeat: int) -> tuple[float, float]:
    """Best times of two functions timed alternately, so a load spike on the machine hits both."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def naive_chain(tokens: list[int], namespace: Namespace) -> list[bytes]:
    parent, keys, size = namespace.root(), [], namespace.block_size
    for i in range(len(tokens) // size):
        block = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * size : (i + 1) * size])
        parent = xxhash.xxh3_128_digest(parent + block)
        keys.append(parent)
    return keys


def bench_hash(num_tokens: int) -> None:
    namespace = Namespace("bench")
    tokens = np.random.default_rng(0).integers(0, 128_000, num_tokens, dtype=np.int32)
    token_list = tokens.tolist()
    packed = pack_tokens(tokens)
    root = namespace.root()
    loop = "C" if keys._chain_from_c else "Python"
    rows = [
        ("floor: xxh3_128 of all bytes, one call", best_of(lambda: xxhash.xxh3_128_digest(packed))),
        (f"chain loop only ({loop}), tokens already packed",
         best_of(lambda: keys.chain_from(root, packed, namespace.block_size))),
        ("prefixpool chain(), int32 ndarray in", best_of(lambda: chain(tokens, namespace))),
        ("prefixpool chain(), Python list in", best_of(lambda: chain(token_list, namespace))),
        ("pure-Python chain loop, tokens already packed",
         best_of(lambda: keys.chain_from_python(root, packed, namespace.block_size))),
        ("naive per-block Python loop", best_of(lambda: naive_chain(token_list, namespace), repeat=2)),
    ]
    assert chain(tokens, namespace) == naive_chain(token_list, namespace)
    floor = rows[0][1]
    print(f"\n### Hashing a {num_tokens:,}-token prompt (block size {namespace.block_size})\n")
    print("| method | ms per prompt | M tokens/s | x floor |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.3f} | {num_tokens / seconds / 1e6:.1f} | {seconds / floor:.1f} |")


def bench_pool(num_blocks: int) -> None:
    namespace = Namespace("bench", block_size=1)
    gc.collect()
    tracemalloc.start()
    pool = BlockPool(num_blocks)
    metadata_bytes = tracemalloc.get_traced_memory()[0]
    keys = chain(np.arange(num_blocks), namespace)
    start = time.perf_counter()
    batch = 256
    for i in range(0, num_blocks, batch):
        alloc = pool.allocate(min(batch, num_blocks - i))
        for block_id, key in zip(alloc.block_ids, keys[i : i + batch]):
            pool.commit(block_id, key)
        pool.free(alloc.block_ids)
    fill_seconds = time.perf_counter() - start
    full_bytes = tracemalloc.get_traced_memory()[0] - len(keys) * (16 + 33) - 8 * len(keys)
    tracemalloc.stop()

    request = keys[:512]
    match_s = best_of(lambda: pool.match(request))
    hits = pool.match(request)

    def touch_free():
        pool.touch(hits)
        pool.free(hits)

    touch_s = best_of(touch_free)

    def churn():
        alloc = pool.allocate(batch)
        pool.free(alloc.block_ids)

    churn_s = best_of(churn)
    print(f"\n### Block pool with {num_blocks:,} blocks\n")
    print("| operation | blocks/s | per block |")
    print("|---|---:|---:|")
    for name, seconds, count in [
        ("allocate + commit + free (fill)", fill_seconds, num_blocks),
        ("match (512-block prefix)", match_s, 512),
        ("touch + free (512 blocks)", touch_s, 512),
        ("allocate with eviction + free (256)", churn_s, batch),
    ]:
        print(f"| {name} | {count / seconds / 1e6:.2f} M | {seconds / count * 1e9:.0f} ns |")
    print(f"\nMetadata: {metadata_bytes / num_blocks:.0f} B/block empty, "
          f"{full_bytes / num_blocks:.0f} B/block full (excluding the 16-byte keys themselves)")
    pool.check_integrity()


def filled(num_blocks: int, keys) -> tuple[BlockPool, NodeBlocks]:
    """A bare pool and an owned one, both full of cached, unheld blocks."""
    pool, blocks = BlockPool(num_blocks), NodeBlocks(BlockPool(num_blocks))
    for i in range(0, num_blocks, 256):
        alloc = pool.allocate(min(256, num_blocks - i))
        for block_id, key in zip(alloc.block_ids, keys[i : i + 256]):
            pool.commit(block_id, key)
        pool.free(alloc.block_ids)
        hold = blocks.acquire(())
        blocks.allocate(hold, min(256, num_blocks - i))
        blocks.commit(hold, 0, keys[i : i + 256])
        blocks.release(hold)
    return pool, blocks


def bench_owner(num_blocks: int) -> None:
    keys = chain(np.arange(num_blocks), Namespace("bench", block_size=1))
    pool, blocks = filled(num_blocks, keys)
    request, fresh = keys[:512], chain(np.arange(num_blocks, num_blocks + 256), Namespace("bench", block_size=1))

    def pool_hit():
        hits = pool.match(request)
        pool.touch(hits)
        pool.free(hits)

    def owner_hit():
        blocks.release(blocks.acquire(request))

    def pool_miss():  # a request whose 256 blocks all miss: allocate with eviction, commit, free
        alloc = pool.allocate(256)
        for block_id, key in zip(alloc.block_ids, fresh):
            pool.commit(block_id, key)
        pool.free(alloc.block_ids)

    def owner_miss():
        hold = blocks.acquire(fresh[:0])
        blocks.allocate(hold, 256)
        blocks.commit(hold, 0, fresh)
        blocks.release(hold)

    print(f"\n### One request's block operations, BlockPool calls vs NodeBlocks, {num_blocks:,} blocks\n")
    print("| operation | pool calls, ns/block | NodeBlocks, ns/block | ratio |")
    print("|---|---:|---:|---:|")
    for name, direct, owned, count in [
        ("hit: match + hold + release 512 cached blocks", pool_hit, owner_hit, 512),
        ("miss: allocate 256 with eviction + commit + release", pool_miss, owner_miss, 256),
    ]:
        direct_s, owned_s = best_of_pair(direct, owned, repeat=25)
        print(f"| {name} | {direct_s / count * 1e9:.0f} | {owned_s / count * 1e9:.0f} | {owned_s / direct_s:.2f} |")
    pool.check_integrity()
    blocks.check_integrity()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    bench_hash(args.tokens)
    bench_pool(args.blocks)
    bench_owner(args.blocks)


if __name__ == "__main__":
    main()
