"""Coalescing and run-granular publication against a real etcd, with etcdctl as the oracle.

After any sequence of stores, tier changes and evictions, once the publisher has flushed,
etcd holds exactly the node's published holdings (every key, or the run-boundary keys and the
tails of the stored chains), and an op that leaves a key as etcd already has it costs no write at all.
"""

import asyncio
import random

import pytest

from prefixpool.meta import runs
from prefixpool.meta.layout import Layout
from prefixpool.meta.publisher import Publisher, PublisherConfig
from prefixpool.store.keys import Namespace, chain_ids
from tests.conftest import LocalNode, etcdctl_get_prefix

TIERS = ("device", "host", "disk")


def node_with(endpoint: str, ns: str, node_id: str, config: PublisherConfig) -> LocalNode:
    node = LocalNode(endpoint, ns, node_id)
    node.publisher = Publisher(node.client, node.membership, lambda: list(node.held.items()), config)
    return node


def etcd_blocks(server, ns: str, node_id: str) -> dict[bytes, str]:
    layout = Layout(ns)
    _, kvs = etcdctl_get_prefix(server, layout.blocks_prefix.decode())
    return {e.key: v.decode() for k, v in kvs.items() if (e := layout.parse_block(k)) and e.node_id == node_id}


def expected(node: LocalNode, run_blocks: int, tails: set[bytes]) -> dict[bytes, str]:
    return {key: tier for key, tier in node.held.items() if runs.is_boundary(key, run_blocks) or key in tails}


async def random_churn(node: LocalNode, keys: list[bytes], rng: random.Random, steps: int, tails: set[bytes]) -> None:
    """Stores, re-tiers and evictions of random key sets; sometimes lets the writer run in between. `tails`:
    the held keys published as a store's last key (a chain's tail), kept up to date."""
    for _ in range(steps):
        chosen = rng.sample(keys, rng.randint(1, 6))
        kind = rng.random()
        if kind < 0.45:
            node.store(chosen, rng.choice(TIERS))  # a tail held already keeps its key, in the new tier
            tails.add(chosen[-1])
        elif kind < 0.9:
            node.evict(chosen)
            tails.difference_update(chosen)
        else:
            node.evict(chosen)
            tails.difference_update(chosen)
            node.store(chosen, rng.choice(TIERS))
            tails.add(chosen[-1])
        if rng.random() < 0.3:
            await asyncio.sleep(rng.choice([0, 0, 0.002]))


@pytest.mark.parametrize("run_blocks,window_s", [(1, 0.0), (1, 0.005), (4, 0.0), (4, 0.005)])
def test_etcd_equals_holdings_after_random_churn(etcd, ns, run_blocks, window_s):
    keys = chain_ids(range(40), Namespace("coalesce"))

    async def scenario():
        node = await node_with(etcd.endpoint, ns, "n0", PublisherConfig(window_s=window_s, run_blocks=run_blocks,
                                                                      retry_s=0.1)).start()
        try:
            tails: set[bytes] = set()
            for seed in range(4):
                await random_churn(node, keys, random.Random(seed * 10 + run_blocks), 60, tails)
                await node.publisher.flush()
                assert etcd_blocks(etcd, ns, "n0") == expected(node, run_blocks, tails)
            return node.publisher.num_coalesced
        finally:
            await node.stop()

    assert asyncio.run(scenario()) > 0


def test_store_then_evict_in_one_window_writes_nothing(etcd, ns):
    keys = chain_ids(range(8), Namespace("window"))

    async def scenario():
        node = await node_with(etcd.endpoint, ns, "n0", PublisherConfig(window_s=0.05)).start()
        try:
            node.store(keys[:4])
            await node.publisher.flush()
            written = node.publisher.num_written
            node.store(keys[4:])  # never written ...
            node.evict(keys[4:])  # ... so evicting them is nothing
            node.evict(keys[:2])  # written: one delete each
            node.store(keys[:2])  # back as etcd has them: nothing
            node.store(keys[2:3], "host")  # a real change: one put
            await node.publisher.flush()
            assert node.publisher.num_written - written == 1
            assert node.publisher.num_coalesced == 4 + 2
            assert etcd_blocks(etcd, ns, "n0") == node.held
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_runs_publish_boundaries_and_the_chain_tail_and_partial_runs_nothing(etcd, ns):
    keys = chain_ids(range(150), Namespace("runs"))
    ends = runs.boundaries(keys, 8)
    assert 5 < len(ends) < 45 and ends[-1] != 149  # about one in 8; the chain's last key is no boundary

    async def scenario():
        node = await node_with(etcd.endpoint, ns, "n0", PublisherConfig(run_blocks=8)).start()
        try:
            node.store(keys)
            await node.publisher.flush()
            assert set(etcd_blocks(etcd, ns, "n0")) == {keys[i] for i in ends} | {keys[149]}
            node.evict(keys[ends[1]:])  # the tail goes first: the run up to ends[1] is now partial
            await node.publisher.flush()
            assert set(etcd_blocks(etcd, ns, "n0")) == {keys[ends[0]]}
            assert node.publisher.num_written == (len(ends) + 1) + len(ends)
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_failed_write_is_never_coalesced_away(own_etcd, ns):
    """A write that failed may or may not have reached etcd: the ops after it are written, not dropped."""
    keys = chain_ids(range(6), Namespace("uncertain"))

    async def scenario():
        node = await node_with(own_etcd.endpoint, ns, "n0", PublisherConfig(retry_s=0.1)).start()
        try:
            node.store(keys[:3])
            await node.publisher.flush()
            own_etcd.stop()
            node.store(keys[3:])  # this write fails and goes back to the queue
            for _ in range(200):
                if node.publisher._uncertain:
                    break
                await asyncio.sleep(0.01)
            assert set(node.publisher._uncertain) == set(keys[3:])
            node.evict(keys[3:])
            node.store(keys[3:])  # equals the optimistic state, but etcd never got it: still written
            assert node.publisher.num_pending == 3
            own_etcd.restart(keep_data=True)
            await node.publisher.flush()
            assert etcd_blocks(own_etcd, ns, "n0") == node.held
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_large_txns_fall_back_on_an_etcd_at_its_default_limit(ns):
    """An etcd started without --max-txn-ops refuses txns over 128: the client resends in 128s, losing nothing."""
    from prefixpool.deploy.etcd_server import EtcdServer, EtcdServerConfig
    from prefixpool.meta.etcd_client import LARGE_TXN_OPS, MAX_TXN_OPS, EtcdClient

    puts = [(f"/{ns}/{i:04d}".encode(), b"v") for i in range(300)]

    async def apply(server: EtcdServer) -> int:
        client = EtcdClient(server.endpoint)
        try:
            await client.apply(puts, [])
            return client.max_txn_ops
        finally:
            await client.close()

    with EtcdServer(EtcdServerConfig(max_txn_ops=MAX_TXN_OPS)) as default, EtcdServer() as ours:
        assert asyncio.run(apply(default)) == MAX_TXN_OPS
        assert asyncio.run(apply(ours)) == LARGE_TXN_OPS
        for server in (default, ours):
            assert len(etcdctl_get_prefix(server, f"/{ns}/")[1]) == 300


def test_router_mirror_matches_runs_published_through_etcd(etcd, ns):
    """Node publishes runs of 8 into etcd; a mirror set to 8 matches through the last held boundary, and on to
    the chain's tail when the node holds it."""
    from prefixpool.meta.etcd_client import EtcdClient
    from prefixpool.meta.mirror import Mirror, MirrorConfig

    keys = chain_ids(range(120), Namespace("mirror-runs"))
    ends = runs.boundaries(keys, 8)

    async def scenario():
        node = await node_with(etcd.endpoint, ns, "n0", PublisherConfig(run_blocks=8)).start()
        mirror = Mirror(EtcdClient(etcd.endpoint, timeout_s=2.0), Layout(ns), MirrorConfig(run_blocks=8))
        await mirror.start()
        try:
            node.store(keys[:97])
            await mirror.wait_revision(await node.publisher.flush())
            assert 96 not in ends and 97 not in ends
            assert mirror.longest_prefix(keys) == {"n0": 97}  # through the last boundary, on to the tail
            assert mirror.num_keys() == sum(1 for i in ends if i < 97) + 1  # one index entry per run, and the tail
            node.evict(keys[ends[2]:])
            await mirror.wait_revision(await node.publisher.flush())
            assert mirror.longest_prefix(keys) == {"n0": ends[1] + 1}
            assert mirror.longest_prefix(keys[: ends[0]]) == {}  # shorter than a run: no cross-node match
        finally:
            await mirror.stop()
            await mirror.client.close()
            await node.stop()

    asyncio.run(scenario())
