"""`prefixpool demo`: bring the pool up on 127.0.0.1 and show what the cache saves.

    1. cold          a long shared prefix (system prompt + document) seen for the first time
    2. local hit     the same prefix with new questions: routed to the worker that holds it
    3. remote fetch  the holder is kept busy, so the router sends the request to the idle
                     worker with a fetch plan: KV moves over the transfer layer instead of
                     being recomputed
    4. correctness   every cached answer is compared with the same prompt computed cold
                     (a fresh cache_salt), greedy, token for token; in bfloat16 or float16 its
                     per-token logprobs too, float for float (run the workers with
                     --worker-arg=--batch-invariant: without it reuse rounds differently)

Prints one table: TTFT per phase, hit rate and bytes moved. Bounded: a fixed
number of requests, everything stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.contract.worker_api import GenerateRequest, SamplingParams, encode

DOCUMENT = ("The prefix pool keeps the key and value tensors of every full block of a prompt, "
            "found again by a chained hash of the tokens, so a repeated prefix is not computed twice. ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="model preset of the workers")
    parser.add_argument("--prefix-repeats", type=int, default=24, help="size of the shared prefix (x ~170 tokens)")
    parser.add_argument("--questions", type=int, default=4, help="requests per phase")
    parser.add_argument("--dtype", default="float32", help="model and KV dtype of the workers and the router; "
                        "in bfloat16 or float16 the check compares every logprob exactly")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra flag for every worker (repeatable), e.g. --worker-arg=--batch-invariant")


def run(args: argparse.Namespace) -> int:
    model = ("--model", args.model, "--dtype", args.dtype)
    worker_args = (*model, "--num-blocks", "2048", "--lease-ttl-s", "5", *args.worker_arg)
    print(f"starting etcd, {args.workers} workers and a router on 127.0.0.1 ...", flush=True)
    with LocalCluster(args.workers, worker_args, model) as cluster:
        _wait_ready(cluster.router_url, args.workers)
        print(f"router at {cluster.router_url}\n", flush=True)
        demo = Demo(cluster, args.model, DOCUMENT * args.prefix_repeats, args.questions,
                    exact_logprobs=args.dtype != "float32")
        print(demo.run())
    return 1 if demo.wrong else 0


def _wait_ready(url: str, workers: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/healthz") as reply:
            if json.load(reply)["workers"] >= workers:
                return
        time.sleep(0.2)
    raise RuntimeError("workers did not register in time")


class Demo:
    def __init__(self, cluster: LocalCluster, model: str, prefix: str, questions: int,
                 exact_logprobs: bool = False) -> None:
        self.cluster, self.model, self.prefix, self.questions = cluster, model, prefix, questions
        # float32 logprobs of a reused prefix agree with cold ones only to rounding; half precision with the
        # batch-invariant mode bit for bit, so there they are compared exactly
        self.exact_logprobs = exact_logprobs
        self.rows: list[tuple[str, list[dict]]] = []
        self.wrong = 0

    def run(self) -> str:
        prompts = [f"{self.prefix}Question {i}: what does the pool keep?" for i in range(self.questions)]
        self.phase("cold (first time this prefix is seen)", [self.ask(prompts[0])])
        self.phase("local hit (same worker holds the prefix)", [self.ask(p) for p in prompts[1:]])
        self.phase("remote fetch (holder busy, idle worker fetches)", self.fetch_phase(prompts))
        return self.table()

    def ask(self, prompt: str, salt: str = "demo", max_tokens: int = 16) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
        request = urllib.request.Request(f"{self.cluster.router_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start, ttft, text, usage, logprobs = time.perf_counter(), None, "", {}, []
        with urllib.request.urlopen(request, timeout=300) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    ttft = ttft or time.perf_counter() - start
                    text += chunk["choices"][0]["text"]
                    logprobs += (chunk["choices"][0].get("logprobs") or {}).get("token_logprobs", [])
                usage = chunk.get("usage") or usage
        return {"ttft": ttft or 0.0, "text": text, "usage": usage, "prompt": prompt, "logprobs": logprobs}

    def fetch_phase(self, prompts: list[str]) -> list[dict]:
        holder = self._route(prompts[0])["worker"]
        stop = threading.Event()
        busy = [threading.Thread(target=self._keep_busy, args=(holder, i, stop), daemon=True) for i in range(4)]
        for thread in busy:
            thread.start()
        try:
            deadline = time.monotonic() + 20
            while self._route(prompts[0])["worker"] == holder and time.monotonic() < deadline:
                time.sleep(0.2)
            return [self.ask(p.replace("Question", "Follow-up")) for p in prompts]
        finally:
            stop.set()

    def _keep_busy(self, worker: str, seed: int, stop: threading.Event) -> None:
        body = GenerateRequest(request_id=f"demo-busy-{seed}", tokens=list(range(1, 100)),
                               sampling=SamplingParams(max_tokens=600, seed=seed, ignore_eos=True))
        request = urllib.request.Request(f"{self.cluster.workers[worker].url}/generate",
                                         data=encode(body), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            for _ in reply:
                if stop.is_set():
                    return

    def _route(self, prompt: str) -> dict:
        request = urllib.request.Request(f"{self.cluster.router_url}/v1/route", data=json.dumps(
            {"model": self.model, "prompt": prompt, "cache_salt": "demo"}).encode())
        with urllib.request.urlopen(request) as reply:
            return json.load(reply)

    def phase(self, name: str, answers: list[dict]) -> None:
        for answer in answers:
            if answer["usage"]["prompt_tokens_details"]["cached_tokens"]:
                cold = self.ask(answer["prompt"], salt=f"oracle-{time.monotonic_ns()}")
                same_logprobs = cold["logprobs"] == answer["logprobs"] or not self.exact_logprobs
                self.wrong += cold["text"] != answer["text"] or not same_logprobs
        self.rows.append((name, answers))

    def table(self) -> str:
        lines = ["| phase | requests | TTFT median ms | prompt tokens | cached (hit rate) | "
                 "fetched tokens | bytes moved |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for name, answers in self.rows:
            usage = [a["usage"] for a in answers]
            prompt = sum(u["prompt_tokens"] for u in usage)
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
            fetched = sum(u["prefixpool"]["fetched_tokens"] for u in usage)
            moved = sum(u["prefixpool"]["fetched_bytes"] for u in usage)
            ttft = statistics.median(a["ttft"] for a in answers) * 1e3
            lines.append(f"| {name} | {len(answers)} | {ttft:.1f} | {prompt:,} | {cached:,} ({cached / prompt:.0%}) | "
                         f"{fetched:,} | {moved:,} |")
        checked = sum(1 for _, answers in self.rows for a in answers
                      if a["usage"]["prompt_tokens_details"]["cached_tokens"])
        compared = "text and logprobs" if self.exact_logprobs else "text"
        lines.append("\nEvery cached answer re-asked cold (fresh cache_salt): "
                     f"{checked - self.wrong}/{checked} identical ({compared}).")
        return "\n".join(lines)
