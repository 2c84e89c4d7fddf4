"""A vLLM server as a prefixpool node: its etcd record and lease, its blocks learned from KV events.

    wait for vLLM /health ─▶ register (record kind "vllm", lease) ─▶ two loops:
      events:  EventStream ─▶ Ledger.apply ─▶ Publisher.publish(stored, removed)
               RESET (history lost, vLLM restarted) ─▶ every key removed, relearn from here
      health:  GET /health every period; `max_failures` misses in a row ─▶ revoke the lease
               (etcd drops the record and every block now), clear; vLLM back ─▶ register again
      load:    GET /metrics (requests waiting, running) ─▶ the record's load fields, as our workers do

If this sidecar dies, its lease expires and etcd drops the blocks by itself.
Knows nothing of the router or of how vLLM is started.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_report import report_load
from prefixpool.meta.membership import Membership, MembershipConfig, NodeRecord
from prefixpool.meta.publisher import Publisher
from prefixpool.vllm_sidecar.event_stream import EventStream, Reset
from prefixpool.vllm_sidecar.ledger import Change, Ledger
from prefixpool.vllm_sidecar.metrics import sample_load
from prefixpool.store.keys import Namespace
from prefixpool.store.tier_names import DEVICE

log = logging.getLogger(__name__)
KIND = "vllm"


@dataclass(frozen=True)
class HealthConfig:
    period_s: float = 1.0
    max_failures: int = 3
    # a vLLM on CPU spins its engine threads on every core while it runs, and its API server may answer
    # late then: a slow answer is not a dead server (a dead one refuses at once: max_failures periods)
    timeout_s: float = 5.0
    load_period_s: float = 0.2  # how often vLLM's /metrics is read for the record's load


class ModelMismatch(ValueError):
    """vLLM serves another model than the node was told: the router would send it requests it cannot serve."""


class VllmNode:
    def __init__(self, client: EtcdClient, layout: Layout, record: NodeRecord, namespace: Namespace,
                 stream: EventStream, membership_config: MembershipConfig = MembershipConfig(),
                 health: HealthConfig = HealthConfig()) -> None:  # fmt: skip
        self.ledger = Ledger(namespace)
        self.stream, self.health = stream, health
        self.membership = Membership(client, layout, record, membership_config)
        self.publisher = Publisher(client, self.membership, lambda: [(k, DEVICE) for k in self.ledger.all_keys()])
        self.registered = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    @property
    def vllm_url(self) -> str:
        return self.membership.record.http_url

    async def run(self) -> None:
        """Until cancelled; raises BlockSizeMismatch when vLLM's blocks cannot match ours."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.health.timeout_s))
        await self.publisher.start()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._follow_events())
                group.create_task(self._follow_health())
                group.create_task(report_load(lambda: sample_load(self._session, self.vllm_url), self.membership,
                                              self.health.load_period_s))
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None  # the one that stopped the node, not the group
        finally:
            await self.publisher.stop()
            await self.membership.stop()
            await self._session.close()

    async def _follow_events(self) -> None:
        async for item in self.stream.batches():
            if isinstance(item, Reset):
                self._publish(self.ledger.clear())
                continue
            _, batch = item
            for event in batch.events:
                self._publish(self.ledger.apply(event))

    def _publish(self, change: Change) -> None:
        if change.stored or change.removed:
            self.publisher.publish(stored=change.stored, removed=change.removed)

    async def _follow_health(self) -> None:
        failures = 0
        while True:
            healthy = await self._healthy()
            failures = 0 if healthy else failures + 1
            if healthy and not self.registered.is_set() and await self._serves_our_model():
                await self.membership.start()
                self.registered.set()
                log.info("vLLM at %s is up: node %s registered", self.vllm_url, self.membership.record.node_id)
            elif failures >= self.health.max_failures and self.registered.is_set():
                log.warning("vLLM at %s stopped answering: revoking node %s", self.vllm_url,
                            self.membership.record.node_id)
                self.registered.clear()
                self.ledger.clear()
                await self.membership.stop()
            await asyncio.sleep(self.health.period_s)

    async def _serves_our_model(self) -> bool:
        """True when vLLM lists our model; False when it could not be asked; ModelMismatch when it serves another."""
        assert self._session is not None
        try:
            async with self._session.get(f"{self.vllm_url}/v1/models") as response:
                served = [m["id"] for m in (await response.json()).get("data", [])]
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
            return False
        if self.membership.record.model not in served:
            raise ModelMismatch(f"vLLM at {self.vllm_url} serves {served}, not {self.membership.record.model!r}: "
                                f"start it with --served-model-name {self.membership.record.model}")
        return True

    async def _healthy(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.vllm_url}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
