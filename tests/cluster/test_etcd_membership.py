"""Membership and publication against a real etcd: leases, crashes, restarts, data loss, overflow."""

import asyncio
import os
import signal
import subprocess
import sys
import time

from prefixpool.meta.layout import Layout
from prefixpool.deploy.etcd_server import free_port
from prefixpool.meta.membership import decode_record
from tests.conftest import LocalNode, etcdctl_get_prefix
from tests.cluster.test_etcd_mirror import CHAINS, check_against_oracle, settle, start_mirror, stop_mirror

NODE_PROCESS = """
import asyncio, sys
from tests.conftest import LocalNode
from tests.cluster.test_etcd_mirror import CHAINS
async def main():
    node = await LocalNode(sys.argv[1], sys.argv[2], "victim", ttl_s=2).start()
    node.store(CHAINS[0])
    await node.publisher.flush()
    print("published", flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


def test_sigkilled_node_leaves_the_mirror_within_its_ttl(etcd, ns):
    """A real process registers with a 2 s lease and publishes; SIGKILL; its blocks vanish by themselves."""

    async def scenario():
        mirror = await start_mirror(etcd.endpoint, ns)
        process = subprocess.Popen([sys.executable, "-c", NODE_PROCESS, etcd.endpoint, ns], stdout=subprocess.PIPE,
                                   cwd=os.getcwd(), start_new_session=True)  # fmt: skip
        line = await asyncio.to_thread(process.stdout.readline)
        assert line.strip() == b"published"
        async with asyncio.timeout(10):
            while mirror.longest_prefix(CHAINS[0]) != {"victim": 6}:
                await asyncio.sleep(0.01)
        assert "victim" in mirror.nodes
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        killed_at = time.monotonic()
        async with asyncio.timeout(2 + 3):  # TTL plus slack
            while mirror.nodes or len(mirror.index):
                await asyncio.sleep(0.01)
        assert mirror.longest_prefix(CHAINS[0]) == {}
        await stop_mirror(mirror)
        return time.monotonic() - killed_at

    asyncio.run(scenario())
    assert etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/")[1] == {}


def test_record_and_load_updates_reach_the_mirror_and_stop_revokes(etcd, ns):
    async def scenario():
        node = await LocalNode(etcd.endpoint, ns, "n0").start()
        mirror = await start_mirror(etcd.endpoint, ns)
        node.store(CHAINS[0])
        await settle(mirror, [node])
        node.membership.update_load(num_queued=3, num_running=2, prefill_tokens_per_s=1234.5)
        async with asyncio.timeout(10):
            while node.membership.record.num_queued != mirror.nodes["n0"].num_queued:
                await asyncio.sleep(0.01)
        assert mirror.nodes["n0"] == node.membership.record
        _, kvs = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/nodes/")
        assert decode_record(kvs[Layout(ns).node_key("n0")]).prefill_tokens_per_s == 1234.5
        await node.stop()
        async with asyncio.timeout(10):
            while mirror.nodes or len(mirror.index):
                await asyncio.sleep(0.01)
        await stop_mirror(mirror)

    asyncio.run(scenario())


def test_etcd_restart_keeping_data_mirror_converges(own_etcd, ns):
    async def scenario():
        nodes = [await LocalNode(own_etcd.endpoint, ns, f"n{i}", ttl_s=3).start() for i in range(2)]
        mirror = await start_mirror(own_etcd.endpoint, ns)
        nodes[0].store(CHAINS[0])
        nodes[1].store(CHAINS[1][:3])
        await settle(mirror, nodes)
        resyncs = mirror.num_resyncs
        await asyncio.to_thread(own_etcd.restart, True)
        nodes[0].evict(CHAINS[0][4:])  # mid-stream: written once etcd is back
        nodes[1].store(CHAINS[2])
        await settle(mirror, nodes)
        assert mirror.num_resyncs > resyncs
        check_against_oracle(own_etcd, mirror, ns, nodes)
        await stop_mirror(mirror)
        for node in nodes:
            await node.stop()

    asyncio.run(scenario())


def test_wiped_etcd_is_repopulated_by_live_nodes(own_etcd, ns):
    async def scenario():
        nodes = [await LocalNode(own_etcd.endpoint, ns, f"n{i}", ttl_s=2).start() for i in range(2)]
        mirror = await start_mirror(own_etcd.endpoint, ns)
        nodes[0].store(CHAINS[0])
        nodes[1].store(CHAINS[1])
        await settle(mirror, nodes)
        rotations, resyncs = [n.membership.num_rotations for n in nodes], mirror.num_resyncs
        await asyncio.to_thread(own_etcd.restart, False)  # a lost disk: no leases, no keys
        nodes[0].evict(CHAINS[0][5:])
        async with asyncio.timeout(20):
            while [n.membership.num_rotations for n in nodes] <= rotations or any(n.publisher.busy for n in nodes):
                await asyncio.sleep(0.02)
            # the wiped etcd counts revisions from 1 again: until the mirror has a snapshot of it, its revision is
            # the old etcd's, above every new write's, and settle() would not wait (CI saw the stale index)
            while mirror.num_resyncs <= resyncs or not mirror.connected:
                await asyncio.sleep(0.02)
        await settle(mirror, nodes)
        assert all(n.membership.num_rotations > r for n, r in zip(nodes, rotations))
        check_against_oracle(own_etcd, mirror, ns, nodes)
        assert mirror.longest_prefix(CHAINS[0]) == {"n0": 5}
        await stop_mirror(mirror)
        for node in nodes:
            await node.stop()

    asyncio.run(scenario())


def test_overflow_drops_and_republishes_exactly(etcd, ns):
    """Overflow drops the queue; the lease rotation re-puts what is held and deletes what was evicted."""

    async def scenario():
        node = await LocalNode(etcd.endpoint, ns, "n0", max_pending=4).start()
        mirror = await start_mirror(etcd.endpoint, ns)
        node.store(CHAINS[0])  # 6 > 4 pending: overflow before anything is written
        await settle(mirror, [node])
        assert node.publisher.num_overflows == 1
        assert node.publisher.num_dropped >= 6
        check_against_oracle(etcd, mirror, ns, [node])
        node.evict(CHAINS[0][2:])  # 4 pending, no overflow
        node.store(CHAINS[1][:3])  # overflow again: the 4 evictions are dropped from the queue...
        await settle(mirror, [node])
        assert node.publisher.num_overflows == 2
        check_against_oracle(etcd, mirror, ns, [node])  # ...yet etcd holds exactly what the node holds
        await stop_mirror(mirror)
        await node.stop()

    asyncio.run(scenario())


def test_unreachable_etcd_never_blocks_publish(own_etcd, ns):
    async def scenario():
        node = await LocalNode(own_etcd.endpoint, ns, "n0", ttl_s=3).start()
        own_etcd.kill()
        for chain in CHAINS:  # plain calls: nothing here can wait on etcd
            node.store(chain)
            node.evict(chain[3:])
        # 3 stores per chain; the 3 keys stored and evicted before any write are no op at all (coalesced)
        assert node.publisher.num_pending == 9 and node.publisher.num_coalesced == 9
        await asyncio.sleep(0.3)  # the background writer is failing meanwhile
        assert node.publisher.busy
        await asyncio.to_thread(own_etcd.start)
        mirror = await start_mirror(own_etcd.endpoint, ns)
        await settle(mirror, [node])
        check_against_oracle(own_etcd, mirror, ns, [node])
        await stop_mirror(mirror)
        await node.stop()

    asyncio.run(scenario())


def test_membership_start_fails_fast_when_etcd_is_absent(ns):
    async def scenario():
        node = LocalNode(f"127.0.0.1:{free_port()}", ns, "n0")
        try:
            await node.start()
        except Exception as error:
            return type(error).__name__
        finally:
            await node.stop()

    assert asyncio.run(scenario()) == "EtcdUnavailable"


def test_patient_start_registers_when_etcd_answers(own_etcd, ns):
    """etcd frozen (connections open, no answer: CI's slow etcd) at start: no error, nothing written; resumed,
    the node registers by itself and publishes what it stored meanwhile, exactly."""

    async def scenario():
        os.kill(own_etcd.pid, signal.SIGSTOP)
        try:
            node = await LocalNode(own_etcd.endpoint, ns, "n0", ttl_s=3).start(patient=True)
            assert node.membership.lease_id is None
            node.store(CHAINS[0])
            node.evict(CHAINS[0][4:])
        finally:
            os.kill(own_etcd.pid, signal.SIGCONT)
        async with asyncio.timeout(30):
            while node.membership.lease_id is None:
                await asyncio.sleep(0.05)
        mirror = await start_mirror(own_etcd.endpoint, ns)
        await settle(mirror, [node])
        check_against_oracle(own_etcd, mirror, ns, [node])
        assert mirror.longest_prefix(CHAINS[0]) == {"n0": 4}
        await stop_mirror(mirror)
        await node.stop()

    asyncio.run(scenario())
