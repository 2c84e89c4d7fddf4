"""A node's membership: its record in etcd under a lease that it keeps alive.

    register: grant lease L, put nodes/<id> = record under L (patient: etcd out of reach -> the loop
              registers when it answers)
    loop:     keepalive(L) every ttl/4; load changes re-put the record
    lost L:   (expired after a long stop, etcd restarted without data, revoked)
              -> rotate: new lease, record, on_rotate(new) re-publishes the blocks
    stop:     revoke L: etcd deletes the record and every block key at once

`rotate` is also how the publisher resyncs exactly: everything is re-put under
a fresh lease and the old one is revoked, which deletes only what was stale.
All writes under the lease hold `lock`, so no write lands on a lease being
retired. Knows nothing of the block pool or the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec

from prefixpool.meta.background import stop_task
from prefixpool.meta.etcd_client import EtcdClient, EtcdError, LeaseNotFound
from prefixpool.meta.layout import Layout

log = logging.getLogger(__name__)


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    http_url: str
    transfer_url: str
    block_size: int
    num_blocks: int
    model: str
    num_queued: int = 0
    num_running: int = 0
    prefill_tokens_per_s: float = 0.0
    load_time: float = 0.0  # wall clock (time.time()) when the load fields were sampled
    kind: str = "prefixpool"  # what serves at http_url: "prefixpool" (our worker API) or "vllm" (OpenAI API)
    namespace: str = ""  # hex root of the block-key namespace it hashes under ("" = not said)
    role: str = "both"  # prefill/decode disaggregation: "prefill", "decode" or "both" (serves whole requests)
    adapters: tuple[str, ...] = ()  # LoRA adapters served beside `model` (vLLM --lora-modules NAME=DIR)


def encode_record(record: NodeRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_record(raw: bytes) -> NodeRecord:
    """Raises msgspec.ValidationError / DecodeError on anything that is not a NodeRecord."""
    return msgspec.json.decode(raw, type=NodeRecord)


@dataclass(frozen=True)
class MembershipConfig:
    ttl_s: int = 10
    retry_s: float = 0.5

    @property
    def keepalive_s(self) -> float:
        return self.ttl_s / 4


async def _nothing(lease_id: int) -> None:
    return None


class Membership:
    def __init__(self, client: EtcdClient, layout: Layout, record: NodeRecord,
                 config: MembershipConfig = MembershipConfig()) -> None:  # fmt: skip
        self.client, self.layout, self.record, self.config = client, layout, record, config
        self.lease_id: int | None = None
        self.lock = asyncio.Lock()
        self.on_rotate: Callable[[int], Awaitable[None]] = _nothing
        self.num_rotations = 0
        self.revision = 0  # etcd revision of our latest write (record put, lease revoke)
        self._wake = asyncio.Event()
        self._record_dirty = False
        self._lost: int | None = None
        self._task: asyncio.Task | None = None

    async def start(self, *, patient: bool = False) -> None:
        """Register once, then keep the lease alive. etcd down or too slow to answer raises EtcdError, or
        with `patient` is logged and left to the background task, which registers when etcd answers."""
        try:
            await self.rotate()
        except EtcdError as error:
            if not patient:
                raise
            log.warning("node %s: etcd unavailable (%s); registering when it answers", self.record.node_id, error)
            self._wake.set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Revoke the lease: the record and all block keys leave etcd now, not after the TTL."""
        await stop_task(self._task)
        self._task = None
        async with self.lock:
            lease_id, self.lease_id = self.lease_id, None
            if lease_id is not None:
                try:
                    await self.client.revoke(lease_id)
                except EtcdError as error:
                    log.warning("revoke on stop failed (%s); the lease expires by itself", error)

    def update_load(self, num_queued: int, num_running: int, prefill_tokens_per_s: float) -> None:
        """Non-blocking: the record is re-put by the background task."""
        self.record = msgspec.structs.replace(self.record, num_queued=num_queued, num_running=num_running,
                                              prefill_tokens_per_s=prefill_tokens_per_s,
                                              load_time=time.time())  # fmt: skip
        self._record_dirty = True
        self._wake.set()

    def update_adapters(self, adapters: tuple[str, ...]) -> None:
        """Non-blocking: the LoRA adapters the node serves now; the record is re-put by the background task."""
        self.record = msgspec.structs.replace(self.record, adapters=adapters)
        self._record_dirty = True
        self._wake.set()

    def lease_lost(self, lease_id: int) -> None:
        """A writer saw LeaseNotFound for lease_id: rotate unless that lease was already replaced."""
        if lease_id == self.lease_id:
            self._lost = lease_id
            self._wake.set()

    async def rotate(self) -> None:
        """New lease, record under it, on_rotate(new) fills it, then the old lease is revoked."""
        async with self.lock:
            old = self.lease_id
            new = await self.client.grant(self.config.ttl_s)
            self._record_dirty = False
            node_key = self.layout.node_key(self.record.node_id)
            self.revision = await self.client.put(node_key, encode_record(self.record), new)
            self.lease_id = new
            await self.on_rotate(new)
            self.num_rotations += 1
            if old is not None:
                self.revision = max(self.revision, await self.client.revoke(old))
        log.info("node %s registered under lease %x", self.record.node_id, new)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.keepalive_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._step()
            except LeaseNotFound:
                self._lost = self.lease_id
                self._wake.set()
            except EtcdError as error:
                log.warning("etcd: %s; retrying in %.1fs", error, self.config.retry_s)
                await asyncio.sleep(self.config.retry_s)
                self._wake.set()

    async def _step(self) -> None:
        if self.lease_id is None:  # a patient start that etcd did not answer yet
            await self.rotate()
            return
        if self._lost is not None and self._lost == self.lease_id:
            log.warning("node %s lost lease %x; registering again", self.record.node_id, self._lost)
            await self.rotate()
            self._lost = None
            return
        assert self.lease_id is not None
        await self.client.keepalive(self.lease_id)
        if self._record_dirty:
            async with self.lock:
                self._record_dirty = False
                try:
                    self.revision = await self.client.put(self.layout.node_key(self.record.node_id),
                                                          encode_record(self.record), self.lease_id)  # fmt: skip
                except EtcdError:
                    self._record_dirty = True
                    raise
