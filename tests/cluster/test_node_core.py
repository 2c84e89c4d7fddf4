"""The node core our worker and the vLLM pool share (prefixpool/node/core.py), on a real etcd and real sockets.

    A: joins with blocks committed and an SSD directory from an earlier run -> its record, every
       device block and every SSD block are in etcd under its lease (etcdctl, not our client, says so)
    B: fetches from the transfer URL in A's record -> B's blocks appear in etcd under B
    A: a block written to its SSD tier later is published by the collection task, as "disk"
    A: leave() -> its record and every block key are gone at once; B's stay; close() ends both
"""

from __future__ import annotations

import asyncio

import msgspec

from prefixpool.meta.membership import NodeRecord, decode_record
from prefixpool.node.blocks import TierSizes, node_blocks
from prefixpool.node.core import NodeConfig, NodeCore
from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.tier_names import DEVICE, DISK
from tests.conftest import etcdctl_get_prefix
from tests.support.blocks import commit_random
from tests.support.waiting import until

NAMESPACE = Namespace("node-core", block_size=4)
KEYS = chain_ids(range(8), NAMESPACE)
SHAPE = ArenaShape(8, 2, 4, 2, 8)
HANG_GUARD_S = 60.0


def record(node_id: str) -> NodeRecord:
    return NodeRecord(node_id, "", "", NAMESPACE.block_size, SHAPE.num_blocks, NAMESPACE.model, kind="test")


def blocks_in_etcd(etcd, ns: str, node_id: str) -> dict[bytes, str]:
    """{key: tier} of the node's blocks, read by etcdctl."""
    _, kvs = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/blocks/")
    suffix = f"/{node_id}".encode()
    return {bytes.fromhex(k.rsplit(b"/", 2)[-2].decode()): v.decode() for k, v in kvs.items() if k.endswith(suffix)}


def test_two_cores_register_fetch_collect_and_leave(etcd, ns, tmp_path):
    async def scenario():
        config = NodeConfig(etcd_endpoints=etcd.endpoint, cluster=ns, collect_s=0.05)
        arena_a = KVArena(SHAPE)
        earlier = DiskTier(tmp_path / "a", arena_a.block_bytes, 8)  # what an earlier run left on A's SSD
        earlier.put(KEYS[6], bytes(arena_a.block_bytes))
        earlier.close()
        blocks_a = node_blocks(arena_a, TierSizes(disk_blocks=8, disk_dir=str(tmp_path / "a")))
        commit_random(blocks_a, arena_a, KEYS[:4])
        a = await NodeCore.open(blocks_a, arena_a, config, record("a"))
        assert await a.join() == [KEYS[6]]
        arena_b = KVArena(SHAPE)
        b = await NodeCore.open(node_blocks(arena_b), arena_b, config, record("b"))
        await b.join()
        try:
            _, nodes = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/nodes/")
            registered = decode_record(nodes[f"/prefixpool/{ns}/nodes/a".encode()])
            assert registered == a.record and registered.transfer_url.startswith("tcp://127.0.0.1:")
            assert blocks_in_etcd(etcd, ns, "a") == {**{key: DEVICE for key in KEYS[:4]}, KEYS[6]: DISK}

            fetched = await b.exchange.fetch(registered.transfer_url, KEYS, deadline_s=HANG_GUARD_S)
            assert fetched.num_blocks == 4  # the longest prefix A holds: KEYS[4] is nowhere
            b.blocks.release(fetched.hold)
            await until(lambda: blocks_in_etcd(etcd, ns, "b") == {key: DEVICE for key in KEYS[:4]}, "B's blocks")
            assert [bytes(arena_b.read_bytes(b.blocks.lookup(k))) for k in KEYS[:4]] == \
                   [bytes(arena_a.read_bytes(blocks_a.lookup(k))) for k in KEYS[:4]]

            blocks_a.tiers.disk.put(KEYS[7], bytes(arena_a.block_bytes))  # written later, collected by the core
            await until(lambda: blocks_in_etcd(etcd, ns, "a").get(KEYS[7]) == DISK, "A's collected SSD block")

            await a.leave()
            _, nodes = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/nodes/")
            assert sorted(nodes) == [f"/prefixpool/{ns}/nodes/b".encode()]
            assert blocks_in_etcd(etcd, ns, "a") == {}
            assert blocks_in_etcd(etcd, ns, "b") == {key: DEVICE for key in KEYS[:4]}
        finally:
            await a.close()
            await b.close()
        assert etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/")[1] == {}  # b's lease revoked on close
        for blocks in (blocks_a, b.blocks):
            blocks.check_integrity()
            assert sum(blocks.pool.ref_count) == 0

    asyncio.run(scenario())


def test_the_advertised_host_is_what_peers_are_told(etcd, ns):
    async def scenario():
        config = NodeConfig(etcd_endpoints=etcd.endpoint, cluster=ns,
                            advertise_host="node.example")
        arena = KVArena(SHAPE)
        core = await NodeCore.open(node_blocks(arena), arena, config, record("adv"))
        try:
            bound_port = core.server.url.rsplit(":", 1)[1]
            assert core.record.transfer_url == f"tcp://node.example:{bound_port}"
            assert msgspec.structs.replace(core.record, transfer_url="") == record("adv")
        finally:
            await core.close()

    asyncio.run(scenario())
