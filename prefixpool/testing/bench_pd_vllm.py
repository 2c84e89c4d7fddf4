"""The vLLM arms of scripts/bench_pd.py: 1 prefill + 1 decode vLLM server against 2 aggregated ones.

    python scripts/bench_pd.py --vllm --model-path DIR [--block-size 32 --kv-blocks 1024 --max-model-len 4096]

    arms   pd   prefixpool up --vllm-prefill 1 --vllm-decode 1 --vllm-connector   (the conductor pairs them)
           agg  prefixpool up --vllm 2 --vllm-connector                          (whole requests on each)
    rounds each round starts each arm's fleet in turn (odd rounds the other order), warms it, sends
           bench_pd.py's workload through the router, reads the logs, stops it
    report bench_pd.py's table: TTFT and inter-token gaps, output tokens/s, KV bytes the connectors
           fetched (pd: decode from prefill; agg: peer loads), handoffs (prefills that answered a pool)

Both arms run the same model, KV sizes and connector; only the roles differ. The workload, the
streaming client and the table are bench_pd.py's, handed in, so both benchmarks measure alike.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from pathlib import Path
from typing import Callable

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.vllm_server import VllmConfig

LOAD_BYTES = re.compile(r"prefixpool load \S+: \d+ of \d+ blocks \(\d+ fetched from \S+, (\d+) bytes\)")
HANDOFF = "handoff {"  # prefixpool/router/vllm_pair.py logs each prefill that answered where its blocks are
ARMS = {"pd": dict(num_vllm_prefill=1, num_vllm_decode=1), "agg": dict(num_vllm=2)}


def vllm_flags(rest: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_pd.py --vllm")
    parser.add_argument("--model-path", required=True, help="HF model dir (e.g. prefixpool.testing.tiny_llama's)")
    parser.add_argument("--served-name", default="bench-pd")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="vLLM KV blocks per server, and its pool's")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args(rest)


def run_arm(arm: str, config: VllmConfig, jobs: list, send: Callable, deadline_s: float, log_dir: Path) -> dict:
    """One run of one arm: its own fleet, a warm-up, the workload, what the logs say."""
    with LocalCluster(num_workers=0, vllm=config, vllm_connector=True, log_dir=log_dir,
                      connector_settings={"pool_blocks": config.num_blocks}, **ARMS[arm]) as cluster:
        warm = type(jobs[0])(0.0, "warm up " * 40, 8, "short")
        asyncio.run(send(cluster.router_url, config.served_name, [warm], deadline_s))
        outcomes = asyncio.run(send(cluster.router_url, config.served_name, jobs, deadline_s))
        logs = "".join(server.log_path.read_text(errors="replace") for server in cluster.vllm_servers.values())
        handoffs = cluster.router.log_path.read_text(errors="replace").count(HANDOFF)
    ok = [o for o in outcomes if not o.error]
    return {"arm": arm, "outcomes": ok, "errors": [o.error for o in outcomes if o.error],
            "tokens_per_s": sum(o.num_tokens for o in ok) / max(o.end_s for o in ok) if ok else 0.0,
            "bytes": sum(int(b) for b in LOAD_BYTES.findall(logs)), "handoffs": handoffs}


def main(args: argparse.Namespace, rest: list[str], *, jobs: list, send: Callable, table: Callable) -> str:
    """`args`: bench_pd.py's (rounds, deadline_s); `rest`: the vLLM flags above; `jobs`, `send`, `table`:
    bench_pd.py's workload, streaming client and table."""
    flags = vllm_flags(rest)
    config = VllmConfig(flags.model_path, flags.served_name, flags.block_size, dtype=flags.dtype,
                        max_model_len=flags.max_model_len, num_blocks=flags.kv_blocks)
    runs = []
    with tempfile.TemporaryDirectory(prefix="prefixpool-bench-pd-vllm-") as logs:
        for round_index in range(args.rounds):
            for arm in ("pd", "agg") if round_index % 2 == 0 else ("agg", "pd"):
                runs.append(run_arm(arm, config, jobs, send, args.deadline_s, Path(logs) / f"{arm}-{round_index}"))
                print(f"vLLM round {round_index} {arm}: {runs[-1]['tokens_per_s']:.1f} tok/s, "
                      f"{runs[-1]['handoffs']} handoffs, {runs[-1]['bytes'] / 1e6:.1f} MB fetched, "
                      f"{len(runs[-1]['errors'])} errors", flush=True)
    return table(runs)
