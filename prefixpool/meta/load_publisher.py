"""A router's presence in etcd: its own lease and its in-flight load, put coalesced.

    start:  grant lease L (ttl), put routers/<id> = RouterLoad (its URL, load and routed keys) under L
    loop:   woken by the tracker's on_change, or every ttl/4 for the keepalive:
            keepalive(L) when due; if the snapshot changed since the last put, put it; then sleep
            `period_s`, so a burst of begins and ends costs one put, not one each
    alone:  while no other router is routing (`peers()` is 0: none in the fleet, or all idle), changes
            wait up to `alone_period_s` and go as one put: nobody else reads them, and each put costs
            this router, etcd (a raft write) and every mirror (a watch event) CPU on the request path.
            An end still gets its ordering point at once (what the workers' own load reports need:
            router/inflight.py), from a linearizable read of etcd's revision: no write, no event.
            A router that starts routing sees this one's entry (up to `alone_period_s` late: in flight
            counts that ended meanwhile still in it) and puts its own changes at once; this one leaves
            alone mode on them
    lost L: (etcd restarted empty, the router stalled past the TTL) grant a new one, put again
    stop:   revoke L: the entry leaves etcd now; a killed router's entry leaves when L expires

Knows nothing of routing or HTTP: it publishes what the tracker's `snapshot()` returns and
tells it the revision that did (`published`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from prefixpool.meta.background import stop_task
from prefixpool.meta.etcd_client import EtcdClient, EtcdError, LeaseNotFound
from prefixpool.meta.layout import Layout
from prefixpool.meta.fleet_load import RouterLoad, encode_load

log = logging.getLogger(__name__)


class LoadSource(Protocol):  # prefixpool.router.inflight.InflightTracker
    def snapshot(self) -> dict[str, tuple[int, int]]: ...
    def routed(self) -> dict[str, list[bytes]]: ...
    def unpublished(self) -> bool: ...
    def published(self, snapshot: dict[str, tuple[int, int]], revision: int) -> None: ...


@dataclass(frozen=True)
class LoadPublisherConfig:
    ttl_s: int = 10
    period_s: float = 0.02  # at most one put per period
    retry_s: float = 0.5
    alone_period_s: float = 1.0  # while no other router is routing: at most one put per this, an end ordered by a read


class LoadPublisher:
    def __init__(self, client: EtcdClient, layout: Layout, router_id: str, tracker: LoadSource,
                 config: LoadPublisherConfig = LoadPublisherConfig(), url: str = "",
                 peers: Callable[[], int] = lambda: 1) -> None:  # fmt: skip
        self.client, self.layout, self.router_id, self.config = client, layout, router_id, config
        self.peers = peers  # how many other routers the fleet has now (the default: assume some)
        self.url = url  # where this router serves, as it advertises it
        self.tracker = tracker
        self.lease_id: int | None = None
        self.revision = 0  # etcd revision of our latest put
        self.num_puts = 0
        self.num_reads = 0  # ends ordered by a read instead of a put (alone)
        self._published: tuple[dict[str, tuple[int, int]], dict[str, list[bytes]]] | None = None
        self._kept_at = 0.0  # time.monotonic() of the latest grant or keepalive
        self._put_at = 0.0  # time.monotonic() of the latest put
        self._held_back = False  # a change waits for alone_period_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def changed(self) -> None:
        """The tracker's on_change: non-blocking, the put happens in the background task."""
        self._wake.set()

    async def start(self) -> None:
        """Grant the lease and put the first entry (raises EtcdError if etcd is not there)."""
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is not None:
            try:
                await self.client.revoke(lease_id)
            except EtcdError as error:
                log.warning("router %s: revoke failed (%s); the lease expires by itself", self.router_id, error)

    async def _register(self) -> None:
        self.lease_id = await self.client.grant(self.config.ttl_s)
        self._kept_at = time.monotonic()
        self._published = None
        await self._put_if_changed()
        log.info("router %s publishes its load under lease %x", self.router_id, self.lease_id)

    async def _put_if_changed(self, alone: bool = False) -> None:
        current, routed = self.tracker.snapshot(), self.tracker.routed()
        self._held_back = False
        # a load that went back to what etcd holds still needs a put after an end: the workers' own reports
        # count only once etcd ordered them after the router's latest end (router/service.py, _load)
        unordered = self.tracker.unpublished()
        if (current, routed) == self._published and not unordered:
            return
        if alone and time.monotonic() - self._put_at < self.config.alone_period_s:
            self._held_back = True
            if unordered:  # an end: ordered at once by a read (no write, no watch event), put with the rest later
                self.tracker.published(current, await self.client.revision(self.layout.router_key(self.router_id)))
                self.num_reads += 1
            return
        assert self.lease_id is not None
        load = RouterLoad(self.router_id, current, self.url, routed)
        self.revision = await self.client.put(self.layout.router_key(self.router_id), encode_load(load), self.lease_id)
        self._published = current, routed
        self.tracker.published(current, self.revision)
        self.num_puts += 1
        self._put_at = time.monotonic()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._wait_s())
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._step()
            except LeaseNotFound:
                log.warning("router %s lost its lease; registering again", self.router_id)
                self.lease_id = None
                self._wake.set()
            except EtcdError as error:
                log.warning("router %s: etcd: %s; retrying in %.1fs", self.router_id, error, self.config.retry_s)
                await asyncio.sleep(self.config.retry_s)
                self._wake.set()
            await asyncio.sleep(self.config.period_s)

    def _wait_s(self) -> float:
        """Until the keepalive is due, or a held-back change may go."""
        wait = self.config.ttl_s / 4
        if self._held_back:
            wait = min(wait, max(0.0, self._put_at + self.config.alone_period_s - time.monotonic()))
        return wait

    async def _step(self) -> None:
        if self.lease_id is None:
            await self._register()
        elif time.monotonic() - self._kept_at >= self.config.ttl_s / 4:
            await self.client.keepalive(self.lease_id)
            self._kept_at = time.monotonic()
        await self._put_if_changed(alone=self.peers() == 0)
