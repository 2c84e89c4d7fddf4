"""`prefixpool replay TRACE`: replay a Mooncake-format trace, simulated or against a live router.

    prefixpool replay conversation --mode sim --nodes 8          # all policies side by side
    prefixpool replay conversation --mode live --router URL ...  # real TTFT and cached tokens
    prefixpool replay conversation --sub-blocks 32 --run-blocks 1,16,32   # what run-granular publication costs
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from prefixpool.replay.report import plot, policy_table, run_table, sweep_table
from prefixpool.replay.simulator import SimConfig, hit_rate_bound, simulate
from prefixpool.replay.trace import TRACE_BLOCK_TOKENS, load_trace
from prefixpool.router.cost_model import PROFILES, profile
from prefixpool.router.policy import POLICY_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace",
                        help="a JSONL trace path, or 'conversation' / 'synthetic' (copies in benchmarks/traces)")
    parser.add_argument("--mode", choices=["sim", "live"], default="sim")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--nodes", type=int, default=8, help="sim: prefill nodes")
    parser.add_argument("--capacity", type=int, default=2000, help="sim: blocks per node (0 = unlimited)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama-3-70b-a800")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--sweep", default="250,500,1000,2000,4000,8000,0",
                        help="sim: capacities for the sweep ('' to skip)")
    parser.add_argument("--slo", type=float, default=30.0, help="TTFT SLO in seconds")
    parser.add_argument("--no-fetch", action="store_true",
                        help="sim: nodes fetch no blocks from peers (vLLM servers without a KV connector)")
    parser.add_argument("--sub-blocks", type=int, default=1,
                        help="sim: split each 512-token trace block into this many (32: 16-token blocks)")
    parser.add_argument("--run-blocks", default="1",
                        help="sim: the index learns one key per run of about N blocks and each stored chain's tail "
                             "(meta/runs.py); "
                             "several, comma-separated: a table of hit rate and fetched blocks per N")
    parser.add_argument("--out", default="", help="directory for PNG plots and the markdown report")
    parser.add_argument("--router", default="http://127.0.0.1:8000", help="live: router URL")
    parser.add_argument("--model", default="tiny", help="live: model name to request")
    parser.add_argument("--block-tokens", type=int, default=16, help="live: tokens per trace block (512 = real size)")
    parser.add_argument("--speedup", type=float, default=60.0, help="live: time compression of arrivals")
    parser.add_argument("--concurrency", type=int, default=8, help="live: most requests in flight")
    parser.add_argument("--max-output", type=int, default=4, help="live: cap on output tokens per request")


def run(args: argparse.Namespace) -> int:
    records = load_trace(args.trace, args.limit)
    if args.mode == "sim" and "," in args.run_blocks:
        print(run_sim_runs(records, args))
        return 0
    if args.mode == "live":
        from prefixpool.replay.live import LiveConfig, replay_live, summary_table

        config = LiveConfig(args.router, args.model, args.block_tokens, args.speedup, args.concurrency, args.max_output)
        print(summary_table(asyncio.run(replay_live(records, config))))
        return 0
    report = run_sim(records, args)
    print(report)
    if args.out:
        Path(args.out, f"replay_{Path(args.trace).stem}.md").write_text(report + "\n")
    return 0


def _config(args: argparse.Namespace, capacity: int, run_blocks: int) -> SimConfig:
    return SimConfig(num_nodes=args.nodes, capacity_blocks=capacity or None, slo_s=args.slo,
                     costs=profile(args.profile, TRACE_BLOCK_TOKENS // args.sub_blocks),
                     sub_blocks=args.sub_blocks, run_blocks=run_blocks, fetch=not args.no_fetch)


def run_sim_runs(records, args: argparse.Namespace) -> str:
    """Each policy at each run granularity N, side by side."""
    start = time.perf_counter()
    counts = [int(n) for n in args.run_blocks.split(",")]
    results = [(n, simulate(records, name, _config(args, args.capacity, n)))
               for name in args.policies.split(",") for n in counts]
    block = TRACE_BLOCK_TOKENS // args.sub_blocks
    return "\n".join([
        f"### {Path(args.trace).stem}: {len(records):,} requests, {args.nodes} nodes, "
        f"{args.capacity or 'unlimited'} x 512 tokens/node, {block}-token blocks, profile {args.profile}", "",
        run_table(results, profile(args.profile, block).block_bytes), "",
        f"(simulated in {time.perf_counter() - start:.1f} s)"])


def run_sim(records, args: argparse.Namespace) -> str:
    config = _config(args, args.capacity, int(args.run_blocks))
    start = time.perf_counter()
    results = [simulate(records, name, config) for name in args.policies.split(",")]
    sweep = []
    for capacity in [int(c) for c in args.sweep.split(",") if c.strip()]:
        sized = _config(args, capacity, int(args.run_blocks))
        sweep.append((capacity or _unlimited(records), simulate(records, "cost", sized),
                      simulate(records, "cost_local", sized)))
    name = Path(args.trace).stem.replace("_trace", "")
    lines = [
        f"### {name}: {len(records):,} requests, {args.nodes} nodes, {args.capacity or 'unlimited'} blocks/node, "
        f"profile {args.profile}",
        "", f"Infinite-cache bound on the hit rate: {hit_rate_bound(records):.3f}", "",
        policy_table(results, args.slo), "",
    ]
    if sweep:
        lines += ["Capacity sweep (cost vs cost_local):", "", sweep_table(sweep, TRACE_BLOCK_TOKENS), ""]
    if args.out:
        lines += [f"![{p.name}]({p.name})" for p in plot(results, sweep, Path(args.out), name)] + [""]
    lines.append(f"(simulated in {time.perf_counter() - start:.1f} s)")
    return "\n".join(lines)


def _unlimited(records) -> int:
    return len({i for r in records for i in r.hash_ids})
