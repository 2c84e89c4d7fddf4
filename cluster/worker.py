"""The worker service: one engine, its pool and arena, a transfer server and an etcd presence.

    generate(request)
      keys = chain(tokens)                       hashed at the edge, salted per tenant
      fetch plan? -> transfer.fetch(peer, keys[local:end])   (a hint: the peer re-checks;
                     failures cost a recompute, never an error)
      engine.submit(tokens, keys) -> events stream back; blocks stored / evicted are
      published to etcd by the publisher, off the request path

The engine's forward pass runs in a thread; every pool operation (engine
schedule/finish, transfer serving and fetching) stays on the event loop
thread. Knows nothing of HTTP: worker_http.py serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from cluster.batch import Batch, TokenEvent
from cluster.engine import Engine
from cluster.sampling import SamplingParams
from router.worker_api import Done, Event, Failed, GenerateRequest, Token, Usage, WorkerLoad
from store.keys import BlockKey, Namespace, chain
from transfer.errors import TransferError
from transfer.fetcher import Fetcher

log = logging.getLogger(__name__)


class BlockPublisher(Protocol):
    def publish(self, stored: list[BlockKey] = ..., removed: list[BlockKey] = ...) -> None: ...


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    fetched_tokens: int = 0
    fetched_bytes: int = 0
    pinned: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


class Worker:
    def __init__(self, engine: Engine, namespace: Namespace, publisher: BlockPublisher, fetcher: Fetcher,
                 fetch_timeout_s: float = 5.0) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.arena = engine.arena
        self.namespace = namespace
        self.publisher = publisher
        self.fetcher = fetcher
        self.fetch_timeout_s = fetch_timeout_s
        self._streams: dict[int, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._prefill_tokens = 0
        self._prefill_seconds = 0.0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for request_id in list(self._streams):
            self._release(request_id)

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        keys = chain(request.tokens, self.namespace.with_salt(request.cache_salt))
        stream = _Stream()
        if request.fetch is not None:
            await self._fetch(request, keys, stream)
        try:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, seed=request.seed, ignore_eos=request.ignore_eos)
            request_id = self.engine.submit(request.tokens, params, keys=keys)
        except ValueError as err:  # bad sampling values, or a request that can never fit this worker
            self.pool.free(stream.pinned)
            yield Failed(str(err), 400)
            return
        self._streams[request_id] = stream
        self._wake.set()
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if not isinstance(event, Token):
                    return
        finally:
            self._release(request_id)

    async def _fetch(self, request: GenerateRequest, keys: list[BlockKey], stream: _Stream) -> None:
        plan = request.fetch
        local = len(self.pool.match(keys))
        end = min(plan.end, len(keys))
        if end <= local:
            return
        try:
            result = await self.fetcher.fetch(plan.transfer_url, keys[local:end], self.pool, self.arena,
                                              deadline_s=self.fetch_timeout_s)
        except TransferError as err:
            log.warning("fetch from %s failed (%s); recomputing", plan.peer, err)
            self.publisher.publish(stored=list(err.stored or ()), removed=list(err.evicted or ()))
            return
        self.publisher.publish(stored=result.keys, removed=result.evicted)
        stream.pinned = result.block_ids  # held until the request ends, so admission finds them
        stream.fetched_tokens = len(result.keys) * self.namespace.block_size
        stream.fetched_bytes = result.num_bytes

    def _release(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort(request_id)  # a no-op once the request has finished
        self.pool.free(stream.pinned)
        stream.pinned = []

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
            stream.queue.put_nowait(Token(event.token))
            if event.finished:
                stream.queue.put_nowait(self._done(event, stream))

    def _done(self, event: TokenEvent, stream: _Stream) -> Done:
        stats = event.stats
        fetched = min(stream.fetched_tokens, stats.num_cached_tokens)
        return Done(event.finish_reason, Usage(
            prompt_tokens=stats.num_prompt_tokens, completion_tokens=stats.num_output_tokens,
            local_hit_tokens=stats.num_cached_tokens - fetched, fetched_tokens=fetched,
            computed_tokens=stats.num_computed_tokens, fetched_bytes=stream.fetched_bytes,
            ttft_s=stats.ttft_s or (time.perf_counter() - stream.started)))

    def _note_speed(self, batch: Batch, seconds: float) -> None:
        """Tokens through the model per second: the prefill speed the router's cost model uses."""
        self._prefill_tokens += sum(span.end - span.start for span in batch.spans)
        self._prefill_seconds += seconds

    def _publish_pool_events(self) -> None:
        stored, evicted = self.engine.take_pool_events()
        if stored or evicted:
            self.publisher.publish(stored=stored, removed=evicted)

    # -- load and health --------------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        speed = self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0
        return WorkerLoad(self.engine.num_queued, self.engine.num_running, self.pool.num_free, speed)

    def pool_report(self) -> dict:
        """The pool's invariants and pins (GET /debug/pool): at rest, no block may stay pinned."""
        try:
            self.pool.check_integrity()
            integrity = "ok"
        except AssertionError as err:
            integrity = str(err) or "integrity check failed"
        return {"integrity": integrity, "num_blocks": self.pool.num_blocks, "num_free": self.pool.num_free,
                "num_cached": self.pool.num_cached, "num_pinned": sum(1 for c in self.pool.ref_count if c > 0),
                "num_streams": len(self._streams), "num_queued": self.engine.num_queued,
                "num_running": self.engine.num_running}
