"""A router's load entry in a real etcd: every change put, and a load back where etcd has it put again; a router
alone in its fleet orders an end at once by a read of etcd's revision and holds its changes back."""

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


async def alone(endpoint: str, ns: str, alone_period_s: float) -> tuple[int, dict, list[int], dict, int, int]:
    """No other router: three begins (no end among them), then an end. The puts after the begins and what etcd
    holds a moment later; once the end is ordered: the revisions told the tracker, what etcd holds, the puts
    and reads made, and etcd's revision then."""
    client = EtcdClient(endpoint)
    tracker = Tracker()
    config = LoadPublisherConfig(ttl_s=5, period_s=0.01, alone_period_s=alone_period_s)
    publisher = LoadPublisher(client, Layout(ns), "r0", tracker, config, peers=lambda: 0)
    try:
        await publisher.start()  # the first entry: a put
        for i in range(1, 4):
            tracker.load = {"w0": (i, 100 * i)}
            publisher.changed()
            await asyncio.sleep(0.05)
        held = len(tracker.revisions), await in_etcd(client, ns)
        tracker.load, tracker.pending = {"w0": (2, 200)}, True
        publisher.changed()
        async with asyncio.timeout(10):
            while tracker.pending:
                await asyncio.sleep(0.01)
        now = (await client.get_prefix(f"/{ns}/".encode())).revision
        return *held, tracker.revisions, await in_etcd(client, ns), publisher.num_puts, now
    finally:
        await publisher.stop()
        await client.close()


def test_alone_an_end_is_ordered_by_a_read_at_once_and_changes_wait(etcd, ns):
    puts, seen, revisions, seen_after_end, puts_after_end, now = asyncio.run(alone(etcd.endpoint, ns, 60.0))
    assert (puts, seen) == (1, {})  # the start's put only: the begins are held back
    # the end: ordered by a read of etcd's revision at that moment (a lease of another test may expire meanwhile)
    assert len(revisions) == 2 and revisions[0] <= revisions[1] <= now
    assert (puts_after_end, seen_after_end) == (1, {})  # not put: it waits with the begins


async def held_back_goes(endpoint: str, ns: str) -> tuple[dict, int, int]:
    """No other router, two begins and an end: what etcd holds once the held-back changes had their period, and
    the puts and reads made."""
    client = EtcdClient(endpoint)
    tracker = Tracker()
    config = LoadPublisherConfig(ttl_s=5, period_s=0.01, alone_period_s=1.0)  # the end comes well inside it
    publisher = LoadPublisher(client, Layout(ns), "r0", tracker, config, peers=lambda: 0)
    try:
        await publisher.start()
        tracker.load = {"w0": (2, 200)}
        publisher.changed()
        await asyncio.sleep(0.05)
        tracker.load, tracker.pending = {"w0": (1, 100)}, True
        publisher.changed()
        async with asyncio.timeout(10):
            while publisher.num_puts < 2:
                await asyncio.sleep(0.01)
        return await in_etcd(client, ns), publisher.num_puts, publisher.num_reads
    finally:
        await publisher.stop()
        await client.close()


def test_alone_held_back_changes_are_put_after_their_period(etcd, ns):
    assert asyncio.run(held_back_goes(etcd.endpoint, ns)) == ({"w0": (1, 100)}, 2, 1)  # the end read, then put
