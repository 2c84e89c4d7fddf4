"""The router's block index and the etcd index behind it, before and after issue 31; prints one markdown table.

    PYTHONPATH=. python scripts/bench_index.py [--sections memory,decisions] [--blocks 5000000]

Each section is a function returning rows (metric, before, after), measured in this run:

    memory     router memory per (block, holder) at --blocks blocks (tracemalloc: every byte
               Python and numpy hold for the index, the keys the dict index keeps included), 1 holder
               per block and 2; build rate; longest_prefix at 8k tokens over 8 workers with the
               index that full
    decisions  router decisions/s at 8k tokens over 8 workers (scripts/bench_router.py's
               decisions_per_second: hash, longest prefix, cost policy), the index swapped; and with
               2 index shards, whose mirrors share one index (prefixpool/meta/sharded_mirror.py)
    shards     index shards (scripts/index_shard_churn.py): the churn steps against one etcd server and
               two, per-block and coalesced publication; its rows' columns are 1 and 2 etcd clusters
               (or, where the metric says so, per-block and coalesced), and `fleet capacity (2 shards)`;
               per etcd server, the ops it was written and its CPU (/proc/<pid>/stat, Linux only): CPU per
               1,000 ops, CPU / wall, and the GPUs one etcd core absorbs

    churn      block churn (stores + evictions/s) one etcd cluster absorbs with the router mirror's lag
               p99 < 100 ms, and `fleet capacity`: that churn over one Llama-3-8B H100's 3,125 block ops/s;
               before = per-block publication in txns of 128, after = coalesced, runs of --run-blocks,
               txns of 1024 (scripts/index_churn.py: its own etcd, a mirror in another process)

"before" is the dict-of-dicts index (prefixpool/testing/dict_index.py), "after" the compact one
(prefixpool/meta/index.py).
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from functools import partial
from typing import Callable

import numpy as np

from prefixpool.meta.index import BlockIndex
from prefixpool.store.keys import BlockKey, Namespace, chain
from prefixpool.testing.dict_index import DictBlockIndex

INDEXES = {"before": DictBlockIndex, "after": BlockIndex}
WORKERS = [f"w{i}" for i in range(8)]
Row = tuple[str, str, str]


def random_keys(count: int, seed: int) -> list[BlockKey]:
    raw = np.random.default_rng(seed).bytes(16 * count)
    return [BlockKey(raw[i : i + 16]) for i in range(0, len(raw), 16)]


def build(index_type: Callable, num_blocks: int, holders: int, traced: bool, batch: int = 64):
    """An index of `num_blocks` random keys, each held by `holders` of 8 workers, added `batch` keys a call;
    (index, bytes it holds by tracemalloc if `traced` else 0, seconds in add). Keys are made in chunks, so
    only what the index keeps of them is counted."""
    gc.collect()
    if traced:
        tracemalloc.start()
    start_bytes = tracemalloc.get_traced_memory()[0] if traced else 0
    index, seconds = index_type(), 0.0
    for first in range(0, num_blocks, 1 << 16):
        keys = random_keys(min(1 << 16, num_blocks - first), first)
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            for h in range(holders):
                index.add(WORKERS[(first // batch + i // batch + h) % len(WORKERS)], keys[i : i + batch])
        seconds += time.perf_counter() - start
        del keys
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - start_bytes if traced else 0
    tracemalloc.stop()
    return index, held, seconds


def prompt_chains(num_tokens: int, count: int = 16) -> list[list[BlockKey]]:
    rng = np.random.default_rng(7)
    return [chain(rng.integers(32, 127, num_tokens).tolist(), Namespace("tiny", block_size=16)) for _ in range(count)]


def time_longest_prefix(index, chains: list[list[BlockKey]], seconds: float = 2.0) -> tuple[float, float]:
    """(wall, thread CPU) microseconds per longest_prefix over `chains` in turn, each cached on two workers at
    different depths (as scripts/bench_router.py's decisions)."""
    for i, keys in enumerate(chains):
        index.add(WORKERS[i % 8], keys[: len(keys) * (1 + i % 3) // 3])
        index.add(WORKERS[(i + 3) % 8], keys[: len(keys) // 2])
    count, start, cpu_start = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        index.longest_prefix(chains[count % len(chains)])
        count += 1
    return (time.perf_counter() - start) / count * 1e6, (time.thread_time() - cpu_start) / count * 1e6


def memory_rows(args) -> list[Row]:
    """Bytes per (block, holder) at 1 and 2 holders; build rate and longest_prefix at 1 holder (untraced)."""
    cells: dict[str, dict[str, str]] = {}
    chains = prompt_chains(8000)
    for name, index_type in INDEXES.items():
        for holders in (1, 2):
            _, held, _ = build(index_type, args.blocks, holders, traced=True)
            pairs = args.blocks * holders
            cells.setdefault(f"router memory per indexed block, {holders} holder(s) per block "
                             f"({args.blocks:,} blocks)", {})[name] = f"{held / pairs:.1f} B ({held / 2**20:,.0f} MiB)"
            gc.collect()
        index, _, seconds = build(index_type, args.blocks, 1, traced=False)
        cells.setdefault("index build rate, 64 keys per add", {})[name] = f"{args.blocks / seconds:,.0f} blocks/s"
        wall, cpu = time_longest_prefix(index, chains)
        cells.setdefault(f"longest_prefix at 8k tokens, 8 workers, {args.blocks:,} blocks indexed "
                         "(thread CPU)", {})[name] = f"{wall:.1f} us ({cpu:.1f} us)"
        del index
        gc.collect()
    cells["index build rate, 1 key per add"] = {
        name: f"{single_add_rate(index_type):,.0f} blocks/s" for name, index_type in INDEXES.items()}
    return [(metric, values["before"], values["after"]) for metric, values in cells.items()]


def single_add_rate(index_type: Callable, count: int = 200_000) -> float:
    index, keys = index_type(), random_keys(count, 99)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        index.add(WORKERS[i % 8], [key])
    return count / (time.perf_counter() - start)


def decisions_rows(args) -> list[Row]:
    from bench_router import decisions_per_second  # the router's imports only for this section

    from prefixpool.meta.sharded_mirror import ShardedIndex

    sharded = {"before": DictBlockIndex, "after": partial(ShardedIndex, 2)}  # the dict index was never sharded
    rows = []
    for label, indexes in (("", INDEXES), (", 2 index shards in one shared index", sharded)):
        rates = [decisions_per_second(8000, 8, index_type=index_type)[:2] for index_type in indexes.values()]
        rows.append((f"router decisions/s at 8k tokens over 8 workers{label} (per CPU second of the bench thread)",
                     *(f"{wall:,.0f} ({cpu:,.0f})" for wall, cpu in rates)))
    return rows


def churn_rows(args) -> list[Row]:
    from index_churn import churn_rows as rows  # its own etcd, a mirror process, load steps (scripts/index_churn.py)

    return rows(args)


def shards_rows(args) -> list[Row]:
    from index_shard_churn import shard_rows  # two etcd servers, a sharded mirror process

    return shard_rows(args)


SECTIONS = {"memory": memory_rows, "decisions": decisions_rows, "churn": churn_rows, "shards": shards_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--blocks", type=int, default=5_000_000, help="blocks indexed for the memory rows")
    parser.add_argument("--run-blocks", type=int, default=32, help="churn: the 'after' publication's run length N")
    parser.add_argument("--churn-seconds", type=float, default=3.0, help="churn: seconds per load step")
    parser.add_argument("--churn-tries", type=int, default=3, help="churn: tries per load step before it fails")
    args = parser.parse_args()
    rows = [row for section in args.sections.split(",") for row in SECTIONS[section](args)]
    print("\n| metric | before (dict index) | after (compact) |")
    print("|---|---:|---:|")
    for metric, before, after in rows:
        print(f"| {metric} | {before} | {after} |")


if __name__ == "__main__":
    main()
