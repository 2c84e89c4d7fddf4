"""vLLM's own benchmark client against 2 vLLM servers behind our router (per policy) and behind sglang-router.

    python scripts/bench_gateway.py [--shapes ref,many,long,fast,random]
                                    [--fronts pressure,cost,round_robin,sglang[,sglang-nodelay]]
                                    [--repeat 1] [--out benchmarks/gateway.md] [--hidden-size 128 --layers 2]
    python scripts/bench_gateway.py --added 150     # what each front adds to one server's TTFT, requests in turn
    python scripts/bench_gateway.py --added 400 --against REV   # and our router as of a git revision, beside

Per workload shape, one fleet (`prefixpool up --vllm 2` as a LocalCluster: etcd, 2 vLLM servers of a
tiny random Llama with KV events, their sidecars) whose KV caches are capped (--num-gpu-blocks-override)
so that neither server holds every prefix but both together do. Per front, in turn: both prefix caches
reset (vLLM's /reset_prefix_cache; the index emptied through the KV events), a fresh front started (our
router with one policy, or `python -m sglang_router.launch_router --policy cache_aware` over the two
vLLM URLs), then vLLM's own client (scripts/vllm_bench_client.py in .venv-vllm: `vllm bench serve`,
dataset prefix_repetition or random) sends the shape's prompts at its Poisson rate. The hit rate is
vLLM's own: the rise of vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total, summed over
both servers; TTFT and ITL percentiles are the client's; the ideal is one never-evicting cache fed the
same prompts. sglang-router is installed into .venv-vllm on first use (pip, sglang-router==0.3.2).
The front `sglang-nodelay` is the same sglang-router with TCP_NODELAY set on each socket it accepts
(scripts/nodelay_shim.c, loaded with LD_PRELOAD, built with the system's C compiler): as shipped it
sends a stream's headers and first chunk in two writes with Nagle's algorithm on, and about one answer
in ten waits for the client's delayed ACK (40 ms) before its first token.
A fleet is reused across its shape's fronts (a reset empties it; vLLM starts take most of a run), warmed
up first with --warm-up (and with --warm-up-arm by one whole run of the shape through our round robin, shown
and not counted); the fronts run interleaved, so a slow spell of the shared machine falls on all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.priority import group_members, threads
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.deploy.vllm_fleet import DEFAULT_SPIN_S, spin_seconds
from prefixpool.deploy.vllm_server import DEFAULT_PYTHON, VllmConfig
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.model.tokenizer import load_tokenizer
from prefixpool.testing.proc_cpu import cpu_seconds
from prefixpool.testing.prometheus import buckets, quantile, scrape

REPO = Path(__file__).resolve().parent.parent
MODEL, BLOCK = "tiny-vllm", 32
SGLANG_ROUTER = "sglang-router==0.3.2"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PREEMPTIONS = "vllm:num_preemptions_total"
OVERHEAD, PHASES = "prefixpool_router_overhead_seconds", ("prepare", "decide", "relay")
ROUTER_POLICIES = ("pressure", "cost", "round_robin", "cost_local", "least_load")
PEERS = {"sglang": "sglang-router cache_aware", "sglang-nodelay": "sglang-router cache_aware, TCP_NODELAY added"}


@dataclass(frozen=True)
class Shape:
    """One workload: vLLM's dataset and its sizes, the rate, and each server's KV cache in blocks."""

    name: str
    dataset: str  # "prefix_repetition" or "random"
    num_prefixes: int  # random: 1 (its one shared prefix)
    prefix_len: int
    suffix_len: int
    num_prompts: int
    rate: float
    kv_blocks: int
    output_len: int = 4

    def client_flags(self) -> list[str]:
        flags = ["--dataset-name", self.dataset, "--num-prompts", str(self.num_prompts),
                 "--request-rate", str(self.rate), "--seed", "0"]
        if self.dataset == "random":
            return flags + ["--random-prefix-len", str(self.prefix_len), "--random-input-len", str(self.suffix_len),
                            "--random-output-len", str(self.output_len), "--random-range-ratio", "0"]
        return flags + ["--prefix-repetition-prefix-len", str(self.prefix_len),
                        "--prefix-repetition-suffix-len", str(self.suffix_len),
                        "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                        "--prefix-repetition-output-len", str(self.output_len)]

    def describe(self) -> str:
        blocks = self.num_prefixes * (self.prefix_len // BLOCK)
        return (f"{self.dataset}: {self.num_prefixes} x {self.prefix_len}-token prefix ({blocks} blocks), "
                f"{self.suffix_len}-token suffix, {self.output_len} out, {self.num_prompts} prompts at "
                f"{self.rate:g}/s; {self.kv_blocks} KV blocks per server")


# Each server holds 150 blocks: under the 192 prefix blocks of the prefix_repetition shapes, while both
# (300) hold them all with room for the running requests' suffixes. "fast" doubles the reference rate.
SHAPES = {s.name: s for s in (
    Shape("ref", "prefix_repetition", 12, 512, 32, 360, 6.0, 150),
    Shape("many", "prefix_repetition", 24, 256, 32, 360, 6.0, 150),
    Shape("long", "prefix_repetition", 6, 1024, 32, 240, 4.0, 150),
    Shape("fast", "prefix_repetition", 12, 512, 32, 360, 12.0, 150),
    Shape("random", "random", 1, 512, 32, 240, 6.0, 150),
)}


def post(url: str, body: dict | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200, reply.status


def reset_caches(cluster: LocalCluster, timeout_s: float = 120.0) -> None:
    """Empty both vLLM caches and wait until etcd names no block (a fresh router then starts empty).
    vLLM publishes the reset's AllBlocksCleared with its next engine step: one token in, one out."""
    for server in cluster.vllm_servers.values():
        post(f"{server.url}/reset_prefix_cache")
        post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1})
    asyncio.run(_wait_index_empty(cluster.etcd.endpoint, timeout_s))


async def _wait_index_empty(endpoint: str, timeout_s: float) -> None:
    etcd = EtcdClient(endpoint)
    deadline = time.monotonic() + timeout_s
    while (left := (await etcd.get_prefix(Layout("default").blocks_prefix)).kvs) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await etcd.close()
    assert not left, f"etcd still names {len(left)} blocks {timeout_s:.0f} s after the reset"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_nodelay_shim(directory: Path) -> Path:
    """scripts/nodelay_shim.c built into `directory` by the system's C compiler (cc)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the sglang-nodelay front needs a C compiler (cc) to build scripts/nodelay_shim.c")
    library = directory / "nodelay_shim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(REPO / "scripts" / "nodelay_shim.c"),
                    "-ldl"], check=True, capture_output=True)
    return library


class SglangRouter:
    """sglang-router 0.3.2 (Rust, from PyPI) over the vLLM servers, cache_aware; stopped by its own pid.
    `nodelay`: with TCP_NODELAY on each socket it accepts (build_nodelay_shim, LD_PRELOAD)."""

    def __init__(self, urls: list[str], log_dir: Path, nodelay: bool = False) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = open(log_dir / f"sglang-router-{port}.log", "w")
        env = {**os.environ, "LD_PRELOAD": str(build_nodelay_shim(log_dir))} if nodelay else None
        self.process = subprocess.Popen(
            [str(DEFAULT_PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],  # its own, on loopback
            stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang-router did not answer at {self.url}; see {log.name}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def ensure_sglang_router() -> None:
    probe = [str(DEFAULT_PYTHON), "-c", "import sglang_router.launch_router"]
    if subprocess.run(probe, capture_output=True).returncode:
        subprocess.run([str(DEFAULT_PYTHON), "-m", "pip", "install", "-q", SGLANG_ROUTER], check=True)


def start_peer(front: str, urls: list[str], log_dir: Path) -> SglangRouter:
    """A fresh sglang-router for the peer front `front` (a key of PEERS) over `urls`."""
    return SglangRouter(urls, log_dir, nodelay=front == "sglang-nodelay")


def start_front(front: str, cluster: LocalCluster, log_dir: Path):
    """A fresh front: (its URL, an object with stop())."""
    if front in PEERS:
        router = start_peer(front, [s.url for s in cluster.vllm_servers.values()], log_dir)
        return router.url, router
    child = spawn(f"router-{front}-{time.monotonic_ns()}", python_argv(
        "router", "--port", "0", *cluster._common(), *cluster._model(), "--policy", front), log_dir)
    return child.url, child


def run_client(url: str, shape: Shape, model_dir: Path, work: Path, name: str) -> tuple[dict, dict]:
    """vLLM's client against `url`: (its result JSON, per request too, kept as `name`.json; the ideal hit rate)."""
    result, ideal = work / f"{name}.json", work / "ideal.json"
    for path in (result, ideal):
        path.unlink(missing_ok=True)
    argv = [str(DEFAULT_PYTHON), str(REPO / "scripts" / "vllm_bench_client.py"), str(ideal),
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL,
            "--tokenizer", str(model_dir), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,itl",
            "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed", "--result-dir", str(work),
            "--result-filename", result.name, *shape.client_flags()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"vLLM's client failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result.read_text()), json.loads(ideal.read_text())


def run_arm(front: str, shape: Shape, cluster: LocalCluster, model_dir: Path, work: Path) -> dict:
    reset_caches(cluster)
    urls = [s.url for s in cluster.vllm_servers.values()]
    before = [scrape(u, (HITS, QUERIES, PREEMPTIONS)) for u in urls]
    url, process = start_front(front, cluster, work)
    try:
        result, ideal = run_client(url, shape, model_dir, work, f"result-{shape.name}-{front}-{time.time_ns()}")
    finally:
        process.stop()
    after = [scrape(u, (HITS, QUERIES, PREEMPTIONS)) for u in urls]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    queries = [d[QUERIES] for d in delta]
    return {"front": front, "shape": shape.name, "result": result, "ideal": ideal["hit_rate"],
            "hits": sum(d[HITS] for d in delta), "queries": queries,
            "hit_rate": sum(d[HITS] for d in delta) / max(sum(queries), 1),
            "split": max(queries) / max(sum(queries), 1), "preempted": sum(d[PREEMPTIONS] for d in delta),
            "load": os.getloadavg()[0]}


def ttfts_ms(arm: dict) -> np.ndarray:
    r = arm["result"]
    return np.array([t * 1000 for t, error in zip(r["ttfts"], r["errors"]) if not error])


def pooled(arms: list[dict]) -> dict:
    """One front's rounds on one shape as one arm: hits over queries summed, percentiles over every request."""
    results = [arm["result"] for arm in arms]
    ttfts = np.concatenate([ttfts_ms(arm) for arm in arms])
    itls = [t * 1000 for r in results for per_request in r["itls"] for t in per_request]
    queries = [sum(column) for column in zip(*(arm["queries"] for arm in arms))]
    result = {"completed": sum(r["completed"] for r in results), "num_prompts": sum(r["num_prompts"] for r in results),
              **{f"p{p}_ttft_ms": float(np.percentile(ttfts, p)) for p in (50, 90, 99) if len(ttfts)},
              **{f"p{p}_itl_ms": float(np.percentile(itls, p)) for p in (50, 99) if itls}}
    return {**arms[0], "front": f"{arms[0]['front']}, {len(arms)} rounds pooled", "result": result,
            "hit_rate": sum(arm["hits"] for arm in arms) / max(sum(queries), 1),
            "split": sum(arm["split"] for arm in arms) / len(arms),  # per round: a front may favour another server
            "preempted": sum(arm["preempted"] for arm in arms), "load": sum(arm["load"] for arm in arms) / len(arms)}


def rank_test(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """Exact one-sided Mann-Whitney test over runs: (p that ours are this much lower by chance, p that they are
    this much higher). Every split of the pooled values into the two fronts' sizes is equally likely if the front
    does not matter; with 3 runs each the smallest p is 1/20, reached when every run of one front beats every
    run of the other. Runs, not requests, are the unit: runs of one front differ more than the requests in a run
    do (the shared machine), so a test over requests calls such run-to-run drift a difference."""

    def below(xs: list[float], ys: list[float]) -> float:
        return sum((x < y) + 0.5 * (x == y) for x in xs for y in ys)

    values, observed = ours + theirs, below(ours, theirs)
    splits = [below([values[i] for i in chosen], [values[i] for i in range(len(values)) if i not in chosen])
              for chosen in map(set, itertools.combinations(range(len(values)), len(ours)))]
    return (sum(u >= observed for u in splits) / len(splits), sum(u <= observed for u in splits) / len(splits))


def difference_row(shape: str, front: str, ours: list[dict], theirs: list[dict], alpha: float = 0.05,
                   peer: str = PEERS["sglang"]) -> str:
    cells, verdicts = [], []
    for p in (90, 99):
        mine, other = ([float(np.percentile(ttfts_ms(arm), p)) for arm in arms] for arms in (ours, theirs))
        lower, higher = rank_test(mine, other)
        cells.append(f"{' '.join(f'{x:.1f}' for x in mine)} / {' '.join(f'{x:.1f}' for x in other)}")
        verdicts.append("better" if lower <= alpha else "worse" if higher <= alpha else "not told apart")
    return f"| {shape} | prefixpool {front} | {peer} | {cells[0]} | {cells[1]} | {verdicts[0]} / {verdicts[1]} |"


DIFFERENCE_HEADER = ["", "Per run, ours / the peer's; a verdict where an exact rank test over the runs gives",
                     "p <= 0.05:", "",
                     "| shape | front | against | TTFT p90 ms per run | TTFT p99 ms per run | p90 / p99 |",
                     "|---|---|---|---|---|---|"]


def row(arm: dict) -> str:
    r = arm["result"]

    def ms(metric: str, p: int) -> str:
        return f"{r.get(f'p{p}_{metric}_ms', float('nan')):,.1f}"

    key = arm["front"].split(",")[0].split(" ")[0]  # "sglang-nodelay, 2 rounds pooled", "round_robin (warm-up..."
    front = PEERS.get(key, f"prefixpool {key}") + arm["front"][len(key):]
    return (f"| {arm['shape']} | {front} | {r['completed']}/{r['num_prompts']} | **{arm['hit_rate']:.3f}** | "
            f"{arm['ideal']:.3f} | {ms('ttft', 50)} | {ms('ttft', 90)} | {ms('ttft', 99)} | {ms('itl', 50)} | "
            f"{ms('itl', 99)} | {arm['split']:.2f} | {int(arm['preempted'])} | {arm['load']:.1f} |")


HEADER = ["| shape | front | done | vLLM hit rate | ideal | TTFT p50 ms | p90 | p99 | ITL p50 ms | p99 | "
          "busier server's share | preemptions | load 1m |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def pin_servers(cluster: LocalCluster) -> dict[str, int]:
    """Each vLLM server's processes, every thread, onto a CPU of its own (server i on the i-th CPU this
    process may use, modulo): one accelerator per server, as a GPU fleet has. Unpinned, the server a front
    loads most borrows the other server's core while that one idles, which no GPU server can."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = {}
    for i, (name, server) in enumerate(cluster.vllm_servers.items()):
        pinned[name] = cpus[i % len(cpus)]
        for pid in group_members(server.pid, ""):  # each server runs in a process group of its own (setsid)
            for tid in threads(pid):
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    os.sched_setaffinity(tid, {pinned[name]})
    return pinned


def warm_up(cluster: LocalCluster, shape: Shape) -> None:
    """A few prompts of the shape's lengths on each server, some at once: a fresh vLLM's first requests are
    slow (first batch shapes), and without this the first front of a fleet would pay for them."""
    length = shape.prefix_len + shape.suffix_len
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((64, length // 2, length, length) * 2)]
    for server in cluster.vllm_servers.values():
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: post(f"{server.url}/v1/completions",
                                         {"model": MODEL, "prompt": p, "max_tokens": shape.output_len}), prompts))


def run_shape(shape: Shape, fronts: list[str], repeat: int, model_dir: Path, tmp: Path, out: Path | None,
              warm: bool, server: dict, warm_arm: bool = False, pin: bool = False) -> dict[str, list[dict]]:
    """`server`: VllmConfig fields for both servers (worker_nice, spin_s); `warm_arm`: one run of the shape
    through our round robin before the counted ones, its row shown as not counted."""
    config = VllmConfig(str(model_dir), MODEL, BLOCK, max_model_len=2048, num_blocks=shape.kv_blocks, **server)
    with LocalCluster(num_workers=0, vllm=config, num_vllm=2, log_dir=tmp / f"logs-{shape.name}") as cluster:
        if pin:
            print(f"vLLM servers pinned: {pin_servers(cluster)}", file=sys.stderr)
        if warm:
            warm_up(cluster, shape)
        if warm_arm:
            arm = run_arm("round_robin", shape, cluster, model_dir, tmp)
            emit(row({**arm, "front": "round_robin (warm-up, not counted)"}), out)
        arms: dict[str, list[dict]] = {front: [] for front in fronts}
        for round_no in range(repeat):
            order = fronts[round_no % len(fronts):] + fronts[:round_no % len(fronts)]
            for front in order:
                arms[front].append(run_arm(front, shape, cluster, model_dir, tmp))
                emit(row(arms[front][-1]), out)
        for front in fronts if repeat > 1 else ():
            emit(row(pooled(arms[front])), out)
    return arms


def difference_table(shapes: list[tuple[str, dict[str, list[dict]]]], out: Path | None) -> None:
    """Each of our fronts against each sglang-router front, per shape, once every shape has run (--repeat 2+)."""
    lines = [difference_row(shape, front, arms[front], arms[peer], peer=PEERS[peer]) for shape, arms in shapes
             for peer in PEERS if peer in arms for front in arms if front not in PEERS and len(arms[front]) > 1]
    for line in DIFFERENCE_HEADER + lines if lines else ():
        emit(line, out)


def added_latency(requests: int, model_dir: Path, tmp: Path, out: Path | None, server: dict,
                  against: str = "") -> None:
    """What each front adds to one vLLM server's TTFT, without queueing: `requests` streamed completions in
    turn (the random shape's prompt: its 512-token prefix, 32 random tokens, 4 out), each sent directly, through
    our router (pressure; with `against`, also our router as of that git revision) and through sglang-router (as
    shipped, and with TCP_NODELAY added), in a shuffled order; the first 5 rounds are not counted. Each router's
    CPU (its process's user + system time over the run, over the requests it answered) is shown beside."""
    shape = SHAPES["random"]
    config = VllmConfig(str(model_dir), MODEL, BLOCK, max_model_len=2048, num_blocks=shape.kv_blocks, **server)
    tokenizer = load_tokenizer(model_dir)
    with LocalCluster(num_workers=0, vllm=config, num_vllm=1, log_dir=tmp / "logs-added") as cluster:
        direct = next(iter(cluster.vllm_servers.values())).url
        fronts: dict[str, object] = {}
        try:
            url, fronts["prefixpool pressure"] = start_front("pressure", cluster, tmp)
            paths = {"vLLM directly": direct, "prefixpool pressure": url}
            if against:
                name = f"prefixpool pressure @ {against}"
                paths[name], fronts[name] = start_router_at(against, cluster, tmp)
            for front, name in PEERS.items():  # one at a time: those started are stopped if a later one fails
                fronts[name] = start_peer(front, [direct], tmp)
                paths[name] = fronts[name].url
            pids = {name: front.pid for name, front in fronts.items()}
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            phases_before = {phase: buckets(url, OVERHEAD, f'phase="{phase}"') for phase in PHASES}
            ttfts = asyncio.run(_in_turn(paths, tokenizer, shape, requests))
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            phases = {phase: {bound: count - phases_before[phase].get(bound, 0.0) for bound, count in
                              buckets(url, OVERHEAD, f'phase="{phase}"').items()} for phase in PHASES}
        finally:
            for front in fronts.values():
                front.stop()
    base = {p: float(np.percentile(ttfts["vLLM directly"], p)) for p in (50, 90)}
    emit("| path | requests | TTFT p50 ms | p90 | added p50 ms | added p90 | front CPU ms a request |", out)
    emit("|---|---:|---:|---:|---:|---:|---:|", out)
    for name, values in ttfts.items():
        p50, p90 = (float(np.percentile(values, p)) for p in (50, 90))
        per = f"{1000 * cpu[name] / (requests + 5):.2f}" if name in cpu else ""
        emit(f"| {name} | {len(values)} | {p50:.2f} | {p90:.2f} | {p50 - base[50]:+.2f} | {p90 - base[90]:+.2f} "
             f"| {per} |", out)
    emit("\nOur router's own time a request (this tree; prefixpool_router_overhead_seconds, interpolated within its "
         "buckets): " + ", ".join(f"{phase} {1000 * quantile(phases[phase], 0.5):.3f} / "
                                  f"{1000 * quantile(phases[phase], 0.9):.3f} ms" for phase in PHASES)
         + " (p50 / p90; prepare: head read to tokenized and hashed, decide: choosing the server, relay: vLLM's "
         "first token in the router to its frame written).", out)
    if against:
        new, old = np.array(ttfts["prefixpool pressure"]), np.array(ttfts[f"prefixpool pressure @ {against}"])
        emit(f"\nThis tree against {against}, request by request (each pair sent back to back, in a shuffled order): "
             f"lower in {np.mean(new < old):.0%} of {len(new)}, median difference {np.median(new - old):+.2f} ms.", out)


def start_router_at(revision: str, cluster: LocalCluster, work: Path):
    """Our router (pressure) as of a git revision: its prefixpool/ unpacked beside, the compiled extensions
    (not in git) copied from this tree; (its URL, its process)."""
    tree = work / f"tree-{revision.replace('/', '_')}"
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "prefixpool"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for built in (REPO / "prefixpool").rglob("*.so"):
            shutil.copy(built, tree / built.relative_to(REPO))
    argv = [sys.executable, "-P", *python_argv("router", "--port", "0", *cluster._common(), *cluster._model(),
                                               "--policy", "pressure")[1:]]  # -P: not this tree from the cwd
    child = spawn(f"router-at-{time.monotonic_ns()}", argv, work, env={"PYTHONPATH": str(tree)})
    return child.url, child


async def _in_turn(paths: dict[str, str], tokenizer, shape: Shape, requests: int) -> dict[str, list[float]]:
    rng = random.Random(0)
    def ids(n: int) -> list[int]:
        return [rng.randrange(3, tokenizer.vocab_size) for _ in range(n)]

    prefix = ids(shape.prefix_len)
    ttfts: dict[str, list[float]] = {name: [] for name in paths}
    async with aiohttp.ClientSession() as session:
        for i in range(requests + 5):
            prompt = tokenizer.decode(prefix + ids(shape.suffix_len))
            for name in rng.sample(list(paths), len(paths)):
                ttft = await _first_chunk_s(session, paths[name], prompt, shape.output_len)
                if i >= 5:
                    ttfts[name].append(ttft * 1000)
                await asyncio.sleep(0.02)
    return ttfts


async def _first_chunk_s(session: aiohttp.ClientSession, url: str, prompt: str, output_len: int) -> float:
    """Seconds to the first chunk with choices, as vLLM's client times TTFT; the stream is read to its end."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True}
    start, first = time.perf_counter(), None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if first is None and line.startswith(b"data: {") and b'"choices":[{' in line.replace(b" ", b""):
                first = time.perf_counter() - start
    assert first is not None, f"{url}: no chunk with a choice"
    return first


def emit(line: str, out: Path | None) -> None:
    """Print a line of the report and append it to --out (a long run keeps what it measured if cut short)."""
    print(line, flush=True)
    if out is not None:
        with out.open("a") as file:
            file.write(line + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--fronts", default="pressure,cost,round_robin,sglang",
                        help=f"comma list: router policies ({', '.join(ROUTER_POLICIES)}), sglang and sglang-nodelay "
                        "(sglang-router with TCP_NODELAY added: scripts/nodelay_shim.c)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the fronts per shape, rotated")
    parser.add_argument("--warm-up", action="store_true", help="send each fresh fleet a few prompts first "
                        "(runs with it showed requests stalled for tens of seconds under every front; off by default)")
    parser.add_argument("--warm-up-arm", action="store_true", help="then one whole run of the shape through our "
                        "round robin, shown and not counted: the first front of a fleet otherwise runs on servers "
                        "that still meet new batch shapes (rotated rounds put the same front first on every fleet)")
    parser.add_argument("--vllm-worker-nice", type=int, default=0, help="run each vLLM server's model worker at "
                        "this niceness (`prefixpool up --vllm-worker-nice`): it spins for 1 s after every step, so "
                        "> 0 lets the fronts, the client, vLLM's API servers and the other server go first")
    parser.add_argument("--vllm-spin-s", type=spin_seconds, default=DEFAULT_SPIN_S,
                        help="how long each vLLM server's processes spin after a message (`prefixpool up "
                        f"--vllm-spin-s`, default {DEFAULT_SPIN_S}; 'vllm': vLLM's own 1 s)")
    parser.add_argument("--added", type=int, default=0, help="instead of the shapes: N requests in turn to one vLLM "
                        "server directly, through our router and through sglang-router, as shipped and with "
                        "TCP_NODELAY added (what each front adds)")
    parser.add_argument("--against", default="", help="with --added: also our router as of this git revision "
                        "(e.g. HEAD~1), its requests interleaved with this tree's: an A/B of two builds")
    parser.add_argument("--pin-servers", action="store_true", help="each vLLM server's processes on a CPU of "
                        "their own, as one accelerator per server (unpinned, a busy server borrows an idle one's core)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many prompts per run (0: the shape's)")
    parser.add_argument("--hidden-size", type=int, default=128, help="the random Llama's hidden size (intermediate "
                        "2x). 128 with 2 layers: a prefill costs about what a front adds, so TTFT mostly measures the "
                        "fronts; larger: a miss costs more than the fronts, as serving a real model")
    parser.add_argument("--layers", type=int, default=2, help="the random Llama's layers")
    parser.add_argument("--out", default="", help="also write the table, with this command, to this file")
    parser.add_argument("--keep", default="", help="work in this directory and keep it: every process's log and "
                        "each run's per-request results (result-SHAPE-FRONT-NS.json)")
    args = parser.parse_args()
    args.shapes = [SHAPES[s] for s in args.shapes.split(",")]
    if args.limit:
        args.shapes = [dataclasses.replace(s, num_prompts=min(s.num_prompts, args.limit)) for s in args.shapes]
    args.fronts = args.fronts.split(",")
    unknown = [f for f in args.fronts if f not in ROUTER_POLICIES and f not in PEERS]
    if unknown:
        parser.error(f"unknown fronts {unknown}: choose from {', '.join((*ROUTER_POLICIES, *PEERS))}")
    return args


def main() -> None:
    args = parse_args()
    if args.added or any(front in PEERS for front in args.fronts):
        ensure_sglang_router()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache between fronts
    out = Path(args.out) if args.out else None
    if out is not None:
        out.write_text(f"`python scripts/bench_gateway.py {' '.join(sys.argv[1:])}`\n\n")
    for line in HEADER if not args.added else ():
        emit(line, out)
    server = {"worker_nice": args.vllm_worker_nice, "spin_s": args.vllm_spin_s}
    work = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="bench-gateway-")
    with work as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        model_dir = Path(tmp) / "model"
        subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_llama", str(model_dir),
                        "--max-position", "2048", "--hidden-size", str(args.hidden_size), "--layers", str(args.layers),
                        "--intermediate-size", str(2 * args.hidden_size)], check=True, capture_output=True)
        if args.added:
            added_latency(args.added, model_dir, Path(tmp), out, server, args.against)
            return
        ran = [(shape.name, run_shape(shape, args.fronts, args.repeat, model_dir, Path(tmp), out, args.warm_up,
                                      server, args.warm_up_arm, args.pin_servers)) for shape in args.shapes]
    difference_table(ran, out)
    emit("", out)
    for shape in args.shapes:
        emit(f"- {shape.name}: {shape.describe()}", out)
    emit(f"- model: random Llama, hidden {args.hidden_size}, {args.layers} layers, intermediate "
         f"{2 * args.hidden_size}, vocabulary 384", out)
    emit(f"- load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", out)


if __name__ == "__main__":
    main()
