"""Security basics on a live cluster with a shared worker token and a router API key.

    workers --token T   their internal HTTP API and transfer port refuse peers without T
    router  --api-key K clients without 'Authorization: Bearer K' get a 401 error JSON
    every listening socket of every process we started is on 127.0.0.1 (read from /proc)
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from prefixpool.model.config import arena_shape_for
from prefixpool.model.source import cache_namespace, model_config, tokenizer_for
from prefixpool.contract.worker_api import AUTH_HEADER
from prefixpool.testing.chaos_faults import cluster_for, wait_ready
from prefixpool.testing.chaos_client import ApiClient
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.transfer.errors import Unauthorized
from prefixpool.transfer.fetcher import fetch
from tests.conftest import etcdctl

pytestmark = pytest.mark.timeout(180)
TOKEN, API_KEY = "worker-s3cret", "client-key"
PROMPT = "A shared system prompt that is long enough to fill a few blocks of sixteen tokens each."


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_for(2, token=TOKEN)
    cluster.router_args = cluster.router_args + ("--api-key", API_KEY)
    cluster.start()

    async def ready() -> None:
        client = ApiClient(cluster.router_url, api_key=API_KEY)
        try:
            await wait_ready(client, 2)
            assert (await client.complete(PROMPT)).answered  # some worker now holds PROMPT's blocks
        finally:
            await client.close()
    asyncio.run(ready())
    yield cluster
    cluster.stop()


def call(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_router_requires_the_api_key(cluster):
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, payload = call(cluster.router_url + "/v1/completions", body, headers)
        assert status == 401, (headers, status)
        assert json.loads(payload)["error"]["code"] == "invalid_api_key"
    assert call(cluster.router_url + "/v1/models")[0] == 401
    status, _ = call(cluster.router_url + "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200


def test_worker_api_refuses_peers_without_the_token(cluster):
    url = cluster.workers["worker-0"].url
    generate = json.dumps({"request_id": "x", "tokens": [65, 66], "sampling": {"max_tokens": 1}}).encode()
    for headers in ({}, {AUTH_HEADER: "wrong"}):
        assert call(url + "/generate", generate, headers)[0] == 401
        assert call(url + "/load", None, headers)[0] == 401
        assert call(url + "/debug/pool", None, headers)[0] == 401
    assert call(url + "/generate", generate, {AUTH_HEADER: TOKEN})[0] == 200
    status, payload = call(url + "/debug/pool", None, {AUTH_HEADER: TOKEN})
    assert status == 200 and json.loads(payload)["integrity"] == "ok"


def _transfer_urls(cluster) -> list[str]:
    records = etcdctl(cluster.etcd, "get", "--prefix", "/prefixpool/default/nodes/", "--print-value-only")
    return [json.loads(line)["transfer_url"] for line in records.splitlines() if line.strip()]


def test_transfer_port_refuses_peers_without_the_token(cluster):
    config = model_config("tiny", "")
    keys = chain(tokenizer_for("").encode(PROMPT), cache_namespace(config, "float32", 16))
    urls = _transfer_urls(cluster)
    assert len(urls) == 2

    async def fetch_all(token: str) -> int:
        got = 0
        for url in urls:
            blocks = NodeBlocks(BlockPool(16))
            arena = KVArena(arena_shape_for(config, 16, 16), torch.float32, torch.device("cpu"))
            result = await fetch(url, keys, blocks, arena, deadline_s=10, token=token)
            got += len(result.keys)
            blocks.release(result.hold)
            blocks.check_integrity()
        return got
    for token in ("", "wrong"):
        with pytest.raises(Unauthorized):
            asyncio.run(fetch_all(token))
    assert asyncio.run(fetch_all(TOKEN)) >= len(PROMPT) // 16  # the holder serves the same keys to a peer with T


def test_garbage_on_the_transfer_port_does_not_hurt_the_worker(cluster):
    host, port = _transfer_urls(cluster)[0].removeprefix("tcp://").rsplit(":", 1)
    for junk in (b"\xff" * 64, b"\x10\x00\x00\x00" + b"\x00" * 16, b"\xff\xff\xff\x7f" + b"x" * 100):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.settimeout(5)
            try:
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):  # the server answers or closes; it must not hang
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass  # closed with our junk unread: a refusal too
            except OSError as err:  # closed before our shutdown: ENOTCONN, a refusal too
                if err.errno != errno.ENOTCONN:
                    raise
    status, _ = call(cluster.router_url + "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode(), {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200


def listening_addresses(pid: int) -> list[str]:
    """host:port of every TCP socket `pid` listens on, from /proc/net/tcp{,6} and the pid's fds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.append(f"{_ip(address, width)}:{int(port, 16)}")
    return found


def _ip(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def test_nothing_listens_beyond_loopback(cluster):
    processes = {"etcd": cluster.etcd.pid, "router": cluster.router.pid,
                 **{name: child.pid for name, child in cluster.workers.items()}}
    for name, pid in processes.items():
        addresses = listening_addresses(pid)
        assert addresses, f"{name} listens nowhere?"
        assert all(a.startswith("127.0.0.1:") for a in addresses), (name, addresses)
    for name, child in cluster.workers.items():
        assert len(listening_addresses(child.pid)) >= 2, name  # internal API and transfer port
