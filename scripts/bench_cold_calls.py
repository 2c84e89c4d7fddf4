"""Two calls on the router's path, timed after the process idles as it does between requests.

    python scripts/bench_cold_calls.py [--calls 300] [--idle-ms 30] [--out FILE]

- tokenizing the chunks of a prompt that are not cached: the tokenizers library's `encode_batch_fast`
  with both chunks in one batch (runs on the library's thread pool) against one call per chunk (what
  prefixpool/model/chunked_encoding.py does), two ~55-character chunks of the random-token text vLLM's
  benchmark datasets decode, over the tiny Llama's byte-level BPE;
- one etcd put of a small value under a lease (a router's load entry): gRPC's txn (`EtcdClient.put` of a client
  made with gateway=False) against etcd's JSON gateway over the lean HTTP client (`EtcdClient.put`), one local
  etcd started here.

Each variant is called in turn with the others (interleaved, so a slow spell falls on all), after
sleeping --idle-ms, also back to back (idle 0); the first 10 calls of each are not counted. Wall time
and the calling thread's CPU time, p50 / p90 in microseconds. Prints a markdown table.

Then what each etcd call costs etcd itself, and this process: a put and a linearizable read of the
revision (`EtcdClient.revision`, a lone router's end), each over gRPC and over the gateway, --calls
calls of one variant back to back (etcd's CPU time is read from /proc, in clock ticks: only a total
over many calls means anything), every --idle-ms.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.testing.proc_cpu import cpu_seconds
from prefixpool.testing.tiny_llama import train_tokenizer

WARM_UP = 10


async def interleaved(variants: dict[str, Callable[[int], Awaitable[object]]], calls: int,
                      idle_s: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{variant: (wall us, thread CPU us)} of `calls` calls each, in turn, each after `idle_s` of sleep."""
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(calls + WARM_UP):
        for name, call in variants.items():
            await asyncio.sleep(idle_s)
            w, c = time.perf_counter_ns(), time.thread_time_ns()
            await call(i)
            if i >= WARM_UP:
                wall[name].append((time.perf_counter_ns() - w) / 1e3)
                cpu[name].append((time.thread_time_ns() - c) / 1e3)
    return {name: (np.array(wall[name]), np.array(cpu[name])) for name in variants}


def tokenizer_variants(rng: random.Random) -> dict[str, Callable[[int], Awaitable[object]]]:
    tokenizer = train_tokenizer(384)
    chunks = []
    for _ in range(1000):
        text = tokenizer.decode([rng.randrange(3, 384) for _ in range(36)])
        chunks.append([text[:55], text[55:]])

    async def batched(i: int) -> object:
        return tokenizer.encode_batch_fast(chunks[i % len(chunks)], add_special_tokens=False)

    async def one_each(i: int) -> object:
        return [tokenizer.encode_batch_fast([c], add_special_tokens=False) for c in chunks[(i + 500) % len(chunks)]]

    return {"tokenize 2 chunks, one batch": batched, "tokenize 2 chunks, one call each": one_each}


async def etcd_rows(calls: int, idles: list[float], idle_s: float) -> tuple[list[tuple[float, dict]], list[str]]:
    """One local etcd: the two puts interleaved after each of `idles`; then per call, etcd's CPU and this
    process's (us) of each variant run alone for `calls` calls, every `idle_s`."""
    server = EtcdServer().start()
    clients = {"gRPC": EtcdClient(server.endpoint, gateway=False), "JSON gateway": EtcdClient(server.endpoint)}
    try:
        lease = await clients["gRPC"].grant(3600)  # outlives every call here: no keepalive
        key = b"/bench/routers/r1"
        variants = {}
        for way, client in clients.items():
            variants[f"etcd put, {way}"] = lambda i, c=client: c.put(key, b'{"load": %d}' % i, lease)
            variants[f"etcd revision read, {way}"] = lambda i, c=client: c.revision(key)
        puts = {name: call for name, call in variants.items() if name.startswith("etcd put")}
        interleaved_rows = [(idle, await interleaved(puts, calls, idle)) for idle in idles]
        cost_rows = []
        for name, call in variants.items():
            for i in range(WARM_UP):
                await call(i)
            etcd_before, own_before = cpu_seconds(server.pid), time.process_time()
            for i in range(calls):
                await asyncio.sleep(idle_s)
                await call(i)
            etcd_us = (cpu_seconds(server.pid) - etcd_before) / calls * 1e6
            own_us = (time.process_time() - own_before) / calls * 1e6
            cost_rows.append(f"| {name} | {calls} | {etcd_us:.0f} | {own_us:.0f} |")
        assert clients["JSON gateway"]._gateway and not clients["gRPC"]._gateway, "etcd's JSON gateway did not answer"
        return interleaved_rows, cost_rows
    finally:
        for client in clients.values():
            await client.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, default=30.0)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    idles = [0.0, args.idle_ms / 1000]
    tokenize = tokenizer_variants(random.Random(0))
    rows = [(idle, asyncio.run(interleaved(tokenize, args.calls, idle))) for idle in idles]
    etcd_interleaved, etcd_costs = asyncio.run(etcd_rows(args.calls, idles, args.idle_ms / 1000))
    rows += etcd_interleaved
    lines = ["| call | idle before, ms | wall p50 us | wall p90 | thread CPU p50 us | CPU p90 |",
             "|---|---:|---:|---:|---:|---:|"]
    for idle, results in rows:
        for name, (wall, cpu) in results.items():
            lines.append(f"| {name} | {idle * 1000:g} | {np.percentile(wall, 50):.0f} | {np.percentile(wall, 90):.0f} "
                         f"| {np.percentile(cpu, 50):.0f} | {np.percentile(cpu, 90):.0f} |")
    lines += ["", "| etcd call (one variant at a time) | calls | etcd CPU a call, us | this process's CPU a call, us |",
              "|---|---:|---:|---:|", *etcd_costs]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(f"`python scripts/bench_cold_calls.py --calls {args.calls} --idle-ms "
                                  f"{args.idle_ms:g}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
