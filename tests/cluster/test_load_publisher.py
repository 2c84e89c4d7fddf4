"""A router's load entry in a real etcd: every change put at once while other routers read it, held back alone."""

import asyncio

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.fleet_load import decode_load
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_publisher import LoadPublisher, LoadPublisherConfig

ALONE_S = 3.0  # far above the few tenths of a second the changes below take


class Tracker:
    """The LoadSource a router's InflightTracker is, set by hand."""

    def __init__(self) -> None:
        self.load: dict[str, tuple[int, int]] = {}
        self.revisions: list[int] = []

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return dict(self.load)

    def routed(self) -> dict[str, list[bytes]]:
        return {}

    def published(self, snapshot: dict[str, tuple[int, int]], revision: int) -> None:
        self.revisions.append(revision)


async def in_etcd(client: EtcdClient, ns: str) -> dict[str, tuple[int, int]]:
    snapshot = await client.get_prefix(Layout(ns).router_key("r0"))
    return decode_load(snapshot.kvs[0].value).workers if snapshot.kvs else {}


async def changes(peers: int, endpoint: str, ns: str) -> tuple[int, int, dict]:
    """Five changes 0.05 s apart, with other routers each awaited in etcd; (puts while they came, puts once the
    last is in etcd, what etcd holds)."""
    client = EtcdClient(endpoint)
    tracker = Tracker()
    config = LoadPublisherConfig(ttl_s=5, period_s=0.01, alone_period_s=ALONE_S)
    publisher = LoadPublisher(client, Layout(ns), "r0", tracker, config, peers=lambda: peers)
    try:
        await publisher.start()
        for i in range(1, 6):
            tracker.load = {"w0": (i, 100 * i)}
            publisher.changed()
            await asyncio.sleep(0.05)
            async with asyncio.timeout(10):
                while peers and await in_etcd(client, ns) != tracker.load:
                    await asyncio.sleep(0.01)
        during = publisher.num_puts
        async with asyncio.timeout(ALONE_S + 10):
            while await in_etcd(client, ns) != tracker.load:
                await asyncio.sleep(0.05)
        return during, publisher.num_puts, await in_etcd(client, ns)
    finally:
        await publisher.stop()
        await client.close()


def test_alone_a_router_puts_its_load_once_per_alone_period_and_the_latest_lands(etcd, ns):
    during, after, held = asyncio.run(changes(0, etcd.endpoint, ns))
    assert during == 1  # the entry at start; the five changes held back
    assert after == 2 and held == {"w0": (5, 500)}  # then the latest one, once


def test_with_other_routers_each_change_is_put(etcd, ns):
    during, after, held = asyncio.run(changes(1, etcd.endpoint, ns))
    assert during == after == 6 and held == {"w0": (5, 500)}  # the entry at start, then every change
