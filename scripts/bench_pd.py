"""Prefill/decode disaggregation, side by side: 1 prefill + 1 decode worker against 2 aggregated workers.

    python scripts/bench_pd.py                      # our workers: small preset on the CPU, 2 rounds
    python scripts/bench_pd.py --vllm --model-path DIR   # the vLLM arms (prefixpool/testing/bench_pd_vllm.py)

    arms    pd   prefixpool up --prefill 1 --decode 1     (the conductor pairs them, or serves in place)
            agg  prefixpool up --workers 2                (the cost policy; whole requests on each)
    rounds  each round starts each arm's fleet in turn (odd rounds the other order: CPU figures drift,
            so the arms are interleaved), warms it, sends the workload, reads the router's metrics, stops it
    load    a mix of long prompts with long outputs and short prompts with long outputs, Poisson
            arrivals, no prefix shared between requests (the prefix cache does not decide), greedy,
            ignore_eos, streamed with a frame per token (logprobs 0)
    report  TTFT and inter-token gap p50/p99 over every request of an arm's runs, split by prompt kind;
            output tokens/s per run; KV bytes moved (pd: prefill -> decode; agg: peer fetches);
            handoffs per run

Both arms run the same model, worker flags and hardware; only the roles differ. Bounded by --requests,
--rounds and --deadline-s. Prints a markdown table; benchmarks/pd.md keeps the latest with its command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from prefixpool.deploy.launcher import LocalCluster

WORDS = ("prefill decode block cache router pool etcd key value token layer batch stream fetch "
         "attention sequence server handoff prompt answer").split()
HANDOFFS = "prefixpool_pd_handoffs_total"
ARMS = {"pd": ("1 prefill + 1 decode", dict(num_workers=0, num_prefill=1, num_decode=1)),
        "agg": ("2 aggregated", dict(num_workers=2))}


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt: str
    max_tokens: int
    kind: str  # "long" or "short" prompt


@dataclass
class Outcome:
    kind: str
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    end_s: float = 0.0
    error: str = ""


def workload(args: argparse.Namespace, seed: int = 0) -> list[Job]:
    """Poisson arrivals; a fraction --long-share of long prompts; each prompt starts with its own number."""
    rng = random.Random(seed)
    jobs, clock = [], 0.0
    for i in range(args.requests):
        clock += rng.expovariate(args.rate)
        kind = "long" if rng.random() < args.long_share else "short"
        chars = int((args.long_chars if kind == "long" else args.short_chars) * rng.uniform(0.75, 1.25))
        text = f"Request {i}: "
        while len(text) < chars:
            text += rng.choice(WORDS) + " "
        jobs.append(Job(clock, text[:chars], args.output_tokens, kind))
    return jobs


async def _one(session: aiohttp.ClientSession, url: str, model: str, job: Job, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
    sent, outcome, last = time.perf_counter(), Outcome(job.kind), 0.0
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return Outcome(job.kind, error=f"{response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {") or not json.loads(line[6:]).get("choices"):
                continue
            now = time.perf_counter()
            if outcome.num_tokens == 0:
                outcome.ttft_s = now - sent
            else:
                outcome.gaps_s.append(now - last)
            last, outcome.num_tokens = now, outcome.num_tokens + 1
    outcome.end_s = time.perf_counter() - start
    return outcome


async def send(url: str, model: str, jobs: list[Job], deadline_s: float) -> list[Outcome]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline_s)) as session:
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(session, url, model, job, start) for job in jobs)))


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics") as reply:
        text = reply.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def run_arm(arm: str, args: argparse.Namespace, jobs: list[Job], log_dir: Path) -> dict:
    """One run of one arm: its own fleet, a warm-up, the workload, what the router counted."""
    worker_args = ("--model", args.model, "--num-blocks", str(args.num_blocks), "--chunk-size", str(args.chunk_size),
                   "--max-batch-size", "8", *args.worker_arg)
    router_args = ("--model", args.model, *args.router_arg)
    with LocalCluster(worker_args=worker_args, router_args=router_args, log_dir=log_dir, **ARMS[arm][1]) as cluster:
        _wait_for_nodes(cluster.router_url, 2)
        asyncio.run(send(cluster.router_url, args.model, [Job(0.0, "warm up " * 40, 8, "short")], args.deadline_s))
        before = metrics(cluster.router_url)
        outcomes = asyncio.run(send(cluster.router_url, args.model, jobs, args.deadline_s))
        after = metrics(cluster.router_url)
    moved = "prefixpool_pd_handoff_bytes_total" if arm == "pd" else "prefixpool_fetched_bytes_total"
    ok = [o for o in outcomes if not o.error]
    return {"arm": arm, "outcomes": ok, "errors": [o.error for o in outcomes if o.error],
            "tokens_per_s": sum(o.num_tokens for o in ok) / max(o.end_s for o in ok) if ok else 0.0,
            "bytes": after.get(moved, 0.0) - before.get(moved, 0.0),
            "handoffs": after.get(HANDOFFS, 0.0) - before.get(HANDOFFS, 0.0)}


def _wait_for_nodes(url: str, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/healthz") as reply:
            if json.load(reply)["workers"] >= count:
                return
        time.sleep(0.2)
    raise SystemExit(f"the router never saw {count} workers")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def table(runs: list[dict]) -> str:
    lines = ["| arm | runs | prompts | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| output tok/s | KV moved / run | handoffs / run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, (label, _) in ARMS.items():
        mine = [r for r in runs if r["arm"] == arm]
        for kind in ("long", "short", "all"):
            outcomes = [o for r in mine for o in r["outcomes"] if kind in ("all", o.kind)]
            if not outcomes:
                continue
            ttft = [o.ttft_s * 1e3 for o in outcomes]
            gaps = [g * 1e3 for o in outcomes for g in o.gaps_s]
            per_run = (f"{statistics.mean(r['tokens_per_s'] for r in mine):.1f} | "
                       f"{statistics.mean(r['bytes'] for r in mine) / 1e6:.1f} MB | "
                       f"{statistics.mean(r['handoffs'] for r in mine):.1f}") if kind == "all" else " | | "
            lines.append(f"| {label} | {len(mine)} | {kind} | {len(outcomes)} | {percentile(ttft, 50):.0f} | "
                         f"{percentile(ttft, 99):.0f} | {percentile(gaps, 50):.1f} | {percentile(gaps, 99):.1f} | "
                         f"{per_run} |")
    errors = [e for r in runs for e in r["errors"]]
    if errors:
        lines.append(f"\n{len(errors)} requests failed, e.g. {errors[0]}")
    return "\n".join(lines)


def run_ours(args: argparse.Namespace) -> str:
    """Every round runs pd then agg (odd rounds agg first): the markdown table of all runs."""
    jobs = workload(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="prefixpool-bench-pd-") as logs:
        for round_index in range(args.rounds):
            order = ("pd", "agg") if round_index % 2 == 0 else ("agg", "pd")
            for arm in order:
                runs.append(run_arm(arm, args, jobs, Path(logs) / f"{arm}-{round_index}"))
                print(f"round {round_index} {arm}: {runs[-1]['tokens_per_s']:.1f} tok/s, {runs[-1]['handoffs']:.0f} "
                      f"handoffs, {runs[-1]['bytes'] / 1e6:.1f} MB moved, {len(runs[-1]['errors'])} errors",
                      flush=True)
    return table(runs)


# -- the vLLM arms: a separate place, run with --vllm (prefixpool/testing/bench_pd_vllm.py) -------------------

def run_vllm(args: argparse.Namespace, rest: list[str]) -> str:
    """1 prefill + 1 decode vLLM server (with PrefixPoolConnector) against 2 aggregated ones: the vLLM
    arm's own module parses the flags this parser does not know (--model-path ...) and returns its table."""
    from prefixpool.testing import bench_pd_vllm  # imported only here: it needs vLLM

    return bench_pd_vllm.main(args, rest, jobs=workload(args), send=send, table=table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="preset of our workers (default small: 4 layers, 256 wide)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--long-share", type=float, default=0.5, help="fraction of long prompts")
    parser.add_argument("--long-chars", type=int, default=3000, help="long prompt length (byte tokens, +-25%%)")
    parser.add_argument("--short-chars", type=int, default=100, help="short prompt length (+-25%%)")
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--deadline-s", type=float, default=600.0, help="bound on one run's workload")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker")
    parser.add_argument("--router-arg", action="append", default=[], help="extra flag for the router")
    parser.add_argument("--vllm", action="store_true", help="run the vLLM arms instead of our workers' "
                        "(see prefixpool/testing/bench_pd_vllm.py for their flags)")
    args, rest = parser.parse_known_args()
    if args.vllm:
        print(run_vllm(args, rest))
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    print(run_ours(args))


if __name__ == "__main__":
    main()
