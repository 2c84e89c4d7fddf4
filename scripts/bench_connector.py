"""TTFT of a 2k-token prompt on a vLLM server: cold, its own prefix cache, loaded from a peer through
prefixpool, loaded from local disk through vLLM's ExampleConnector. One run, one table.

    python scripts/bench_connector.py [--reps 3] [--prefix-tokens 2048] [--out benchmarks/connector.md]

The model is a random-weight Llama big enough that prefill costs real time on
a CPU (8 layers, hidden 1024, 8 heads, 2 KV heads; made on the spot, no
download). TTFT is the latency of a max_tokens=1 completion, measured at the
client. Rows, each the median over --reps prompts never seen before:
  cold                 plain vLLM (no connector), a prompt it has never seen
  own prefix cache     plain vLLM, the same prompt again
  prefixpool, cold     B with PrefixPoolConnector, a prompt nobody holds (includes saving it to the pool)
  prefixpool, peer     B loads the prompt's blocks from A's pool (A computed it) through etcd + TCP, in the
                       background (vLLM's WAITING_FOR_REMOTE_KVS; the default)
  ..., engine thread   C (async_load off) loads the same blocks from a peer before its forward pass
  ExampleConnector     vLLM's file connector (prefix caching off), the same prompt again: from local disk
Servers run two or three at a time (plain + file connector, then A + B + C), to fit the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.vllm_connector.config import kv_transfer_json
from prefixpool.deploy.vllm_server import DEFAULT_PYTHON, VllmConfig, VllmServer

REPO = Path(__file__).resolve().parent.parent

MODEL = "bench-llama"
BLOCK = 32
SIZE = ["--hidden-size", "1024", "--intermediate-size", "2816", "--layers", "8", "--heads", "8", "--kv-heads", "2"]
WORDS = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. "


def ttft_ms(url: str, prompt: str, salt: str = "") -> tuple[float, int, int]:
    """(ms, cached tokens, prompt tokens) of one max_tokens=1 completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        usage = json.loads(reply.read())["usage"]
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), usage["prompt_tokens"]


def prompt_of(case: str, num_tokens: int) -> str:
    return f"Case {case}. " + WORDS * (num_tokens // 36 + 1)  # about 36 tokens per sentence with this tokenizer


def vllm(model: Path, extra_args: tuple[str, ...] = (), kv: str = "") -> VllmConfig:
    """One prefill step for the whole prompt everywhere: ExampleConnector cannot save a chunked prefill
    (it stores the first 2048-token chunk under the whole prompt's name, and the load then fails)."""
    return VllmConfig(str(model), MODEL, BLOCK, max_model_len=4096, num_blocks=200,
                      kv_transfer_config=kv, extra_args=("--max-num-batched-tokens", "4096", *extra_args))


def start(configs: dict[str, VllmConfig], run_dir: Path) -> dict[str, VllmServer]:
    servers = {name: VllmServer.launch(config, run_dir, name, vllm_temp_dir()) for name, config in configs.items()}
    for server in servers.values():
        server.wait_healthy(1200)
    for server in servers.values():
        ttft_ms(server.url, "warm up " * 8)
    return servers


async def wait_pool_blocks(endpoint: str, cluster: str, node: str, num: int, timeout_s: float = 120.0) -> None:
    etcd = EtcdClient(endpoint)
    deadline = time.monotonic() + timeout_s
    suffix = f"/{node}.pool".encode()
    while time.monotonic() < deadline:
        kvs = (await etcd.get_prefix(Layout(cluster).blocks_prefix)).kvs
        if sum(1 for kv in kvs if kv.key.endswith(suffix)) >= num:
            break
        await asyncio.sleep(0.2)
    await etcd.close()
    await asyncio.sleep(1.0)  # B's mirror follows the same watch


def phase_local(model: Path, run_dir: Path, args) -> dict[str, list]:
    rows: dict[str, list] = {"cold": [], "own prefix cache": [], "ExampleConnector (local disk)": []}
    file_kv = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"shared_storage_path": str(run_dir / "example-kv")}})
    servers = start({"plain": vllm(model), "file": vllm(model, ("--no-enable-prefix-caching",), file_kv)}, run_dir)
    try:
        for rep in range(args.reps):
            text = prompt_of(f"local-{rep}", args.prefix_tokens)
            rows["cold"].append(ttft_ms(servers["plain"].url, text))
            rows["own prefix cache"].append(ttft_ms(servers["plain"].url, text))
            ttft_ms(servers["file"].url, text)  # computes and writes the files
            rows["ExampleConnector (local disk)"].append(ttft_ms(servers["file"].url, text))
    finally:
        for server in servers.values():
            server.stop()
    return rows


def phase_pool(model: Path, run_dir: Path, etcd: EtcdServer, args) -> dict[str, list]:
    rows: dict[str, list] = {"prefixpool, cold (saving)": [], "prefixpool, from peer A": [],
                             "prefixpool, from a peer, engine thread": []}
    cluster = "b" + uuid.uuid4().hex[:8]
    configs = {name: vllm(model, kv=kv_transfer_json({"etcd_endpoints": etcd.endpoint, "cluster": cluster,
                                                      "node_id": name, "pool_blocks": 256,
                                                      "async_load": name != "c"}))
               for name in ("a", "b", "c")}
    servers = start(configs, run_dir)
    try:
        for rep in range(args.reps):
            text = prompt_of(f"pool-{rep}", args.prefix_tokens)
            rows["prefixpool, cold (saving)"].append(ttft_ms(servers["b"].url, text, salt=f"cold-{rep}"))
            _, _, num_tokens = ttft_ms(servers["a"].url, text)
            asyncio.run(wait_pool_blocks(etcd.endpoint, cluster, "a", (rep + 1) * ((num_tokens - 1) // BLOCK)))
            rows["prefixpool, from peer A"].append(ttft_ms(servers["b"].url, text))
            rows["prefixpool, from a peer, engine thread"].append(ttft_ms(servers["c"].url, text))
    finally:
        for server in servers.values():
            server.stop()
    return rows


def table(rows: dict[str, list]) -> str:
    cold = statistics.median(ms for ms, _, _ in rows["cold"])
    lines = ["| TTFT of a ~2k-token prompt | median ms | × cold | runs (ms) | cached / prompt tokens |",
             "|---|---:|---:|---|---:|"]
    for name, runs in rows.items():
        median = statistics.median(ms for ms, _, _ in runs)
        each = ", ".join(f"{ms:.0f}" for ms, _, _ in runs)
        lines.append(f"| {name} | {median:.0f} | {median / cold:.2f} | {each} | {runs[0][1]} / {runs[0][2]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-connector-") as tmp, EtcdServer() as etcd:
        run_dir, model = Path(tmp), Path(tmp) / "model"
        subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_llama", str(model), *SIZE],
                       check=True, capture_output=True, timeout=600)
        load_before = os.getloadavg()
        try:
            rows = {**phase_local(model, run_dir, args), **phase_pool(model, run_dir, etcd, args)}
        except Exception:
            for log in sorted(run_dir.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        load_after = os.getloadavg()
    report = (f"{table(rows)}\n\nload average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
              f"(1 min; 2 shared cores)")
    print(report)
    if args.out:
        command = "python scripts/bench_connector.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"# vLLM KV connector: TTFT side by side\n\n`{command}`\n\n{report}\n")


if __name__ == "__main__":
    main()
