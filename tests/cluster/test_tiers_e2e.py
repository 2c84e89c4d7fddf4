"""Tiers end to end: real etcd, a real router and a worker process with a small device pool over
host memory and an SSD directory, so a handful of prompts demotes blocks.

Every reuse is checked against a cold recompute (a fresh cache_salt is the oracle), and the
router's /v1/route shows in which tier it found the prefix."""

import json
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.model.config import preset
from prefixpool.deploy.processes import python_argv
from prefixpool.model.source import cache_namespace
from prefixpool.store.keys import chain

BLOCK = 16
PROMPT_BLOCKS = 9  # 150-byte prompts: 9 full blocks, 10 with the generated tokens
WORKER = "worker-0"
WORKER_ARGS = ("--lease-ttl-s", "3", "--num-blocks", "32", "--max-batch-size", "4", "--host-tier-blocks", "24",
               "--disk-tier-blocks", "512", "--disk-queue-blocks", "1024")


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ssd")


@pytest.fixture(scope="module")
def cluster(disk_dir):
    with LocalCluster(num_workers=1, worker_args=(*WORKER_ARGS, "--disk-tier-dir", str(disk_dir))) as running:
        wait_for(lambda: workers(running.router_url) == 1, "the worker to register")
        yield running


def call(url: str, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def workers(url: str) -> int:
    return call(url, "/healthz")[1]["workers"]


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def prompt(tag: str) -> str:
    return (f"[{tag}] " + "The tiered pool keeps evicted KV in host memory and on disk. " * 3)[:150]


def complete(url: str, text: str, salt: str) -> tuple[str, int]:
    status, body = call(url, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 4,
                                                 "temperature": 0, "cache_salt": salt})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def route(url: str, text: str, salt: str) -> dict:
    status, body = call(url, "/v1/route", {"model": "tiny", "prompt": text, "max_tokens": 4, "cache_salt": salt})
    assert status == 200, body
    return body


def lower_tiers(url: str, text: str, salt: str) -> dict:
    return route(url, text, salt)["lower_tiers"].get(WORKER, {})


def flush(url: str, tag: str, count: int) -> None:
    for i in range(count):
        complete(url, prompt(f"{tag}-{i}"), f"{tag}-{i}")


def cold(url: str, text: str) -> str:
    output, cached = complete(url, text, f"oracle-{time.monotonic_ns()}")
    assert cached == 0
    return output


def keys_of(text: str, salt: str):
    namespace = cache_namespace(preset("tiny"), "float32", BLOCK).with_salt(salt)
    return chain(list(text.encode()), namespace)


def test_prefix_promoted_from_host_equals_recompute(cluster):
    url, text = cluster.router_url, prompt("host")
    first, cached = complete(url, text, "s-host")
    assert cached == 0
    flush(url, "flush-host", 4)
    wait_for(lambda: lower_tiers(url, text, "s-host") == {"host": PROMPT_BLOCKS}, "the prefix to be demoted to host")
    terms = route(url, text, "s-host")["candidates"][0]
    assert terms["local_blocks"] == PROMPT_BLOCKS and terms["tier_read_s"] > 0
    again, cached = complete(url, text, "s-host")
    assert cached == PROMPT_BLOCKS * BLOCK
    assert again == first == cold(url, text)


def test_prefix_promoted_from_ssd_equals_recompute(cluster):
    url, text = cluster.router_url, prompt("ssd")
    first, _ = complete(url, text, "s-ssd")
    flush(url, "flush-ssd", 8)
    wait_for(lambda: lower_tiers(url, text, "s-ssd") == {"disk": PROMPT_BLOCKS}, "the prefix to reach the SSD")
    again, cached = complete(url, text, "s-ssd")
    assert cached == PROMPT_BLOCKS * BLOCK
    assert again == first == cold(url, text)


def test_restart_with_warm_ssd_republishes_and_hits(cluster, disk_dir):
    url, text = cluster.router_url, prompt("restart")
    first, _ = complete(url, text, "s-restart")
    flush(url, "flush-restart", 8)
    wait_for(lambda: lower_tiers(url, text, "s-restart") == {"disk": PROMPT_BLOCKS}, "the prefix to reach the SSD")
    cluster.workers[WORKER].stop()
    wait_for(lambda: workers(url) == 0 and not route_matches(url, text, "s-restart"), "the node's blocks to vanish")
    cluster.start_worker(WORKER)
    wait_for(lambda: lower_tiers(url, text, "s-restart") == {"disk": PROMPT_BLOCKS},
             "the SSD blocks to be re-published")
    again, cached = complete(url, text, "s-restart")
    assert cached == PROMPT_BLOCKS * BLOCK and again == first


def route_matches(url: str, text: str, salt: str) -> dict:
    if workers(url) == 0:
        return {}
    return route(url, text, salt)["matches"]


def test_truncated_ssd_block_is_recomputed(cluster, disk_dir):
    url, text = cluster.router_url, prompt("truncate")
    first, _ = complete(url, text, "s-truncate")
    flush(url, "flush-truncate", 8)
    wait_for(lambda: lower_tiers(url, text, "s-truncate") == {"disk": PROMPT_BLOCKS}, "the prefix to reach the SSD")
    path = disk_dir / f"{keys_of(text, 's-truncate')[3].hex()}.blk"
    path.write_bytes(path.read_bytes()[:100])
    again, cached = complete(url, text, "s-truncate")
    assert cached == 3 * BLOCK, "blocks 0..2 promoted; the truncated block 3 and the rest recomputed"
    assert again == first
    assert not path.exists(), "the bad file is deleted"


def test_admin_pin_survives_an_eviction_storm(cluster):
    url, text = cluster.router_url, prompt("pinned")
    complete(url, text, "s-pin")
    status, reply = call(url, "/v1/admin/pin", {"text": text, "ttl_s": 120, "cache_salt": "s-pin"})
    assert status == 200 and reply["num_blocks"] == PROMPT_BLOCKS
    assert reply["workers"][WORKER]["num_held"] == PROMPT_BLOCKS
    flush(url, "storm", 10)
    assert route(url, text, "s-pin")["matches"][WORKER] == PROMPT_BLOCKS
    assert lower_tiers(url, text, "s-pin") == {}, "still in device blocks"
    _, cached = complete(url, text, "s-pin")
    assert cached == PROMPT_BLOCKS * BLOCK
    unpin = subprocess.run(python_argv("pin", "--router", url, "--text", text, "--cache-salt", "s-pin", "--unpin"),
                           capture_output=True, text=True, timeout=60)
    assert unpin.returncode == 0, unpin.stderr
    assert json.loads(unpin.stdout)["workers"][WORKER]["unpinned"] is True
    status, reply = call(url, "/v1/admin/pin", {"text": text, "cache_salt": "s-pin"}, method="DELETE")
    assert status == 200 and reply["workers"][WORKER]["unpinned"] is False, "already released"
    status, reply = call(url, "/v1/admin/pin", {"text": "short", "cache_salt": "s-pin"})
    assert status == 400


def test_min_residency_under_pressure_recomputes_or_refuses_clearly(cluster):
    """A worker whose pool is all resident makes requests wait (then recompute); pins that leave no room refuse."""
    url = cluster.router_url
    cluster.workers[WORKER].stop()
    cluster.worker_args = ("--lease-ttl-s", "3", "--num-blocks", "24", "--min-residency-s", "2")
    cluster.start_worker("worker-res")
    wait_for(lambda: workers(url) == 1, "the residency worker to register")
    outputs = [complete(url, prompt(f"res-{i}"), f"res-{i}") for i in range(4)]
    assert all(cached == 0 for _, cached in outputs)
    for i in (2, 3):  # the two still cached: 18 of 24 blocks pinned, a new prompt needs 10
        status, reply = call(url, "/v1/admin/pin", {"text": prompt(f"res-{i}"), "ttl_s": 60, "cache_salt": f"res-{i}"})
        assert status == 200 and reply["workers"]["worker-res"]["num_held"] == PROMPT_BLOCKS
    status, body = call(url, "/v1/completions", {"model": "tiny", "prompt": prompt("res-new"), "max_tokens": 4,
                                                 "temperature": 0, "cache_salt": "res-new"})
    assert status == 503 and "pinned" in body["error"]["message"]
