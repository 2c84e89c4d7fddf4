"""The etcd facade against a real etcd: batched txns, leases, consistent reads, watch, compaction, failover."""

import asyncio
import signal

import pytest

from prefixpool.meta.etcd_client import MAX_TXN_OPS, EtcdClient, EtcdUnavailable, LeaseNotFound, RevisionCompacted
from prefixpool.deploy.etcd_server import EtcdServer, EtcdServerConfig, free_port
from tests.conftest import etcdctl_get_prefix


def test_apply_splits_large_batches_into_txns_under_a_lease(etcd, ns):
    async def scenario():
        client = EtcdClient(etcd.endpoint)
        lease = await client.grant(30)
        puts = [(f"/{ns}/k{i:04d}".encode(), b"v") for i in range(3 * MAX_TXN_OPS + 5)]
        revision = await client.apply(puts, [], lease)
        snapshot = await client.get_prefix(f"/{ns}/".encode())
        assert snapshot.revision == revision
        assert {kv.key for kv in snapshot.kvs} == {k for k, _ in puts}
        assert {kv.lease for kv in snapshot.kvs} == {lease}
        await client.apply([], [k for k, _ in puts[:10]])
        await client.close()
        return lease

    asyncio.run(scenario())
    _, truth = etcdctl_get_prefix(etcd, f"/{ns}/")
    assert len(truth) == 3 * MAX_TXN_OPS + 5 - 10


def test_revoked_lease_deletes_its_keys_and_is_reported_gone(etcd, ns):
    async def scenario():
        client = EtcdClient(etcd.endpoint)
        lease = await client.grant(30)
        await client.put(f"/{ns}/a".encode(), b"1", lease)
        assert await client.keepalive(lease) > 0
        await client.revoke(lease)
        assert (await client.get_prefix(f"/{ns}/".encode())).kvs == []
        with pytest.raises(LeaseNotFound):
            await client.keepalive(lease)
        with pytest.raises(LeaseNotFound):
            await client.put(f"/{ns}/b".encode(), b"1", lease)
        await client.revoke(lease)  # revoking twice is not an error
        await client.close()

    asyncio.run(scenario())


def test_watch_from_revision_sees_every_event_in_order(etcd, ns):
    async def scenario():
        client = EtcdClient(etcd.endpoint)
        prefix = f"/{ns}/".encode()
        start = (await client.get_prefix(prefix)).revision + 1
        revisions = [await client.put(prefix + b"x", str(i).encode()) for i in range(5)]
        watch = await client.watch_prefix(prefix, start)
        seen = []
        async for batch in watch:
            seen += [(e.revision, e.value) for e in batch.events]
            if len(seen) == 5:
                break
        watch.cancel()
        assert seen == [(r, str(i).encode()) for i, r in enumerate(revisions)]
        await client.close()

    asyncio.run(scenario())


def test_watch_from_a_compacted_revision_raises(etcd, ns):
    async def scenario():
        client = EtcdClient(etcd.endpoint)
        prefix = f"/{ns}/".encode()
        first = await client.put(prefix + b"x", b"0")
        last = await client.put(prefix + b"x", b"1")
        await client.compact(last)
        watch = await client.watch_prefix(prefix, first)
        with pytest.raises(RevisionCompacted) as raised:
            async for _ in watch:
                pass
        assert raised.value.compact_revision >= last
        await client.close()

    asyncio.run(scenario())


def test_unreachable_etcd_raises_unavailable_and_a_second_endpoint_takes_over(etcd, ns):
    async def scenario():
        dead = f"127.0.0.1:{free_port()}"
        client = EtcdClient([dead, etcd.endpoint], timeout_s=2.0)
        with pytest.raises(EtcdUnavailable):
            await client.get_prefix(b"/")
        await client.put(f"/{ns}/a".encode(), b"1")  # the next call goes to the live endpoint
        assert len((await client.get_prefix(f"/{ns}/".encode())).kvs) == 1
        await client.close()

    asyncio.run(scenario())


def test_a_put_through_the_json_gateway_is_exact_and_an_etcd_without_it_gets_grpc(etcd, ns):
    async def scenario(endpoint: str, gateway: bool):
        client = EtcdClient(endpoint)
        lease = await client.grant(30)
        key, value = f"/{ns}/g/\xff".encode("latin-1") + bytes(range(256)), bytes(range(256)) * 3
        revision = await client.put(key, value, lease)
        assert client._gateway is gateway  # the gateway answered, or the txn took over for good
        (kv,) = (await client.get_prefix(f"/{ns}/g/".encode())).kvs
        assert (kv.key, kv.value, kv.mod_revision, kv.lease) == (key, value, revision, lease)
        assert await client.put(key, b"again") > revision
        await client.revoke(lease)
        with pytest.raises(LeaseNotFound):
            await client.put(key, b"1", lease)
        await client.close()

    with_and_without_gateway(etcd.endpoint, scenario)


def test_a_put_to_a_stopped_etcd_is_unavailable_and_goes_through_once_it_is_back(own_etcd, ns):
    async def scenario():
        client = EtcdClient(own_etcd.endpoint, timeout_s=1.0)
        await client.put(f"/{ns}/a".encode(), b"1")  # a kept-alive connection to the gateway
        own_etcd.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(EtcdUnavailable):
                await client.put(f"/{ns}/a".encode(), b"2")
        finally:
            own_etcd.process.send_signal(signal.SIGCONT)
        revision = await client.put(f"/{ns}/b".encode(), b"3")  # (the timed-out put may still land: another key)
        (kv,) = (await client.get_prefix(f"/{ns}/b".encode())).kvs
        assert (kv.value, kv.mod_revision) == (b"3", revision)
        await client.close()

    asyncio.run(scenario())


def test_revision_reads_etcds_revision_without_writing(own_etcd, ns):  # its own: no other test's lease expires
    async def scenario(endpoint: str, gateway: bool) -> None:
        client = EtcdClient(endpoint)
        key = f"/{ns}/r/\xff".encode("latin-1")
        written = await client.put(key, b"1")
        assert await client.revision(key) == written == await client.revision(b"/no/such/key")
        assert client._gateway is gateway
        assert await client.revision(key) == written  # reading wrote nothing
        assert await client.put(key, b"2") == written + 1 == await client.revision(key)
        await client.close()

    with_and_without_gateway(own_etcd.endpoint, scenario)


def with_and_without_gateway(endpoint: str, scenario) -> None:
    """`scenario(endpoint, gateway)` against `endpoint` (an etcd with its JSON gateway), then against an etcd
    started without it."""
    asyncio.run(scenario(endpoint, True))
    without = EtcdServer(EtcdServerConfig(grpc_gateway=False)).start()
    try:
        asyncio.run(scenario(without.endpoint, False))
    finally:
        without.close()
