"""Router overhead and routing decisions per second; prints markdown tables.

    python scripts/bench_router.py [--requests 200] [--tokens 8000]

1. Decisions/s: the real Router (hash the prompt, index.longest_prefix, cost policy)
   for 8k-token prompts with 8 registered workers, in-process, no HTTP.
2. Overhead: the same request (8k tokens, 1 output token, prefix cached) sent
   through the router and straight to the worker's /generate, interleaved; the
   difference of the latency distributions is what the router adds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request

import numpy as np

from cluster.deploy.launcher import LocalCluster
from cluster.meta.membership import NodeRecord
from router.cost_model import CostModel
from router.index import BlockIndex
from router.openai_schema import CompletionBody
from router.service import Router, RouterConfig
from router.contract.tokenizer import load_tokenizer
from router.worker_client import WorkerClient
from store.keys import Namespace, chain


class _StaticView:
    """A fixed set of workers over a real BlockIndex (what the etcd mirror holds)."""

    def __init__(self, workers: dict[str, NodeRecord], index: BlockIndex) -> None:
        self._workers, self.index = workers, index

    def workers(self):
        return self._workers

    def longest_prefix(self, keys):
        return self.index.longest_prefix(keys)

    def num_keys(self) -> int:
        return len(self.index)

    def lag_s(self) -> float:
        return 0.0

    def tier_of(self, node_id, key):
        return self.index.tier_of(node_id, key)


def decisions_per_second(num_tokens: int, num_workers: int, seconds: float = 3.0) -> tuple[float, float]:
    namespace = Namespace("tiny", block_size=16)
    workers = {f"w{i}": NodeRecord(f"w{i}", f"http://127.0.0.1:{9000 + i}", "tcp://127.0.0.1:1", 16, 1024, "tiny")
               for i in range(num_workers)}
    index = BlockIndex()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 250, num_tokens).tolist() for _ in range(32)]
    for i, prompt in enumerate(prompts):  # every prompt cached on one or two workers, at different depths
        keys = chain(prompt, namespace)
        index.add(f"w{i % num_workers}", keys[: len(keys) * (1 + i % 3) // 3])
        index.add(f"w{(i + 3) % num_workers}", keys[: len(keys) // 2])
    config = RouterConfig(model="tiny", namespace=namespace, max_context=10**6, vocab_size=259)
    router = Router(config, load_tokenizer(""), _StaticView(workers, index), WorkerClient(), CostModel(), rng=random.Random(0))
    prepared = [router.prepare(CompletionBody(model="tiny", prompt=p, max_tokens=1)) for p in prompts]
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        router.decide(prepared[count % len(prepared)])
        count += 1
    elapsed = time.perf_counter() - start
    return count / elapsed, elapsed / count


def _post(url: str, body: dict) -> float:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()
    return time.perf_counter() - start


def overhead(num_tokens: int, requests: int) -> dict[str, list[float]]:
    tokens = np.random.default_rng(1).integers(1, 250, num_tokens).tolist()
    with LocalCluster(1, ("--num-blocks", "1024")) as cluster:
        worker_url = next(iter(cluster.workers.values())).url
        for _ in range(100):
            with urllib.request.urlopen(f"{cluster.router_url}/healthz") as reply:
                if json.load(reply)["workers"]:
                    break
            time.sleep(0.1)
        via_router = {"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
        direct = {"request_id": "bench", "tokens": tokens, "sampling": {"max_tokens": 1}}
        _post(f"{cluster.router_url}/v1/completions", via_router)  # computes and caches the prefix
        times: dict[str, list[float]] = {"router": [], "direct": []}
        for _ in range(requests):
            times["router"].append(_post(f"{cluster.router_url}/v1/completions", via_router))
            times["direct"].append(_post(f"{worker_url}/generate", direct))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    rate, per = decisions_per_second(args.tokens, args.workers)
    print(f"\n### Routing decisions, {args.tokens:,}-token prompts, {args.workers} workers (in-process)\n")
    print("| decisions/s | per decision | what one decision does |")
    print("|---:|---:|---|")
    print(f"| {rate:,.0f} | {per * 1e3:.2f} ms | hash {args.tokens // 16} blocks, longest prefix over the index, cost policy over {args.workers} workers |")
    times = overhead(args.tokens, args.requests)
    print(f"\n### Router overhead, {args.tokens:,}-token prompt (prefix cached), 1 output token, {args.requests} requests each\n")
    print("| path | p50 ms | p99 ms | mean ms |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        q = np.quantile(values, [0.5, 0.99]) * 1e3
        print(f"| {name} | {q[0]:.2f} | {q[1]:.2f} | {statistics.mean(values) * 1e3:.2f} |")
    added = np.quantile(times["router"], [0.5, 0.99]) - np.quantile(times["direct"], [0.5, 0.99])
    print(f"| router adds | {added[0] * 1e3:.2f} | {added[1] * 1e3:.2f} | "
          f"{(statistics.mean(times['router']) - statistics.mean(times['direct'])) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
