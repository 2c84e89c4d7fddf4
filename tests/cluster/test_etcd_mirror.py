"""The mirror against a real etcd: equal to etcdctl's truth and to a brute-force longest prefix."""

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.mirror import Mirror, MirrorConfig
from prefixpool.store.keys import Namespace, chain_ids
from tests.conftest import LocalNode, etcdctl, etcdctl_get_prefix

NODES = ("n0", "n1", "n2")
CHAINS = [chain_ids(range(c * 100, c * 100 + 6), Namespace("m")) for c in range(3)]
KEYS = [key for chain in CHAINS for key in chain]

op = st.tuples(st.sampled_from(NODES), st.booleans(), st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))


def truth_index(kvs: dict[bytes, bytes], layout: Layout) -> dict[tuple[bytes, str], str]:
    blocks = {}
    for key, value in kvs.items():
        entry = layout.parse_block(key)
        if entry is not None:
            blocks[(entry.key, entry.node_id)] = value.decode()
    return blocks


def mirror_blocks(mirror: Mirror) -> dict[tuple[bytes, str], str]:
    return {(key, node): tier for key in KEYS for node, tier in mirror.index.holders_of(key).items()}


def brute_longest_prefix(blocks, keys) -> dict[str, int]:
    matched = {}
    for node in {node for _, node in blocks}:
        count = 0
        while count < len(keys) and (keys[count], node) in blocks:
            count += 1
        if count:
            matched[node] = count
    return matched


async def start_mirror(endpoint: str, ns: str) -> Mirror:
    mirror = Mirror(EtcdClient(endpoint, timeout_s=2.0), Layout(ns), MirrorConfig(retry_s=0.1))
    await mirror.start()
    return mirror


async def settle(mirror: Mirror, nodes: list[LocalNode]) -> int:
    """Flush every publisher, then wait until the mirror has applied the nodes' latest writes."""
    revision = max([await node.publisher.flush() for node in nodes] + [n.membership.revision for n in nodes])
    await mirror.wait_revision(revision)
    return revision


async def stop_mirror(mirror: Mirror) -> None:
    await mirror.stop()
    await mirror.client.close()


def check_against_oracle(etcd, mirror: Mirror, ns: str, nodes: list[LocalNode]) -> None:
    _, kvs = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/")
    truth = truth_index(kvs, mirror.layout)
    model = {(key, n.membership.record.node_id): tier for n in nodes for key, tier in n.held.items()}
    assert truth == model
    assert mirror_blocks(mirror) == truth
    assert sum(mirror.index.num_blocks(node) for node in NODES) == len(truth)  # nothing beyond KEYS either
    assert set(mirror.nodes) == {n.membership.record.node_id for n in nodes}
    for chain in CHAINS:
        for length in (1, 3, 6):
            assert mirror.longest_prefix(chain[:length]) == brute_longest_prefix(truth, chain[:length])
    mirror.index.check_integrity()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=12))
def test_mirror_equals_etcd_after_random_publish_and_evict(etcd, ops):
    ns = f"hyp{abs(hash(tuple(map(str, ops)))) % 10**12}"

    async def scenario():
        nodes = [await LocalNode(etcd.endpoint, ns, node_id).start() for node_id in NODES]
        mirror = await start_mirror(etcd.endpoint, ns)
        for node_id, is_store, keys in ops:
            node = nodes[NODES.index(node_id)]
            node.store(keys) if is_store else node.evict(keys)
        await settle(mirror, nodes)
        check_against_oracle(etcd, mirror, ns, nodes)
        await stop_mirror(mirror)
        for node in nodes:
            await node.stop()

    asyncio.run(scenario())
    assert etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/")[1] == {}  # clean stop revoked every lease


def test_foreign_and_malformed_entries_are_skipped(etcd, ns):
    async def scenario():
        layout = Layout(ns)
        node = await LocalNode(etcd.endpoint, ns, "n0").start()
        mirror = await start_mirror(etcd.endpoint, ns)
        node.store(CHAINS[0][:2])
        bad = {
            layout.prefix + b"something/else": b"x",
            layout.blocks_prefix + b"nothex/n0": b"device",
            layout.blocks_prefix + CHAINS[1][0].hex().encode() + b"/n9": b"\xff\xfe not a tier",
            layout.blocks_prefix + CHAINS[1][1].hex().encode(): b"device",
            layout.nodes_prefix + b"n7": b"{not json",
            layout.nodes_prefix + b"n8": b'{"node_id": "someone-else"}',
        }
        client = EtcdClient(etcd.endpoint)
        revision = await client.apply(list(bad.items()), [])
        await mirror.wait_revision(max(revision, await node.publisher.flush()))
        assert mirror.num_skipped == len(bad)
        revision = await client.apply([], list(bad))
        node.store(CHAINS[0][2:3])
        await mirror.wait_revision(max(revision, await node.publisher.flush()))
        assert mirror.longest_prefix(CHAINS[0]) == {"n0": 3}
        assert set(mirror.nodes) == {"n0"}
        fresh = await start_mirror(etcd.endpoint, ns)  # a snapshot containing junk: same result
        await client.apply(list(bad.items()), [])
        await fresh.wait_revision(await client.put(layout.prefix + b"zz", b"junk"))
        assert fresh.longest_prefix(CHAINS[0]) == {"n0": 3} and set(fresh.nodes) == {"n0"}
        for m in (mirror, fresh):
            await stop_mirror(m)
        await node.stop()
        await client.close()

    asyncio.run(scenario())


def test_watch_across_a_compaction_resyncs(etcd, ns):
    async def scenario():
        node = await LocalNode(etcd.endpoint, ns, "n0").start()
        mirror = await start_mirror(etcd.endpoint, ns)
        node.store(CHAINS[0])
        await mirror.wait_revision(await node.publisher.flush())
        resyncs = mirror.num_resyncs
        await mirror.stop()  # stop watching, write and compact past its revision, then come back
        node.evict(CHAINS[0][3:])
        node.store(CHAINS[1])
        revision = await node.publisher.flush()
        etcdctl(etcd, "compaction", str(revision))
        mirror._watch = None
        await mirror.start()
        await mirror.wait_revision(revision)
        assert mirror.num_resyncs == resyncs + 1
        check_against_oracle(etcd, mirror, ns, [node])
        await stop_mirror(mirror)
        await node.stop()

    asyncio.run(scenario())
