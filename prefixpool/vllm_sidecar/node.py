"""A vLLM server as a prefixpool node: its etcd record and lease, its blocks learned from KV events.

    wait for vLLM /health ─▶ /v1/models: our model, and the LoRA adapters whose parent it is
                         ─▶ register (record kind "vllm", its adapters, lease; etcd out of reach:
                            again at the next health beat) ─▶ loops:
      events:  EventStream ─▶ Ledger.apply ─▶ Publisher.publish(stored, removed)   one publish per KV event,
               naming no tail (run-granular publication with the fleet's publish_run_blocks: meta/runs.py)
               RESET (history lost, vLLM restarted) ─▶ every key removed, relearn from here
      tails:   (publish_run_blocks > 1) each BlockStored's last key waits in PendingTails until its chain
               has not grown for `tail_delay_s` (a request's next chunk or generated block continues it),
               then Publisher.publish(stored=due, tails=due); checked after each event batch and
               every tail_delay_s / 2. A tail removed before then is never published. vLLM says no
               "request ended", so a chain that stops growing is taken for one: one tail per request
      health:  GET /health every period; `max_failures` misses in a row ─▶ revoke the lease
               (etcd drops the record and every block now), clear; vLLM back ─▶ register again
               every `adapters_period_s`: /v1/models again; adapters loaded or unloaded at runtime
               (vLLM's /v1/load_lora_adapter) re-put the record
      load:    GET /metrics (requests waiting, running) ─▶ the record's load fields, as our workers do

If this sidecar dies, its lease expires and etcd drops the blocks by itself.
Knows nothing of the router or of how vLLM is started.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Sequence

import aiohttp
import msgspec

from prefixpool.meta.etcd_client import EtcdClient, EtcdUnavailable
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_report import report_load
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.meta.publisher import PublisherConfig
from prefixpool.meta.shards import node_index
from prefixpool.vllm_sidecar.event_stream import EventStream, Reset
from prefixpool.vllm_sidecar.ledger import Change, Ledger
from prefixpool.vllm_sidecar.metrics import sample_load, sample_num_blocks
from prefixpool.vllm_sidecar.tails import PendingTails
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
    adapters_period_s: float = 5.0  # how often vLLM's /v1/models is read again for its LoRA adapters


class ModelMismatch(ValueError):
    """vLLM serves another model than the node was told: the router would send it requests it cannot serve."""


class VllmNode:
    def __init__(self, client: EtcdClient | Sequence[EtcdClient], layout: Layout, record: NodeRecord,
                 namespace: Namespace, stream: EventStream, membership_config: MembershipConfig = MembershipConfig(),
                 health: HealthConfig = HealthConfig(),
                 publisher_config: PublisherConfig = PublisherConfig(),
                 tail_delay_s: float = 1.0) -> None:  # fmt: skip
        self.ledger = Ledger(namespace)
        # per block (run_blocks 1) every key is published anyway: no tails to wait for
        self.tails = PendingTails(tail_delay_s) if publisher_config.run_blocks > 1 else None
        self.stream, self.health = stream, health
        clients = [client] if isinstance(client, EtcdClient) else list(client)  # one per index shard, shard 0 first
        self.membership, self.publisher = node_index(clients, layout, record,
                                                     lambda: [(k, DEVICE) for k in self.ledger.all_keys()],
                                                     membership_config, publisher_config)  # fmt: skip
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
                if self.tails is not None:
                    group.create_task(self._follow_tails())
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
            self._publish_tails()

    def _publish(self, change: Change) -> None:
        if change.stored or change.removed:
            self.publisher.publish(stored=change.stored, removed=change.removed, tails=())
        self._follow_tails_of(change)

    def _follow_tails_of(self, change: Change) -> None:
        if self.tails is not None:
            self.tails.follow(change)

    def _publish_tails(self) -> None:
        """The pending tails whose chains stopped growing, each published as a tail."""
        if self.tails is not None and (due := self.tails.due()):
            self.publisher.publish(stored=due, tails=due)

    async def _follow_tails(self) -> None:
        assert self.tails is not None
        while True:
            await asyncio.sleep(self.tails.delay_s / 2)
            self._publish_tails()

    async def _follow_health(self) -> None:
        failures = 0
        adapters_every = max(1, round(self.health.adapters_period_s / self.health.period_s))
        for beat in itertools.count(1):
            healthy = await self._healthy()
            failures = 0 if healthy else failures + 1
            if healthy and not self.registered.is_set() and (adapters := await self._served_adapters()) is not None:
                num_blocks = await sample_num_blocks(self._session, self.vllm_url)  # None: 0, size not said
                self.membership.record = msgspec.structs.replace(self.membership.record, adapters=adapters,
                                                                 num_blocks=num_blocks or 0)
                await self._register()
            elif failures >= self.health.max_failures and self.registered.is_set():
                log.warning("vLLM at %s stopped answering: revoking node %s", self.vllm_url,
                            self.membership.record.node_id)
                self.registered.clear()
                self._follow_tails_of(self.ledger.clear())  # the lease's revocation deletes every key
                await self.membership.stop()
            elif healthy and self.registered.is_set() and beat % adapters_every == 0:
                await self._refresh_adapters()
            await asyncio.sleep(self.health.period_s)

    async def _register(self) -> None:
        """Register vLLM's node; etcd out of reach (down, or too slow to answer) leaves it for the next beat."""
        try:
            await self.membership.start()
        except EtcdUnavailable as error:
            log.warning("vLLM at %s is up but etcd is out of reach (%s): registering node %s at the next beat",
                        self.vllm_url, error, self.membership.record.node_id)
            return
        self.registered.set()
        log.info("vLLM at %s is up: node %s registered", self.vllm_url, self.membership.record.node_id)

    async def _refresh_adapters(self) -> None:
        adapters = await self._served_adapters()
        if adapters is not None and adapters != self.membership.record.adapters:
            log.info("vLLM at %s now serves LoRA adapters %s", self.vllm_url, list(adapters))
            self.membership.update_adapters(adapters)

    async def _served_adapters(self) -> tuple[str, ...] | None:
        """The LoRA adapters vLLM serves on our model (sorted); None when it could not be asked; ModelMismatch
        when it does not serve our model."""
        assert self._session is not None
        try:
            async with self._session.get(f"{self.vllm_url}/v1/models") as response:
                listed = [(m["id"], m.get("parent")) for m in (await response.json()).get("data", [])]
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            return None
        model = self.membership.record.model
        if (model, None) not in listed:
            raise ModelMismatch(f"vLLM at {self.vllm_url} serves {[name for name, _ in listed]}, not {model!r}: "
                                f"start it with --served-model-name {model}")
        return tuple(sorted(name for name, parent in listed if parent == model))

    async def _healthy(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.vllm_url}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
