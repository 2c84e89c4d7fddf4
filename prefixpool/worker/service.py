"""The worker service: one engine over the node's blocks, fed by the node core's exchange.

    generate(request)
      keys = chain(tokens)                       hashed at the edge, salted per tenant
      fetch plan? -> exchange.fetch(peer, keys[local:end])   (a hint: the peer re-checks;
                     failures cost a recompute, never an error). With fetch_while_queued the
                     request is queued first, held, and released when the fetch ends, so the
                     transfer overlaps the wait behind other requests instead of preceding it
      blocks.promote(keys)  the run found in host memory or on the SSD is copied up
      engine.submit(tokens, keys) -> events stream back; every key whose tier changed
      is published (exchange.publish: each key in its fastest tier), off the request path

What a request fetched or promoted is held (a Hold of the node's blocks) until
the request ends. Admin pins (pin/unpin) hold a prefix's device blocks for a
TTL; with a soft-pin budget the most hit prefixes are pinned by themselves.

The engine's forward pass runs in a thread; every block operation (engine
schedule/finish, transfer serving and fetching) stays on the event loop
thread. The transfer server, the etcd lease and SSD collection are the node
core's (prefixpool/node/core.py). Knows nothing of HTTP: http_api.py serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from prefixpool.engine.batch import Batch, TokenEvent
from prefixpool.engine.scheduler import Engine
from prefixpool.contract.worker_api import Done, Event, Failed, FetchPlan, GenerateRequest, Token, Usage, WorkerLoad
from prefixpool.node.exchange import BlockExchange
from prefixpool.worker.handoff import HandoffStats, receive
from prefixpool.store.keys import BlockKey, chain
from prefixpool.store.node_blocks import Hold
from prefixpool.store.tier_names import DEVICE

log = logging.getLogger(__name__)


class PinRefused(ValueError):
    """An admin pin that names no full block."""


@dataclass(frozen=True)
class WorkerPeriods:
    soft_refresh_s: float = 10.0


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    fetched_tokens: int = 0
    fetched_bytes: int = 0
    holds: list[Hold] = field(default_factory=list)
    promoted_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    handoff_s: float = 0.0


class Worker:
    def __init__(self, engine: Engine, exchange: BlockExchange, fetch_timeout_s: float = 5.0,
                 periods: WorkerPeriods = WorkerPeriods(), fetch_while_queued: bool = True) -> None:
        assert exchange.blocks is engine.blocks, "the exchange must move the engine's own blocks"
        self.engine = engine
        self.blocks = engine.blocks
        self.namespace = engine.namespace
        self.exchange = exchange
        self.fetch_timeout_s = fetch_timeout_s
        self.fetch_while_queued = fetch_while_queued
        self._streams: dict[int, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.periods = periods
        self._tasks: list[asyncio.Task] = []
        self._prefill_tokens = 0
        self._prefill_seconds = 0.0
        self.handoffs = HandoffStats()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")
        if self.blocks.pins.soft_budget_blocks:
            self._tasks.append(asyncio.create_task(self._refresh_soft_pins(), name="soft-pins"))

    async def stop(self) -> None:
        for task in [t for t in (self._loop_task, *self._tasks) if t is not None]:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for request_id in list(self._streams):
            self._release(request_id)

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        keys = chain(request.tokens, self.namespace.with_salt(request.cache_salt))
        stream = _Stream()
        overlap = request.fetch is not None and self.fetch_while_queued
        if request.fetch is not None and not overlap:
            await self._fetch(request, keys, stream)
        if not overlap:
            self._prepare_blocks(keys, stream)
        try:
            request_id = self.engine.submit(request.token_list(), request.sampling, keys=keys, deferred=overlap)
        except ValueError as err:  # bad sampling values, or a request that can never fit this worker
            self._release_holds(stream)
            yield Failed(str(err), 400)
            return
        self._streams[request_id] = stream
        try:
            if overlap:  # queued from now on; admission waits for the fetch to end
                await self._fetch(request, keys, stream)
                self._prepare_blocks(keys, stream)
                self.engine.resume(request_id)
            self._wake.set()
            while True:
                event = await stream.queue.get()
                yield event
                if not isinstance(event, Token):
                    return
        finally:
            self._release(request_id)

    def _prepare_blocks(self, keys: list[BlockKey], stream: _Stream) -> None:
        self._promote(keys, stream)
        self.blocks.pins.record_hits(keys[: len(self.blocks.match(keys))])

    async def _fetch(self, request: GenerateRequest, keys: list[BlockKey], stream: _Stream) -> None:
        plan = request.fetch
        local = len(self.blocks.match(keys))
        end = min(plan.end, len(keys))
        if plan.wait_s > 0:  # a handoff: the peer is a prefill node still computing these blocks
            await self._receive(plan, keys, end, stream)
            return
        if end <= local:
            return
        fetched = await self.exchange.fetch(plan.transfer_url, keys[local:end], self.fetch_timeout_s)
        if fetched.hold is None:  # failed: what arrived is cached, unheld; the rest is recomputed
            return
        stream.holds.append(fetched.hold)  # held until the request ends, so admission finds them
        stream.fetched_tokens = fetched.num_blocks * self.namespace.block_size
        stream.fetched_bytes = fetched.num_bytes

    async def _receive(self, plan: FetchPlan, keys: list[BlockKey], end: int, stream: _Stream) -> None:
        """Fetch the prefill node's blocks as it commits them (worker/handoff.py); what never came is computed."""
        received = await receive(self.exchange, keys, plan.transfer_url, end, wait_s=plan.wait_s,
                                 fetch_timeout_s=self.fetch_timeout_s)
        stream.holds.extend(received.holds)
        stream.fetched_tokens = received.num_blocks * self.namespace.block_size
        stream.fetched_bytes = received.num_bytes
        stream.handoff_s = time.perf_counter() - stream.started
        self.handoffs.observe(received, stream.handoff_s)
        if not received.complete:
            log.warning("handoff from %s: %d of %d blocks arrived; computing the rest here", plan.peer,
                        len(self.blocks.match(keys[:end])), end)

    def _promote(self, keys: list[BlockKey], stream: _Stream) -> None:
        """Copy the host/SSD run after the device prefix up, and hold it until the request ends."""
        promoted = self.blocks.promote(keys).stored.get(DEVICE, [])
        if not promoted:
            return
        stream.holds.append(self.blocks.acquire(keys))
        stream.promoted_tokens = len(promoted) * self.namespace.block_size
        self.exchange.publish_changes()

    def _release(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort(request_id)  # a no-op once the request has finished
        self._release_holds(stream)

    def _release_holds(self, stream: _Stream) -> None:
        for hold in stream.holds:
            self.blocks.release(hold)
        stream.holds = []

    # -- the engine loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_work():
                try:
                    await self._step()
                except Exception as err:  # a bug in a step must fail its requests, not hang them
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {err!r}")
                self._publish_pool_events()

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(Failed(message, 500))
            self.engine.abort(request_id)

    async def _step(self) -> None:
        batch = self.engine.schedule()
        for request_id, reason in self.engine.take_refused():
            if request_id in self._streams:
                self._streams[request_id].queue.put_nowait(Failed(reason, 503))
        if not batch.spans:  # waiting for blocks that running requests still pin
            await asyncio.sleep(0.005)
            return
        began = time.perf_counter()
        try:
            result = await asyncio.to_thread(self.engine.forward, batch)
        except Exception as err:  # e.g. out of device memory: fail this batch's requests, keep serving
            log.exception("forward pass failed")
            for request_id in self.engine.fail(batch):
                if request_id in self._streams:
                    self._streams[request_id].queue.put_nowait(Failed(f"forward pass failed: {err!r}", 500))
            return
        self._note_speed(batch, time.perf_counter() - began)
        for event in self.engine.finish(batch, result):
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(_token(event))
            if event.finished:
                stream.queue.put_nowait(self._done(event, stream))
        for request_id, reason in self.engine.take_failed():  # its span failed alone; the batch ran on
            if request_id in self._streams:
                self._streams[request_id].queue.put_nowait(Failed(reason, 500))

    def _done(self, event: TokenEvent, stream: _Stream) -> Done:
        stats = event.stats
        fetched = min(stream.fetched_tokens, stats.num_cached_tokens)
        return Done(event.finish_reason, Usage(
            prompt_tokens=stats.num_prompt_tokens, completion_tokens=stats.num_output_tokens,
            local_hit_tokens=stats.num_cached_tokens - fetched, fetched_tokens=fetched,
            computed_tokens=stats.num_computed_tokens, fetched_bytes=stream.fetched_bytes,
            ttft_s=stats.ttft_s or (time.perf_counter() - stream.started), handoff_s=stream.handoff_s))

    def _note_speed(self, batch: Batch, seconds: float) -> None:
        """Tokens through the model per second: the prefill speed the router's cost model uses."""
        self._prefill_tokens += sum(span.end - span.start for span in batch.spans)
        self._prefill_seconds += seconds

    def _publish_pool_events(self) -> None:
        stored, evicted, tails = self.engine.take_pool_events()  # tails: the last key stored by each request that ended
        self.exchange.publish([*stored, *evicted, *self.blocks.take_changes().keys()], tails)

    async def _refresh_soft_pins(self) -> None:
        while True:
            await asyncio.sleep(self.periods.soft_refresh_s)
            self.blocks.refresh_soft()

    # -- admin pins ----------------------------------------------------------------------------

    def pin(self, tokens: list[int], cache_salt: str, ttl_s: float, name: str = "") -> dict:
        """Pin the prefix's device blocks for `ttl_s` (promoting what host/SSD hold; the rest pins on commit)."""
        keys = chain(tokens, self.namespace.with_salt(cache_salt))
        if not keys:
            raise PinRefused(f"{len(tokens)} tokens make no full block of {self.namespace.block_size}")
        if self.blocks.promote(keys):
            self.exchange.publish_changes()
        name = name or keys[-1].hex()
        held = self.blocks.pin(name, keys, ttl_s)
        return {"name": name, "num_blocks": len(keys), "num_held": len(held)}

    def unpin(self, name: str = "", tokens: list[int] | None = None, cache_salt: str = "") -> str | None:
        """Release a named pin (by its name, or the prefix it was made from); the name, or None if none was held."""
        if not name and tokens:
            keys = chain(tokens, self.namespace.with_salt(cache_salt))
            name = keys[-1].hex() if keys else ""
        return name if self.blocks.unpin(name) else None

    # -- load and health --------------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        speed = self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0
        return WorkerLoad(self.engine.num_queued, self.engine.num_running, self.blocks.num_free, speed)

    def pool_report(self) -> dict:
        """The node's block invariants and pins (GET /debug/pool): at rest, no block may stay pinned."""
        pool = self.blocks.pool
        try:
            self.blocks.check_integrity()
            integrity = "ok"
        except AssertionError as err:
            integrity = str(err) or "integrity check failed"
        return {"integrity": integrity, "num_blocks": pool.num_blocks, "num_free": pool.num_free,
                "num_cached": pool.num_cached, "num_pinned": sum(1 for c in pool.ref_count if c > 0),
                "num_streams": len(self._streams), "num_queued": self.engine.num_queued,
                "num_running": self.engine.num_running, "handoff": self.handoffs.report()}


def _token(event: TokenEvent) -> Token:
    """The wire event of a sampled token, with its logprobs when the request asked."""
    logprobs = event.logprobs
    return Token(event.token) if logprobs is None else Token(event.token, logprobs.logprob, logprobs.top)
