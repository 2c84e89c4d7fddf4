"""Ray deployment on a local Ray cluster: 2 worker actors, a prefill and a decode worker actor (prefill/decode
disaggregation, `ray up --prefill 1 --decode 1`), a router actor, etcd as an actor.

A request hits the cache; the prefill and decode actors register their roles and the router pairs
them for a long prompt, answering as a cold recompute; a worker actor is killed, Ray restarts it, it
re-registers in etcd, and the cluster keeps serving the same output as a cold recompute. The actors
run with a private TMPDIR, which must be empty after `down`.
"""

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from prefixpool.deploy import ray_deploy
from prefixpool.deploy.etcd_server import free_port
from tests.conftest import etcdctl_get_prefix

PROMPT = "Ray deployment check. " * 20
NUM_WORKERS = 4  # worker-0, worker-1, worker-prefill-0, worker-decode-0


def ask(url: str, prompt: str, salt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_salt": salt}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def workers_seen(url: str) -> int:
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as reply:
        return json.load(reply)["workers"]


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def deployment():
    """The Ray cluster and every actor see a private TMPDIR, so "nothing left behind" is checked exactly."""
    # short: Ray's socket paths
    tmp, ray_dir = tempfile.mkdtemp(prefix="pp-ray-tmp-"), tempfile.mkdtemp(prefix="pp-ray-")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    with private_tmpdir(tmp):  # the raylet, and through it every actor, inherits it
        ray.init(num_cpus=4, include_dashboard=False, namespace=ray_deploy.NAMESPACE, log_to_driver=False,
                 _temp_dir=ray_dir)
    try:
        deployed = ray_deploy.up(2, router_port=0, etcd_port=free_port(), num_prefill=1, num_decode=1,
                                 env={"PREFIXPOOL_LEASE_TTL_S": "3", "PREFIXPOOL_NUM_BLOCKS": "512"})
        wait_for(lambda: workers_seen(deployed.router_url) == NUM_WORKERS)
        yield deployed
    finally:
        removed = ray_deploy.down()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert {"router", "etcd", "worker-0", "worker-1", "worker-prefill-0", "worker-decode-0"} <= set(removed)
    assert not Path(tempfile.gettempdir(), f"prefixpool-ray-etcd-{deployed.etcd_endpoints.rsplit(':', 1)[1]}").exists()
    # actors killed by ray.kill (Ray SIGKILLs an exiting actor's children) or by a SIGKILLed
    # supervisor, and `down`, leave no log dir: their janitors are nobody's children
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not os.listdir(tmp), timeout_s=30)
    left = sorted(os.listdir(tmp))
    shutil.rmtree(tmp, ignore_errors=True)  # also when the check below fails
    assert left == []


@contextlib.contextmanager
def private_tmpdir(path: str):
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old


def test_cache_hit_through_ray(deployment):
    first = ask(deployment.router_url, PROMPT, "ray")
    again = ask(deployment.router_url, PROMPT + "again", "ray")
    # cached_tokens: what the node that streams did not compute. The first may have been disaggregated (then
    # it counts the blocks its decode node received); the repeat reuses at least that, and never nothing.
    first_cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= max(first_cached, 1)


def test_prefill_and_decode_actors_register_their_roles_and_the_router_pairs_them(deployment):
    server = type("Endpoint", (), {"client_url": f"http://{deployment.etcd_endpoints}"})()
    _, kvs = etcdctl_get_prefix(server, "/prefixpool/default/nodes/")
    roles = {json.loads(v)["node_id"]: json.loads(v)["role"] for v in kvs.values()}
    assert roles == {"worker-0": "both", "worker-1": "both", "worker-prefill-0": "prefill",
                     "worker-decode-0": "decode"}
    long_prompt = "Disaggregated through Ray. " * 60
    body = json.dumps({"model": "tiny", "prompt": long_prompt, "cache_salt": "ray-pd"}).encode()
    request = urllib.request.Request(f"{deployment.router_url}/v1/route", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        plan = json.load(reply)
    assert plan["prefill"]["node"] == "worker-prefill-0" and plan["decode"]["node"] == "worker-decode-0", plan
    answer = ask(deployment.router_url, long_prompt, "ray-pd")
    assert answer["choices"][0]["text"] == ask(deployment.router_url, long_prompt, "ray-pd-cold")["choices"][0]["text"]


def test_killed_worker_actor_restarts_and_serving_stays_correct(deployment):
    actor = ray_deploy.get_actor("worker-1")
    old_pid = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    answers = [ask(deployment.router_url, f"{PROMPT} after kill {i}", "ray-kill") for i in range(3)]
    cold = [ask(deployment.router_url, f"{PROMPT} after kill {i}", f"ray-cold-{i}") for i in range(3)]
    assert [a["choices"][0]["text"] for a in answers] == [c["choices"][0]["text"] for c in cold]
    wait_for(lambda: _restarted(actor, old_pid), timeout_s=90)
    wait_for(lambda: workers_seen(deployment.router_url) == NUM_WORKERS)
    # the old worker process dies with its actor (Ray reaps it a moment later on a loaded machine)
    wait_for(lambda: not _alive(old_pid), timeout_s=60)


def _restarted(actor, old_pid: int) -> bool:
    try:
        return ray.get(actor.pid.remote(), timeout=5) != old_pid
    except ray.exceptions.RayError:
        return False


def test_sigkilled_supervisor_leaves_no_process_and_no_temp_dir(deployment):
    actor = ray_deploy.get_actor("worker-0")
    supervisor, child, log_dir = ray.get([actor.supervisor_pid.remote(), actor.pid.remote(), actor.log_path.remote()])
    assert Path(log_dir).is_dir()
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not _alive(child) and not Path(log_dir).exists(), timeout_s=60)
    wait_for(lambda: _restarted(actor, child), timeout_s=90)
    wait_for(lambda: workers_seen(deployment.router_url) == NUM_WORKERS)


def test_restarted_etcd_actor_keeps_its_endpoint_and_data(deployment):
    actor = ray_deploy.get_actor("etcd")
    old_pid = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    wait_for(lambda: _restarted(actor, old_pid), timeout_s=90)
    assert ray.get(actor.url.remote()) == deployment.etcd_endpoints
    server = type("Endpoint", (), {"client_url": f"http://{deployment.etcd_endpoints}"})()
    _, kvs = etcdctl_get_prefix(server, "/prefixpool/default/nodes/")
    assert len(kvs) == NUM_WORKERS  # the data dir survived: the workers' records (and leases) are still there
    answer = ask(deployment.router_url, PROMPT + " after etcd restart", "ray-etcd")
    cold = ask(deployment.router_url, PROMPT + " after etcd restart", "ray-etcd-cold")
    assert answer["choices"][0]["text"] == cold["choices"][0]["text"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
