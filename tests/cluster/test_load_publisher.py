"""A router's load entry in a real etcd: every change put, and a load back where etcd has it put again."""

import asyncio

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.fleet_load import decode_load
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_publisher import LoadPublisher, LoadPublisherConfig


class Tracker:
    """The LoadSource a router's InflightTracker is, set by hand."""

    def __init__(self) -> None:
        self.load: dict[str, tuple[int, int]] = {}
        self.revisions: list[int] = []
        self.pending = False  # a change not yet ordered by a put

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return dict(self.load)

    def routed(self) -> dict[str, list[bytes]]:
        return {}

    def unpublished(self) -> bool:
        return self.pending

    def published(self, snapshot: dict[str, tuple[int, int]], revision: int) -> None:
        self.revisions.append(revision)
        self.pending = False


async def in_etcd(client: EtcdClient, ns: str) -> dict[str, tuple[int, int]]:
    snapshot = await client.get_prefix(Layout(ns).router_key("r0"))
    return decode_load(snapshot.kvs[0].value).workers if snapshot.kvs else {}


async def scenario(endpoint: str, ns: str) -> tuple[list[int], list[dict]]:
    """Five changes, each awaited in etcd; then a begin and end within one period (the load back at the last
    put's); the puts' revisions and etcd's value after each step."""
    client = EtcdClient(endpoint)
    tracker = Tracker()
    publisher = LoadPublisher(client, Layout(ns), "r0", tracker, LoadPublisherConfig(ttl_s=5, period_s=0.01))
    seen = []
    try:
        await publisher.start()
        for i in range(1, 6):
            tracker.load, tracker.pending = {"w0": (i, 100 * i)}, True
            publisher.changed()
            async with asyncio.timeout(10):
                while tracker.pending:
                    await asyncio.sleep(0.01)
            seen.append(await in_etcd(client, ns))
        puts = len(tracker.revisions)
        tracker.pending = True  # the load went up and back down before the publisher woke: the same snapshot
        publisher.changed()
        async with asyncio.timeout(10):
            while len(tracker.revisions) == puts:
                await asyncio.sleep(0.01)
        seen.append(await in_etcd(client, ns))
        return tracker.revisions, seen
    finally:
        await publisher.stop()
        await client.close()


def test_every_change_is_put_and_a_load_back_where_it_was_is_put_again(etcd, ns):
    revisions, seen = asyncio.run(scenario(etcd.endpoint, ns))
    assert seen == [{"w0": (i, 100 * i)} for i in range(1, 6)] + [{"w0": (5, 500)}]
    assert len(revisions) == 7 and revisions == sorted(set(revisions))  # the start, five changes, the same again
