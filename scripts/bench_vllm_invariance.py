"""Does a prefix loaded through PrefixPoolConnector give vLLM the same answer as computing it cold?
Text and per-token logprobs, per dtype, with vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) off and on.

    python scripts/bench_vllm_invariance.py [--prompts 6] [--prefix-tokens 700] [--max-tokens 16]
                                            [--dtypes float32,bfloat16] [--modes off,on]

Per (mode, dtype): etcd (one for the run), two real vLLM servers A and B with
the connector, started side by side with VLLM_BATCH_INVARIANT set or unset in
their environment. Per prompt (distinct from its first token on): A computes it
(its pool saves the blocks), B is asked it and loads every full block from A's
pool (etcd + TCP), then B is asked it under a fresh cache_salt, a namespace
nobody holds, so B recomputes every block: the cold oracle, on the same server.
Both greedy, `max_tokens` tokens, `logprobs: 1` (vLLM's raw logprobs of the
sampled tokens). A row counts prompts whose text, and whose token_logprobs, are
bit-equal between B loaded and B cold; max |diff| is over the positions where both
answers still had the same tokens up to and including that position. The control
"loaded = A's own cache": A asked the prompt again (a hit in vLLM's own prefix
cache, the KV bits A computed, the same cached length) against B's loaded answer,
bit for bit: equal means the connector moved the KV exactly, and any cached-vs-cold
difference is vLLM's numerics (a suffix computed alone vs the whole prompt in one
step), not the pool. "loaded" is B's cached tokens over all prompts (every full
block came from A) over prompt tokens. A configuration that fails (at start, or on
the first request) is a row with the root cause from the servers' logs.

The model is a random-weight Llama made on the spot (prefixpool.testing.tiny_llama,
no download): hidden 1024, 4 layers, 8 heads, 2 KV heads by default
(issue 28's CPU shape); --tiny for the test suite's hidden-128, 2-layer model.
Two servers at a time; every server is stopped by pid, the temp dir removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.deploy.vllm_server import DEFAULT_PYTHON, VllmConfig, VllmFailed, VllmServer
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.vllm_connector.config import kv_transfer_json

MODEL = "bench-invariance"
BLOCK = 32
SIZE = ["--hidden-size", "1024", "--intermediate-size", "2816", "--layers", "4", "--heads", "8", "--kv-heads", "2"]
WORDS = ["The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire.",
         "Prefix caching keeps the key and value tensors of shared prompt blocks for later requests.",
         "A router sends each request to the server that already holds the longest cached prefix.",
         "You are a careful assistant. Answer in one short sentence, using plain words only."]
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Row:
    mode: str
    dtype: str
    prompts: int = 0
    same_text: int = 0
    same_logprobs: int = 0
    max_diff: float = 0.0
    loaded: int = 0
    prompt_tokens: int = 0
    first_diff: list[int] = field(default_factory=list)  # first differing token position, per differing prompt
    same_as_own_cache: int = 0  # B's loaded answer bit-equal (text, logprobs) to A's own prefix-cache hit
    error: str = ""


def prompt_of(index: int, num_tokens: int) -> str:
    sentences = [WORDS[(index + i) % len(WORDS)] for i in range(num_tokens // 36 + 1)]  # ~36 tokens a sentence
    return f"Case {index} of the invariance bench. " + " ".join(sentences)


def complete(url: str, prompt: str, max_tokens: int, salt: str = "") -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"HTTP {err.code}: {err.read()[:500].decode(errors='replace')}") from None


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def answer_of(response: dict) -> tuple[str, list[str], list[float]]:
    choice = response["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


def compare(row: Row, loaded: dict, cold: dict, own_cache: dict) -> None:
    a, b = loaded["choices"][0], cold["choices"][0]
    tokens_a, tokens_b = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
    values_a, values_b = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
    row.prompts += 1
    row.same_as_own_cache += answer_of(loaded) == answer_of(own_cache)
    row.same_text += a["text"] == b["text"]
    row.same_logprobs += tokens_a == tokens_b and values_a == values_b
    for position, (ta, tb, va, vb) in enumerate(zip(tokens_a, tokens_b, values_a, values_b)):
        row.max_diff = max(row.max_diff, abs(va - vb))
        if ta != tb:
            row.first_diff.append(position)
            break


def error_line(text: str) -> str:
    """The root cause in a vLLM log or an exception: the first `SomethingError: message` line
    (log prefixes stripped), else the last line naming an error."""
    lines = [re.sub(r"^\(\S+ pid=\d+\) \w+ \S+ \S+ \[[^\]]*\] ", "", line).strip() for line in text.splitlines()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    if causes:
        return causes[0][:300]
    named = [line for line in lines if re.search(r"Error|Exception", line)]
    return (named[-1] if named else next((line for line in reversed(lines) if line), "unknown"))[:300]


def wait_pool_blocks(endpoint: str, cluster: str, node: str, num: int, timeout_s: float = 120.0) -> None:
    import asyncio

    async def wait() -> None:
        etcd = EtcdClient(endpoint)
        try:
            deadline = time.monotonic() + timeout_s
            suffix = f"/{node}.pool".encode()
            while time.monotonic() < deadline:
                kvs = (await etcd.get_prefix(Layout(cluster).blocks_prefix)).kvs
                if sum(1 for kv in kvs if kv.key.endswith(suffix)) >= num:
                    break
                await asyncio.sleep(0.2)
        finally:
            await etcd.close()
        await asyncio.sleep(1.0)  # B's etcd mirror follows the same watch

    asyncio.run(wait())


def run_config(model: Path, run_dir: Path, etcd: EtcdServer, mode: str, dtype: str, args) -> Row:
    row = Row(mode, dtype)
    cluster = "inv" + uuid.uuid4().hex[:8]
    env_before = os.environ.get("VLLM_BATCH_INVARIANT")
    if mode == "on":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    else:
        os.environ.pop("VLLM_BATCH_INVARIANT", None)
    servers: dict[str, VllmServer] = {}
    try:
        for name in ("a", "b"):
            kv = kv_transfer_json({"etcd_endpoints": etcd.endpoint, "cluster": cluster, "node_id": name,
                                   "pool_blocks": 512, "fetch_timeout_s": 60.0, "lease_ttl_s": 60})
            config = VllmConfig(str(model), MODEL, BLOCK, dtype=dtype, max_model_len=2048, num_blocks=96,
                                kv_transfer_config=kv)
            servers[name] = VllmServer.launch(config, run_dir, f"{mode}-{dtype}-{name}", vllm_temp_dir())
        for server in servers.values():
            server.wait_healthy(START_TIMEOUT_S)
        held = 0
        for index in range(args.prompts):
            text = prompt_of(index, args.prefix_tokens)
            first = complete(servers["a"].url, text, args.max_tokens)
            held += (first["usage"]["prompt_tokens"] - 1) // BLOCK
            wait_pool_blocks(etcd.endpoint, cluster, "a", held)
            own_cache = complete(servers["a"].url, text, args.max_tokens)  # A's own prefix cache: the same KV bits
            loaded = complete(servers["b"].url, text, args.max_tokens)
            cold = complete(servers["b"].url, text, args.max_tokens, salt=f"cold-{uuid.uuid4().hex}")
            if cached(cold) != 0:
                raise RuntimeError(f"the cold answer had {cached(cold)} cached tokens")
            row.loaded += cached(loaded)
            row.prompt_tokens += loaded["usage"]["prompt_tokens"]
            compare(row, loaded, cold, own_cache)
    except VllmFailed as err:
        row.error = "start: " + error_line(str(err))
    except (RuntimeError, OSError, KeyError, TypeError) as err:
        logs = "".join(s.log_path.read_text(errors="replace") for s in servers.values())
        row.error = f"request ({error_line(str(err))[:60]}): {error_line(logs)}"
    finally:
        for server in servers.values():
            server.stop()
        if env_before is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = env_before
    return row


def table(rows: list[Row]) -> str:
    lines = ["| VLLM_BATCH_INVARIANT | dtype | identical text | identical logprobs | max \\|diff\\| | "
             "first differing token | loaded = A's own cache | loaded / prompt tokens |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        mode = "1" if row.mode == "on" else "unset"
        if row.error:
            lines.append(f"| {mode} | {row.dtype} | - | - | - | failed: `{row.error}` | - | - |")
            continue
        first = ", ".join(map(str, row.first_diff)) or "-"
        lines.append(f"| {mode} | {row.dtype} | {row.same_text} / {row.prompts} | {row.same_logprobs} / {row.prompts} "
                     f"| {row.max_diff:.3g} | {first} | {row.same_as_own_cache} / {row.prompts} "
                     f"| {row.loaded} / {row.prompt_tokens} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--tiny", action="store_true", help="the test suite's hidden-128, 2-layer model")
    args = parser.parse_args()
    if not 1 <= args.prompts <= 50 or not 32 < args.prefix_tokens <= 1800 or not 1 <= args.max_tokens <= 64:
        parser.error("--prompts 1..50, --prefix-tokens 33..1800, --max-tokens 1..64")
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-invariance-") as tmp, EtcdServer() as etcd:
        run_dir, model = Path(tmp), Path(tmp) / "model"
        subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_llama", str(model),
                        *([] if args.tiny else SIZE)], check=True, capture_output=True, timeout=600)
        for mode in args.modes.split(","):
            for dtype in args.dtypes.split(","):
                rows.append(run_config(model, run_dir, etcd, mode, dtype, args))
                print(f"# {mode} {dtype}: done at {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(table(rows))


if __name__ == "__main__":
    main()
