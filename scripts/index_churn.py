"""bench_index.py's churn section: block churn one etcd cluster absorbs with mirror lag p99 < 100 ms.

    nodes (this process)                 etcd (its own, on free loopback ports)     router mirror (another process)
    4 Publishers, 4 leases, one         <-- txns under the node leases -->          prefixpool.meta.mirror.Mirror,
    event loop; every 10 ms each                                                    timestamps each put it applies
    stores its share of new blocks and
    evicts those it stored LIFETIME_S ago

A load step offers `gpus` Llama-3-8B H100s' churn for a few seconds: each GPU prefills
25,000 tokens/s, i.e. 25,000 / 16 = 1,562.5 new 16-token blocks/s stored and as many evicted
(3,125 block ops/s). Lag: a key's publish() call (time.monotonic, system-wide on Linux) to the
mirror process applying its put. A step is sustained when the generator kept its rate (within
10%), nothing was dropped, every put arrived and the lag p99 is under 100 ms. Keys are random
16-byte strings (uniform like chained hashes; chaining 1M keys/s would cost more CPU than the
publishers). One process plays every node, so each node's run filter runs before the clock,
as it would on that node's own CPU (its cost per block is a row of its own). Blocks live
LIFETIME_S, far longer than a publish window, so coalescing saves nothing here: a real GPU's
cache holds its blocks for tens of seconds. Bounded: every step runs a fixed number of seconds
and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.meta import runs
from prefixpool.meta.etcd_client import MAX_TXN_OPS
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.meta.publisher import Publisher, PublisherConfig
from prefixpool.testing.index_node import IndexNode
from prefixpool.testing.proc_cpu import cpu_seconds

GPU_TOKENS_PER_S = 25_000  # one Llama-3-8B H100 at full prefill
BLOCK_TOKENS = 16
GPU_STORES_PER_S = GPU_TOKENS_PER_S / BLOCK_TOKENS  # 1,562.5, and as many evictions
GPU_OPS_PER_S = 2 * GPU_STORES_PER_S
LAG_P99_MS = 100.0
TICK_S = 0.01
LIFETIME_S = 0.5
NUM_NODES = 4
SAMPLE_MASK = 31  # lag is measured on the keys whose last byte is a multiple of 32: boundaries for N <= 32

# the router mirror in another process: index_mirror over the shards (a plain Mirror for one) timestamps the
# puts it applies; "ready" once synced, then the per-shard revisions to wait for on stdin, {key: time} on stdout
MIRROR_PROCESS = """
import asyncio, json, sys, time
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.mirror import MirrorConfig
from prefixpool.meta.sharded_mirror import index_mirror
async def main(endpoints, ns, run_blocks):
    clients = [EtcdClient(e) for e in endpoints.split(";")]
    mirror = index_mirror(clients, Layout(ns), MirrorConfig(run_blocks=run_blocks))
    shards, seen = getattr(mirror, "shards", [mirror]), {}
    for shard in shards:
        def timed(batch, apply=shard._apply):
            apply(batch)
            now = time.monotonic()
            for event in batch.events:
                if event.is_put:
                    seen.setdefault(event.key, now)
        shard._apply = timed
    await mirror.start()
    while not all(s.revision for s in shards):
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    targets = json.loads(await asyncio.to_thread(sys.stdin.readline))
    try:
        await mirror.wait_revision(targets if len(shards) > 1 else targets[0], 60)
    except TimeoutError:
        pass
    print(json.dumps({k.decode(): t for k, t in seen.items()}), flush=True)
    await mirror.stop()
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


@dataclass(frozen=True)
class Setting:
    name: str
    run_blocks: int
    window_s: float
    max_txn_ops: int


BEFORE = Setting("per block, txns of 128", 1, 0.0, MAX_TXN_OPS)


def after(run_blocks: int) -> Setting:
    return Setting(f"coalesced, runs of {run_blocks}, txns of 1024", run_blocks, 0.01, 1024)


@dataclass(frozen=True)
class Step:
    gpus: int
    stores_s: float  # new blocks stored per second, as the generator achieved it (as many evicted, from LIFETIME_S on)
    offered_ops_s: float  # block stores + evictions per second over the whole step
    etcd_ops_s: float  # what the publishers wrote, per second of the step
    p50_ms: float
    p99_ms: float
    missing: int
    # with etcd_pids given to offer(), over `window_s` (the churn and the flush after it): per shard, the etcd ops
    # the publishers wrote there and its etcd server's CPU seconds
    shard_ops: tuple[int, ...] = ()
    etcd_cpu_s: tuple[float, ...] = ()
    window_s: float = 0.0

    @property
    def sustained(self) -> bool:
        return self.stores_s >= 0.9 * self.gpus * GPU_STORES_PER_S and self.p99_ms < LAG_P99_MS and not self.missing


def random_keys(count: int, rng: np.random.Generator) -> list[bytes]:
    raw = rng.bytes(16 * count)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def bench_node(endpoints: list[str], ns: str, node_id: str, setting: Setting) -> IndexNode:
    """One node's publication over every shard (a plain Publisher for one); it publishes through .publisher."""
    record = NodeRecord(node_id, "http://127.0.0.1:0", "tcp://127.0.0.1:0", BLOCK_TOKENS, 1 << 20, "bench")
    config = PublisherConfig(max_pending=1 << 22, window_s=setting.window_s, run_blocks=setting.run_blocks)
    return IndexNode(endpoints, ns, record, MembershipConfig(ttl_s=30), config, max_txn_ops=setting.max_txn_ops)


async def offer(endpoints: list[str], ns: str, setting: Setting, gpus: int, seconds: float,
                compact: bool = False, etcd_pids: Sequence[int] = ()) -> Step:  # fmt: skip
    """One load step: `gpus` GPUs' churn for `seconds`, through NUM_NODES nodes publishing over len(endpoints)
    shards, lag seen by a mirror process watching all of them; `compact`: etcd's history up to the step's end
    (keeps it from growing over the steps); `etcd_pids`: the shards' etcd server processes, whose CPU the
    step records (Linux's /proc)."""
    mirror = subprocess.Popen([sys.executable, "-c", MIRROR_PROCESS, ";".join(endpoints), ns, str(setting.run_blocks)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert (await asyncio.wait_for(asyncio.to_thread(mirror.stdout.readline), 30)).strip() == "ready"
        nodes = [await bench_node(endpoints, ns, f"n{i}", setting).start() for i in range(NUM_NODES)]
        publishers = [node.publisher for node in nodes]
        before = _etcd_counters(publishers, etcd_pids)
        published, num_stored, num_evicted, elapsed = await _churn(publishers, gpus, seconds, Layout(ns))
        targets = np.max([await node.revisions() for node in nodes], axis=0).tolist()
        shard_ops, etcd_cpu_s, window_s = (now - then for now, then in zip(_etcd_counters(publishers, etcd_pids),
                                                                           before))  # fmt: skip
        mirror.stdin.write(json.dumps(targets) + "\n")
        mirror.stdin.flush()
        seen = json.loads(await asyncio.wait_for(asyncio.to_thread(mirror.stdout.readline), 90))
        if compact:
            for client, revision in zip(nodes[0].clients, targets):
                await client.compact(revision)
        for node in nodes:
            await node.stop()
    finally:
        mirror.kill()
        mirror.wait(10)
    lags = np.array([seen[k] - t for k, t in published.items() if k in seen]) * 1e3
    p50, p99 = (np.quantile(lags, [0.5, 0.99]) if len(lags) else (float("inf"),) * 2)
    return Step(gpus, num_stored / elapsed, (num_stored + num_evicted) / elapsed, float(shard_ops.sum()) / elapsed,
                float(p50), float(p99), len(published) - len(lags), tuple(shard_ops.tolist()),
                tuple(etcd_cpu_s.tolist()), window_s)  # fmt: skip


def _etcd_counters(publishers: list[Publisher], etcd_pids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """(etcd ops written so far per shard over all nodes, CPU seconds so far per etcd server, time.monotonic())."""
    per_node = [[shard.num_written for shard in getattr(p, "shards", [p])] for p in publishers]
    return np.sum(per_node, axis=0), np.array([cpu_seconds(pid) for pid in etcd_pids], dtype=float), time.monotonic()


def _stored(gpus: int, seconds: float) -> int:
    return int(gpus * GPU_STORES_PER_S * seconds)


async def _churn(publishers: list[Publisher], gpus: int, seconds: float,
                 layout: Layout) -> tuple[dict, int, int, float]:  # fmt: skip
    """Every tick each node stores its share of new blocks and evicts what it stored LIFETIME_S ago."""
    rng = np.random.default_rng(gpus)
    ticks, lifetime = int(seconds / TICK_S), int(LIFETIME_S / TICK_S)
    per_tick = _stored(gpus, seconds) / ticks / len(publishers)  # fractional: tick t stores [t*p, (t+1)*p)
    run_blocks = publishers[0].config.run_blocks
    # Before the clock starts: the blocks each node stores per tick, and the keys of them its run filter passes
    # (runs.published: what publish() would keep). One process plays the whole fleet's nodes; each real node
    # filters its own blocks on its own CPU (node_filter_ns: a few ns per block), so that is not etcd's cost.
    made = [random_keys(int(per_tick * ticks), rng) for _ in publishers]
    bounds = [(int(t * per_tick), int((t + 1) * per_tick)) for t in range(ticks)]
    ticked = [[runs.published(keys[lo:hi], run_blocks) for lo, hi in bounds] for keys in made]
    history: list[list[list[bytes]]] = []
    published: dict[str, float] = {}
    num_stored = num_evicted = 0
    assert SAMPLE_MASK + 1 >= publishers[0].config.run_blocks, "sampled keys must be published ones"
    started = time.monotonic()
    for tick in range(ticks):
        await asyncio.sleep(max(0.0, started + tick * TICK_S - time.monotonic()))
        batch = [per_node[tick] for per_node in ticked]
        now = time.monotonic()
        for publisher, keys, old in zip(publishers, batch, history[-lifetime] if len(history) >= lifetime else
                                        [[]] * len(publishers)):  # fmt: skip
            publisher.publish(stored=keys, removed=old)
        lo, hi = bounds[tick]
        num_stored += (hi - lo) * len(publishers)
        num_evicted += (hi - lo) * len(publishers) if tick >= lifetime else 0
        for publisher, keys in zip(publishers, batch):
            node_id = publisher.node_id
            published.update((layout.block_key(k, node_id).decode(), now) for k in keys if not k[-1] & SAMPLE_MASK)
        history.append(batch)
    elapsed = time.monotonic() - started
    return published, num_stored, num_evicted, elapsed


def try_step(endpoint: str, setting: Setting, gpus: int, seconds: float, tries: int) -> Step:
    """Offer `gpus` GPUs' churn up to `tries` times, until sustained: the machine's other load only
    ever lowers what a step sustains, so one pass is proof and a failure is only one after `tries`."""
    for _ in range(tries):
        step = asyncio.run(offer([endpoint], f"churn{setting.run_blocks}x{gpus}x{time.monotonic_ns()}", setting, gpus,
                                 seconds, compact=True))  # fmt: skip
        print(f"  churn {setting.name}: {gpus} GPUs -> {step.stores_s:,.0f} stores/s, "
              f"{step.offered_ops_s:,.0f} block ops/s, etcd "
              f"{step.etcd_ops_s:,.0f} ops/s, lag p50 {step.p50_ms:.1f} p99 {step.p99_ms:.1f} ms, "
              f"{step.missing} missing", file=sys.stderr, flush=True)
        if step.sustained:
            break
    return step


LADDERS = {"before": [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96],
           "after": [8, 16, 32, 64, 128, 192, 256, 320, 384, 512, 768]}


def churn_rows(args) -> list[tuple[str, str, str]]:
    """Rows (metric, before, after) for bench_index.py: both ladders climbed in turn, a step each."""
    runs = after(args.run_blocks)
    settings = {"before": BEFORE, "after": runs}
    best: dict[str, Step | None] = {"before": None, "after": None}
    climbing = {name: iter(steps) for name, steps in LADDERS.items()}
    with EtcdServer() as server:  # started with --max-txn-ops 1024; "before" keeps its own client at 128
        while climbing:  # interleaved, so the machine's other load hits both alike
            for name in list(climbing):
                gpus = next(climbing[name], None)
                step = None if gpus is None else try_step(server.endpoint, settings[name], gpus, args.churn_seconds,
                                                          args.churn_tries)  # fmt: skip
                if step is None or not step.sustained:
                    del climbing[name]
                else:
                    best[name] = step
    cells = {name: _cells(step) for name, step in best.items()}
    return [
        ("publication", BEFORE.name, runs.name),
        ("etcd ops per GPU per second (stores + evictions of 16-token blocks at 25k prefill tokens/s)",
         f"{GPU_OPS_PER_S:,.0f}", f"{GPU_OPS_PER_S / args.run_blocks:,.0f} (= 3,125 / {args.run_blocks})"),
        ("sustainable block churn, one etcd cluster, mirror lag p99 < 100 ms (block stores + evictions/s)",
         cells["before"][0], cells["after"][0]),
        ("mirror lag publish -> visible in another process at that churn, p50 / p99", cells["before"][1],
         cells["after"][1]),
        ("fleet capacity", cells["before"][2], cells["after"][2]),
        ("run filter on the node (runs.published), CPU per block / per GPU's 3,125 blocks/s", "-",
         f"{(ns := node_filter_ns(args.run_blocks)):.0f} ns / {ns * GPU_OPS_PER_S / 1e6:.2f} ms per s"),
    ]


def node_filter_ns(run_blocks: int, count: int = 1_000_000) -> float:
    keys = random_keys(count, np.random.default_rng(1))
    start = time.perf_counter()
    for i in range(0, count, 1024):
        runs.published(keys[i : i + 1024], run_blocks)
    return (time.perf_counter() - start) / count * 1e9


def _cells(step: Step | None) -> tuple[str, str, str]:
    if step is None:
        return "< lowest step", "-", "-"
    churn = 2 * step.stores_s  # steady state: as many evicted as stored
    return (f"{churn:,.0f} ({step.stores_s:,.0f} stored + as many evicted; etcd wrote {step.etcd_ops_s:,.0f} ops/s)",
            f"{step.p50_ms:.1f} / {step.p99_ms:.1f} ms",
            f"{churn:,.0f} / 3,125 per GPU = {churn / GPU_OPS_PER_S:,.0f} GPUs (step of {step.gpus} sustained)")
