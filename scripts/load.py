"""Load: N concurrent streaming clients for a fixed time against a local cluster.

    python scripts/load.py --clients 8 --seconds 60 --workers 3

Reports throughput, errors (goal 0), wrong outputs against the cold oracle
(must be 0), TTFT p50/p99, and the resident memory (VmRSS from
/proc/<pid>/status) of the router and every worker at the start and end of
the run, sampled every second, so growth shows. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from prefixpool.testing.chaos_faults import cluster_for, wait_ready
from prefixpool.testing.chaos_client import ApiClient, Oracle, Outcome, Tally, workload


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_load(client: ApiClient, prompts: list[str], clients: int, seconds: float, pids: dict[str, int]):
    outcomes: list[Outcome] = []
    samples: dict[str, list[float]] = {name: [] for name in pids}
    deadline = time.monotonic() + seconds

    async def one(offset: int) -> None:
        i = offset
        while time.monotonic() < deadline:
            outcomes.append(await client.complete(prompts[i % len(prompts)], max_tokens=16, stream=True))
            i += clients

    async def sample() -> None:
        while time.monotonic() < deadline:
            for name, pid in pids.items():
                samples[name].append(rss_mib(pid))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample(), *(one(k) for k in range(clients)))
    return outcomes, samples


def report(args, tally: Tally, outcomes: list[Outcome], samples: dict[str, list[float]], elapsed: float) -> str:
    ttfts = [o.ttft_s for o in outcomes if o.answered and o.ttft_s is not None]
    errors = tally.requests - tally.served
    lines = [f"clients {args.clients}, {args.seconds:.0f} s, {args.workers} workers, tiny preset, streaming, "
             "16 tokens each", "",
             "| requests | served | errors | wrong | req/s | TTFT p50 ms | TTFT p99 ms | cached tokens |",
             "|---|---|---|---|---|---|---|---|",
             f"| {tally.requests} | {tally.served} | {errors} | {len(tally.wrong)} | {tally.served / elapsed:.1f} | "
             f"{percentile(ttfts, 0.5) * 1e3:.0f} | {percentile(ttfts, 0.99) * 1e3:.0f} | {tally.cached_tokens} |", "",
             "| process | RSS first 5 s (MiB) | RSS last 5 s (MiB) | growth |", "|---|---|---|---|"]
    for name, values in samples.items():
        head = max(values[:5])
        tail = max(values[-5:])
        lines.append(f"| {name} | {head:.0f} | {tail:.0f} | {tail - head:+.0f} MiB ({(tail - head) / head:+.1%}) |")
    return "\n".join(lines)


async def main(args) -> int:
    cluster = cluster_for(args.workers, extra_worker_args=("--num-blocks", str(args.num_blocks)))
    cluster.start()
    try:
        client = ApiClient(cluster.router_url)
        try:
            await wait_ready(client, args.workers)
            prompts = workload(args.prompts)
            oracle = await Oracle.build(client, prompts, max_tokens=16)
            pids = {"router": cluster.router.pid, **{n: c.pid for n, c in cluster.workers.items()}}
            started = time.monotonic()
            outcomes, samples = await run_load(client, prompts, args.clients, args.seconds, pids)
            tally = Tally.of(outcomes, oracle)
            print(report(args, tally, outcomes, samples, time.monotonic() - started))
            for bad in (tally.wrong + tally.dirty)[:5]:
                print("BAD:", bad)
            return 0 if not tally.wrong and not tally.dirty and tally.served == tally.requests else 1
        finally:
            await client.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--num-blocks", type=int, default=256)
    sys.exit(asyncio.run(main(parser.parse_args())))
