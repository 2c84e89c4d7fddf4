"""Several routers, one fleet: each publishes its in-flight load to etcd under its own lease.

Two Routers in this process, each with its own etcd mirror and load publisher, over a real
etcd in which two nodes registered and one published a shared prefix: requests are decided
and begun (not sent: no worker runs them, so nothing else moves the load). Then real router
processes in front of real workers (tiny preset): one is SIGKILLed mid-load.
"""

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_publisher import LoadPublisher, LoadPublisherConfig
from prefixpool.meta.mirror import Mirror, MirrorConfig
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router.cost_model import CostModel
from prefixpool.meta.fleet_load import decode_load
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import Namespace, chain
from tests.conftest import LocalNode, etcdctl_get_prefix
from tests.cluster.test_etcd_mirror import stop_mirror

WORKER_ARGS = ("--lease-ttl-s", "3", "--num-blocks", "1024", "--max-batch-size", "16")
SHARED = "A long shared system prompt that every request of this test starts with. " * 6
LONG = 1500  # output tokens: a request stays in flight for the whole test
DEADLINE_S = 60.0


def _post(url: str, path: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)


def _wait(condition, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _start_router(cluster: LocalCluster, router_id: str):
    argv = python_argv("router", "--port", "0", "--etcd-endpoints", cluster.etcd.endpoint, "--router-id", router_id,
                       "--lease-ttl-s", "2")
    child = spawn(f"router-{router_id}", argv, cluster.log_dir, cluster.env)
    _wait(lambda: _get(child.url + "/healthz")["workers"] == len(cluster.workers), "the router to see every worker")
    return child


def _open_stream(router_url: str, i: int):
    """A long streamed request; returns once its first chunk (prefill done) arrived."""
    body = {"model": "tiny", "prompt": SHARED + f"question {i}", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(router_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    assert response.readline().startswith(b"data: ")
    return response


def _route(router_url: str) -> dict:
    status, route = _post(router_url, "/v1/route", {"model": "tiny", "prompt": SHARED})
    assert status == 200, route
    return route


def _seen_requests(router_url: str) -> int:
    return sum(load["requests"] for load in _route(router_url)["loads"].values())


BLOCK = 16
NAMESPACE = Namespace("tiny", block_size=BLOCK)
# a fetch of the 128-block prefix costs ~210 ms, a queued 40-token suffix ~40 ms: the holder takes
# about five more than the other worker
COSTS = CostModel(block_size=BLOCK, block_bytes=BLOCK * 1024, prefill_tokens_per_s=1000.0, link_bytes_per_s=1e7)
PREFIX = "p" * (128 * BLOCK)


async def _router(endpoint: str, ns: str, router_id: str, publish: bool):
    mirror = Mirror(EtcdClient(endpoint, timeout_s=2.0), Layout(ns), MirrorConfig(retry_s=0.1))
    await mirror.start()
    config = RouterConfig(model="tiny", namespace=NAMESPACE, max_context=8192, vocab_size=259, router_id=router_id)
    router = Router(config, ByteTokenizer(), mirror, WorkerClient(), COSTS)
    publisher = None
    if publish:
        publisher = LoadPublisher(mirror.client, Layout(ns), router_id, router.inflight, LoadPublisherConfig(ttl_s=5))
        router.inflight.on_change = publisher.changed
        await publisher.start()
    return router, mirror, publisher


async def _put(publisher: LoadPublisher, puts_before: int) -> int:
    """The revision of the publisher's first put after `puts_before` (a change woke it: that put has it)."""
    async with asyncio.timeout(DEADLINE_S):
        while publisher.num_puts == puts_before:
            await asyncio.sleep(0.005)
    return publisher.revision


async def _take_turns(endpoint: str, ns: str, num_routers: int, publish: bool,
                      num_requests: int = 12) -> dict[str, int]:
    """Requests for the shared prefix, in turn through the routers; per worker, how many it was given."""
    parts = [await _router(endpoint, ns, f"r{i}", publish) for i in range(num_routers)]
    counts = {"w0": 0, "w1": 0}
    try:
        async with asyncio.timeout(DEADLINE_S):
            while any(len(mirror.nodes) < 2 or not len(mirror.index) for _, mirror, _ in parts):
                await asyncio.sleep(0.01)
        for i in range(num_requests):
            router, _, publisher = parts[i % num_routers]
            puts_before = publisher.num_puts if publisher is not None else 0
            body = CompletionBody(model="tiny", prompt=PREFIX + f"question number {i:03d}, forty tokens long",
                                  max_tokens=1)
            plan, _ = router.decide(router.prepare(body))
            router.inflight.begin(plan.worker, plan.prefill_tokens)
            counts[plan.worker] += 1
            if publish:  # the next decision, on whichever router, sees this one
                revision = await _put(publisher, puts_before)
                for _, mirror, _ in parts:
                    await mirror.wait_revision(revision)
    finally:
        for _, mirror, publisher in parts:
            if publisher is not None:
                await publisher.stop()
            await stop_mirror(mirror)
    return counts


def test_two_routers_each_taking_half_give_no_worker_more_than_one_router(etcd, ns):
    async def scenario():
        nodes = [await LocalNode(etcd.endpoint, ns, node_id).start() for node_id in ("w0", "w1")]
        try:
            nodes[0].store(chain(list(PREFIX.encode()), NAMESPACE))
            await nodes[0].publisher.flush()
            one = await _take_turns(etcd.endpoint, ns, 1, publish=True)
            two = await _take_turns(etcd.endpoint, ns, 2, publish=True)
            blind = await _take_turns(etcd.endpoint, ns, 2, publish=False)
        finally:
            for node in nodes:
                await node.stop()
        return one, two, blind

    one, two, blind = asyncio.run(scenario())
    assert sum(one.values()) == sum(two.values()) == 12
    assert max(two.values()) <= max(one.values()), (one, two)
    # the control: routers that do not see each other's load pile more onto the prefix holder
    assert max(blind.values()) > max(one.values()), (one, blind)
    assert etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/routers/")[1] == {}  # stopped routers revoked their leases


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, worker_args=WORKER_ARGS,
                      router_args=("--router-id", "a", "--lease-ttl-s", "2")) as running:
        _wait(lambda: _get(running.router_url + "/healthz")["workers"] == 2, "two workers")
        yield running


def _entries(cluster: LocalCluster) -> dict[str, dict]:
    async def read():
        client = EtcdClient(cluster.etcd.endpoint)
        try:
            snapshot = await client.get_prefix(Layout("default").routers_prefix)
        finally:
            await client.close()
        return {decode_load(kv.value).router_id: decode_load(kv.value).workers for kv in snapshot.kvs}
    return asyncio.run(read())


def test_a_killed_router_s_clients_retry_on_the_other_and_its_load_vanishes(cluster):
    second = _start_router(cluster, "c")
    oracle_body = {"model": "tiny", "prompt": SHARED + "the oracle question", "max_tokens": 8, "temperature": 0}
    status, oracle = _post(cluster.router_url, "/v1/completions", oracle_body)
    assert status == 200
    streams = [_open_stream(second.url, i) for i in range(3)]  # the victim's in-flight load
    try:
        # the entry may first show 1 or 2 (coalesced puts while the streams opened); the put with all 3 follows
        _wait(lambda: sum(n for n, _ in _entries(cluster).get("c", {}).values()) == 3, "router c's load of 3 in etcd")
        os.kill(second.pid, signal.SIGKILL)
        answers = []
        for attempt in range(6):  # clients of the dead router retry on the live one
            for url in (second.url, cluster.router_url):
                try:
                    status, reply = _post(url, "/v1/completions", oracle_body, timeout_s=30)
                except (urllib.error.URLError, ConnectionError):
                    continue
                answers.append((status, reply["choices"][0]["text"]))
                break
        assert answers == [(200, oracle["choices"][0]["text"])] * 6
        _wait(lambda: "c" not in _entries(cluster), "router c's entry to vanish with its lease")
        _wait(lambda: _seen_requests(cluster.router_url) == 0, "router a to stop counting router c's load")
    finally:
        for stream in streams:
            stream.close()
        second.stop()


def test_router_processes_share_one_port_and_their_metrics(cluster):
    """`--processes 2`: two processes on one port, each with its own load entry; /metrics counts all requests."""
    argv = python_argv("router", "--port", "0", "--etcd-endpoints", cluster.etcd.endpoint, "--router-id", "multi",
                       "--processes", "2", "--lease-ttl-s", "2")
    parent = spawn("router-multi", argv, cluster.log_dir, cluster.env, timeout_s=240)
    try:
        _wait(lambda: {"multi-0", "multi-1"} <= set(_entries(cluster)), "both processes' load entries")
        body = {"model": "tiny", "prompt": SHARED + "processes", "max_tokens": 2, "temperature": 0}
        texts = {_post(parent.url, "/v1/completions", body)[1]["choices"][0]["text"] for _ in range(12)}
        assert len(texts) == 1  # one answer, whichever process served it
        metrics = urllib.request.urlopen(parent.url + "/metrics", timeout=30).read().decode()
        assert 'prefixpool_requests_total{endpoint="/v1/completions",status="200"} 12.0' in metrics
    finally:
        parent.stop()
    assert not parent.alive()
    _wait(lambda: not {"multi-0", "multi-1"} & set(_entries(cluster)), "the stopped processes' entries to go")
