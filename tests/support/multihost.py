"""A prefixpool cluster spread over the test-made hosts: etcd, router and workers each in a namespace.

Shared by the multi-host test modules; every process is started through
`Hosts.spawn`, so the hosts fixture stops it by pid even when a test fails.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from prefixpool.deploy.etcd_server import find_binary
from prefixpool.deploy.processes import Child, python_argv
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.contract.worker_api import Done, FetchPlan, GenerateRequest, SamplingParams, Token, decode_event, encode

LONG_S = 120.0
SHARED = "You are a careful assistant. Answer in one short sentence, using plain words only. " * 4


def start_etcd(hosts, host, log_dir: Path) -> str:
    child = hosts.spawn(host, "etcd", python_argv("etcd", "--host", host.address), log_dir)
    return child.url  # host:port


def start_router(hosts, host, etcd: str, log_dir: Path, *extra: str) -> Child:
    return hosts.spawn(host, "router", python_argv("router", "--etcd-endpoints", etcd, "--port", "0", *extra), log_dir)


def start_worker(hosts, host, etcd: str, name: str, log_dir: Path, *extra: str) -> Child:
    argv = python_argv("worker", "--etcd-endpoints", etcd, "--node-id", name, "--num-blocks", "256",
                       "--fetch-timeout-s", "60", *extra)  # generous: first UCX use loads ucxx inside the fetch
    return hosts.spawn(host, name, argv, log_dir)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=LONG_S) as reply:
        return json.load(reply)


def post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=LONG_S) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def wait_until(check, what: str, timeout_s: float = LONG_S, pause_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(pause_s)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_workers(router_url: str, count: int) -> None:
    wait_until(lambda: get_json(f"{router_url}/healthz")["workers"] == count, f"{count} workers at the router")


def complete(router_url: str, prompt: str, salt: str, max_tokens: int = 8) -> dict:
    status, body = post_json(f"{router_url}/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt})
    assert status == 200, body
    return body


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _records(etcd: str, folder: str, cluster: str) -> list[dict]:
    """The JSON values under /prefixpool/<cluster>/<folder>/, as etcdctl (an independent client) reads them."""
    out = subprocess.run([find_binary("etcdctl"), f"--endpoints={etcd}", "get", "--prefix",
                          f"/prefixpool/{cluster}/{folder}/", "--print-value-only"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def node_records(etcd: str, cluster: str = "default") -> dict[str, dict]:
    return {r["node_id"]: r for r in _records(etcd, "nodes", cluster)}


def router_entries(etcd: str, cluster: str = "default") -> dict[str, dict]:
    """Each router's load entry: its advertised URL and its in-flight load."""
    return {r["router_id"]: r for r in _records(etcd, "routers", cluster)}


def block_count(etcd: str, node_id: str, cluster: str = "default") -> int:
    out = subprocess.run([find_binary("etcdctl"), f"--endpoints={etcd}", "get", "--prefix",
                          f"/prefixpool/{cluster}/blocks/", "--keys-only"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return sum(1 for line in out.splitlines() if line.endswith(f"/{node_id}"))


def generate(worker_url: str, prompt: str, salt: str, fetch: dict | None = None,
             max_tokens: int = 8) -> tuple[list[int], dict]:
    """POST a worker's /generate, built with the wire contract's own types (what the router sends)."""
    body = GenerateRequest(request_id=f"t-{time.monotonic_ns()}", tokens=ByteTokenizer().encode(prompt),
                           sampling=SamplingParams(max_tokens=max_tokens), cache_salt=salt,
                           fetch=FetchPlan(**fetch) if fetch else None)
    request = urllib.request.Request(f"{worker_url}/generate", data=encode(body),
                                     headers={"Content-Type": "application/json"})
    tokens, done = [], None
    with urllib.request.urlopen(request, timeout=LONG_S) as reply:
        for line in reply:
            event = decode_event(line)
            if isinstance(event, Token):
                tokens.append(event.token)
            else:
                done = event
    assert isinstance(done, Done), done
    return tokens, msgspec.structs.asdict(done.usage)
