"""Trace replay (simulated) with tiers: device-only vs device+host vs device+host+SSD at the same device size.

    python scripts/bench_tiers_replay.py [--nodes 8] [--device 1000] [--host 4000] [--ssd 16000]
                                         [--policy cost] [--profile llama-3-70b-a800] [--limit N]

Both Mooncake traces; every row routes with prefixpool.router.policy over a real
BlockIndex that records tiers, each node a real BlockPool with modelled host
and SSD LRUs under it (prefixpool/replay/sim_node.py). A host or SSD hit is read up at
the cost model's host / SSD bandwidth before prefill, on the serving node.
Prints one markdown table per trace, with the ratio to device-only.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from prefixpool.replay.simulator import SimConfig, hit_rate_bound, simulate
from prefixpool.replay.trace import TRACE_BLOCK_TOKENS, load_trace
from prefixpool.router.cost_model import PROFILES, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--device", type=int, default=1000, help="device blocks per node (the same in every row)")
    parser.add_argument("--host", type=int, default=4000, help="host-memory blocks per node")
    parser.add_argument("--ssd", type=int, default=16000, help="SSD blocks per node")
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama-3-70b-a800")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    args = parser.parse_args()
    costs = profile(args.profile, TRACE_BLOCK_TOKENS)
    print(f"{args.nodes} nodes, {args.device} device blocks/node, policy {args.policy}, profile {args.profile} "
          f"(block {costs.block_bytes / 2**20:.0f} MiB; host read {costs.host_read_bytes_per_s / 1e9:.0f} GB/s, "
          f"SSD read {costs.ssd_read_bytes_per_s / 1e9:.0f} GB/s)\n")
    for trace in ("conversation", "synthetic"):
        records = load_trace(trace, limit=args.limit)
        rows = [("device only", 0, 0), (f"device + host {args.host}", args.host, 0),
                (f"device + host {args.host} + SSD {args.ssd}", args.host, args.ssd)]
        print(f"### {trace}: {len(records):,} requests (infinite-cache hit bound {hit_rate_bound(records):.3f})\n")
        print("| tiers (blocks/node) | hit rate | TTFT mean s | p50 | p99 | hit frac p50 / p90 / p99 | "
              "mean TTFT vs device-only | sim s |")
        print("|---|---:|---:|---:|---:|---|---:|---:|")
        base = None
        for label, host, ssd in rows:
            config = SimConfig(num_nodes=args.nodes, capacity_blocks=args.device, costs=costs, host_blocks=host,
                               disk_blocks=ssd)
            began = time.perf_counter()
            result = simulate(records, args.policy, config)
            elapsed = time.perf_counter() - began
            mean = float(result.ttft_s.mean())
            base = base or mean
            fractions = " / ".join(f"{np.quantile(result.hit_fractions, q):.2f}" for q in (0.5, 0.9, 0.99))
            print(f"| {label} | {result.hit_rate:.3f} | {mean:.2f} | {result.quantile(0.5):.2f} | "
                  f"{result.quantile(0.99):.2f} | {fractions} | {mean / base:.2f}x | {elapsed:.1f} |")
        print()


if __name__ == "__main__":
    main()
