"""The router against the worker directly and against sglang-router (Rust); prints markdown tables.

    python scripts/bench_router.py [--requests 300] [--tokens 8000] [--concurrency 32]

1. Decisions/s: the real Router in-process (hash, longest prefix over the index, cost
   policy) for 8k- and 128k-token prompts with 8 registered workers; tokenization is
   timed in its own column.
2. Added latency: one client, keep-alive connections, the same 8k-token completion
   (1 output token) sent in turn to: a null worker directly (prefixpool/testing/null_worker.py:
   the real worker protocol, instant replies), our router in front of it, and
   sglang-router (cache_aware) in front of the same null worker's OpenAI endpoint.
   The router's added latency is its quantile minus the direct one.
3. Throughput: requests/s at a fixed client concurrency, direct, our router with 1 and
   2 processes (--processes, SO_REUSEPORT), sglang-router.
4. The demo's remote-fetch phase TTFT with workers run with and without
   --fetch-while-queued (`--demo` to include it: it runs the tiny model twice).
Everything runs on 127.0.0.1 and is stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from prefixpool.deploy.etcd_server import EtcdServer, free_port
from prefixpool.deploy.processes import Child, python_argv, spawn
from prefixpool.meta.membership import NodeRecord
from prefixpool.router.cost_model import CostModel
from prefixpool.meta.index import BlockIndex
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.service import Router, RouterConfig
from prefixpool.model.tokenizer import load_tokenizer
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import Namespace, chain
from prefixpool.testing.proc_cpu import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent


class _StaticView:
    """A fixed set of workers over a real BlockIndex (what the etcd mirror holds)."""

    def __init__(self, workers: dict[str, NodeRecord], index: BlockIndex) -> None:
        self._workers, self.index = workers, index

    def workers(self):
        return self._workers

    def longest_prefix(self, keys):
        return self.index.longest_prefix(keys)

    def lower_tiers(self, node_id, keys):
        return self.index.lower_tiers(node_id, keys)

    def fleet_share(self, worker, exclude):
        return 0, 0

    def held_blocks(self, node_id):
        return self.index.num_blocks(node_id)

    def report_revision(self, node_id):
        return 0

    def num_keys(self) -> int:
        return len(self.index)

    def lag_s(self) -> float:
        return 0.0


def _text(num_tokens: int, seed: int) -> str:
    """`num_tokens` byte-tokenizer tokens: printable ASCII, one byte each."""
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, num_tokens, dtype=np.uint8)).decode()


def decisions_per_second(num_tokens: int, num_workers: int, seconds: float = 3.0,
                         index_type=BlockIndex) -> tuple[float, float, float]:
    """(decisions per wall second, per CPU second of this thread, tokenization seconds per prompt), 16 prompts in turn.

    A decision is what the issue defines: hash the blocks, longest prefix over the index,
    cost policy over the workers (Router.prepare on ids already made, then Router.decide).
    Tokenization is timed on its own, over the same prompts. The CPU-second rate leaves out
    the time other processes of a shared machine hold the core (not their cache traffic). `index_type`: the
    block index to route over (scripts/bench_index.py passes the old dict index too).
    """
    namespace = Namespace("tiny", block_size=16)
    workers = {f"w{i}": NodeRecord(f"w{i}", f"http://127.0.0.1:{9000 + i}", "tcp://127.0.0.1:1", 16, 1024, "tiny")
               for i in range(num_workers)}
    index = index_type()
    prompts = [_text(num_tokens, i) for i in range(16)]
    for i, prompt in enumerate(prompts):  # every prompt cached on one or two workers, at different depths
        keys = chain(list(prompt.encode()), namespace)
        index.add(f"w{i % num_workers}", keys[: len(keys) * (1 + i % 3) // 3])
        index.add(f"w{(i + 3) % num_workers}", keys[: len(keys) // 2])
    config = RouterConfig(model="tiny", namespace=namespace, max_context=10**6, vocab_size=259)
    router = Router(config, load_tokenizer(""), _StaticView(workers, index), WorkerClient(), CostModel(),
                    rng=random.Random(0))
    bodies = [CompletionBody(model="tiny", prompt=p, max_tokens=1) for p in prompts]
    ids = [router.tokenize(body) for body in bodies]  # once to warm up, then timed
    start = time.perf_counter()
    ids = [router.tokenize(body) for body in bodies for _ in range(4)][::4]
    tokenize_s = (time.perf_counter() - start) / (4 * len(bodies))
    count, start, cpu_start = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        i = count % len(bodies)
        router.decide(router.prepare(bodies[i], ids[i]))
        count += 1
    return count / (time.perf_counter() - start), count / (time.thread_time() - cpu_start), tokenize_s


class Stack:
    """etcd, one null worker, our router (1 and 2 processes) and sglang-router, all on 127.0.0.1."""

    def __init__(self) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="prefixpool-bench-router-"))
        self.env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.children: list[Child] = []
        self.sglang: subprocess.Popen | None = None

    def start(self) -> "Stack":
        self.etcd = EtcdServer().start()
        self.worker = self._spawn("null-worker", [sys.executable, "-m", "prefixpool.testing.null_worker",
                                                  "--etcd-endpoints", self.etcd.endpoint, "--node-id", "null-0"])
        common = ("--port", "0", "--etcd-endpoints", self.etcd.endpoint)
        self.router = self._spawn("router-1", python_argv("router", *common, "--router-id", "bench-1"))
        self.router2 = self._spawn("router-2", python_argv("router", *common, "--router-id", "bench-2",
                                                           "--processes", "2"))
        self.sglang_url = self._start_sglang()
        for url in (self.router.url, self.router2.url):
            _wait(lambda: _get_json(url + "/healthz")["workers"] == 1, "the router to see the null worker")
        return self

    def _spawn(self, name: str, argv: list[str]) -> Child:
        child = spawn(name, argv, self.log_dir, self.env, timeout_s=240)
        self.children.append(child)
        return child

    def _start_sglang(self) -> str | None:
        try:
            import sglang_router  # noqa: F401 - only to know it is installed (the bench extra)
        except ImportError:
            return None
        port = free_port()
        log = open(self.log_dir / "sglang-router.log", "wb")  # noqa: SIM115 - closed with the process
        self.sglang = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", self.worker.url, "--policy",
             "cache_aware", "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": "tiny", "prompt": "warm", "max_tokens": 1}).encode()
        _wait(lambda: _post_ok(url + "/v1/completions", body), "sglang-router to answer")
        return url

    def stop(self) -> None:
        if self.sglang is not None:
            self.sglang.terminate()
            try:
                self.sglang.wait(10)
            except subprocess.TimeoutExpired:
                self.sglang.kill()
                self.sglang.wait()
        for child in reversed(self.children):
            child.stop()
        self.etcd.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def pids(self) -> dict[str, int]:
        """The process behind each latency target: the null worker for the direct path."""
        found = {"direct (null worker)": self.worker.pid, "prefixpool router": self.router.pid}
        if self.sglang is not None:
            found["sglang-router 0.3.2 (cache_aware)"] = self.sglang.pid
        return found

    def targets(self, processes: bool = False) -> dict[str, str]:
        found = {"direct (null worker)": self.worker.url, "prefixpool router": self.router.url}
        if processes:
            found["prefixpool router, 2 processes"] = self.router2.url
        if self.sglang_url:
            found["sglang-router 0.3.2 (cache_aware)"] = self.sglang_url
        return found


def _wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def _post_ok(url: str, body: bytes) -> bool:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.status == 200


def cpu_per_request(pids: dict[str, int], run, num_served: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process spent per request it served while `run()` ran: load-independent,
    unlike latency on a shared machine (the null worker serves every path's requests)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    run()
    return {name: (cpu_seconds(pid) - before[name]) / num_served[name] for name, pid in pids.items()}


def added_latency(targets: dict[str, str], body: bytes, requests: int) -> dict[str, list[float]]:
    """Sequential requests, the targets in turn, each over its own keep-alive connection."""
    connections = {name: http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
                   for name, url in targets.items()}
    headers = {"Content-Type": "application/json"}
    times: dict[str, list[float]] = {name: [] for name in targets}
    for i in range(requests + 20):  # the first 20 warm up
        for name, connection in connections.items():
            start = time.perf_counter()
            connection.request("POST", "/v1/completions", body, headers)
            reply = connection.getresponse()
            reply.read()
            elapsed = time.perf_counter() - start
            assert reply.status == 200, (name, reply.status)
            if i >= 20:
                times[name].append(elapsed)
    for connection in connections.values():
        connection.close()
    return times


async def _throughput(url: str, body: bytes, concurrency: int, requests: int) -> float:
    remaining = requests

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as reply:
                await reply.read()
                assert reply.status == 200

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return requests / (time.perf_counter() - start)


def throughput(targets: dict[str, str], body: bytes, concurrency: int, requests: int) -> dict[str, float]:
    return {name: asyncio.run(_throughput(url, body, concurrency, requests)) for name, url in targets.items()}


def demo_fetch_ttft(fetch_while_queued: bool) -> float:
    """Median TTFT of `prefixpool demo`'s remote-fetch phase, workers run with the given setting."""
    from prefixpool.deploy.demo import DOCUMENT, Demo, _wait_ready
    from prefixpool.deploy.launcher import LocalCluster

    worker_args = ("--num-blocks", "2048", "--lease-ttl-s", "5", "--fetch-while-queued", str(fetch_while_queued))
    with LocalCluster(2, worker_args) as cluster:
        _wait_ready(cluster.router_url, 2)
        demo = Demo(cluster, "tiny", DOCUMENT * 24, 4)
        demo.run()
    name, answers = demo.rows[-1]
    assert name.startswith("remote fetch") and demo.wrong == 0
    return statistics.median(a["ttft"] for a in answers)


def _row(name: str, values: list[float], direct: list[float]) -> str:
    p50, p99 = np.quantile(values, [0.5, 0.99]) * 1e3
    if values is direct:
        return f"| {name} | {p50:.2f} | {p99:.2f} | | |"
    d50, d99 = np.quantile(direct, [0.5, 0.99]) * 1e3
    return f"| {name} | {p50:.2f} | {p99:.2f} | {p50 - d50:.2f} | {p99 - d99:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--throughput-requests", type=int, default=3000)
    parser.add_argument("--demo", action="store_true", help="also run the demo twice (fetch while queued on / off)")
    args = parser.parse_args()

    print(f"\n### Routing decisions, {args.workers} workers (in-process: hash, longest prefix, cost policy; "
          f"tokenization on its own)\n")
    print("| prompt tokens | decisions/s | per decision | decisions per CPU second | tokenize (byte tokenizer) |")
    print("|---:|---:|---:|---:|---:|")
    for num_tokens in (args.tokens, 128_000):
        rate, cpu_rate, tokenize_s = decisions_per_second(num_tokens, args.workers)
        print(f"| {num_tokens:,} | {rate:,.0f} | {1e3 / rate:.3f} ms | {cpu_rate:,.0f} | {tokenize_s * 1e3:.3f} ms |",
              flush=True)

    body = json.dumps({"model": "tiny", "prompt": _text(args.tokens, 99), "max_tokens": 1, "temperature": 0}).encode()
    stack = Stack().start()
    try:
        targets, times = stack.targets(), {}
        served = ({name: args.requests + 20 for name in targets}
                  | {"direct (null worker)": len(targets) * (args.requests + 20)})
        cpu = cpu_per_request(stack.pids(), lambda: times.update(added_latency(targets, body, args.requests)), served)
        rates = throughput(stack.targets(processes=True), body, args.concurrency, args.throughput_requests)
    finally:
        stack.stop()
    direct = times["direct (null worker)"]
    print(f"\n### Added latency, {args.tokens:,}-token prompt, 1 output token, {args.requests} sequential requests "
          f"each (targets in turn, keep-alive)\n")
    print("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU per request ms (its process) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in times.items():
        print(f"{_row(name, values, direct)} {cpu[name] * 1e3:.3f} |")
    print(f"\n### Throughput, {args.tokens:,}-token prompt, {args.concurrency} concurrent clients "
          f"(one asyncio process), {args.throughput_requests} requests each\n")
    print("| path | requests/s |")
    print("|---|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} |")
    if args.demo:
        print("\n### The demo's remote-fetch phase (tiny model, 2 workers), median TTFT\n")
        print("| workers run with | remote-fetch TTFT ms |")
        print("|---|---:|")
        for setting in (False, True):
            print(f"| --fetch-while-queued {str(setting).lower()} | {demo_fetch_ttft(setting) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
