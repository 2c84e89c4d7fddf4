"""The connector's worker side: load planned prefixes into vLLM's paged KV, save completed blocks to the pool.

    register_kv_caches(caches)  PagedKV over vLLM's layer tensors; the pool node starts (server, lease)
    load(ops)        start_load_kv: each op in one of two ways
        background   (blocks from a peer, vLLM waits with the request in WAITING_FOR_REMOTE_KVS)
                     fetch + copy run on the pool's loop; finished_loads() reports the request once
                     its blocks are in vLLM's cache, or once the attempt ended; vLLM's other requests
                     keep running meanwhile
        layer-wise   (this node's own pool: host arena, SSD) the prefix is held now, and the copy goes
                     a layer at a time on the copy thread; wait_for_layer(name) waits for one layer
    save(ops)        wait_for_save: the step's layer-wise copies done, holds released; then each op's
                     blocks up to the first invalid one -> the pool
    clear()          vLLM reset the connector's cache: the pool forgets every block (before this step's loads)
    take_invalid()   the invalid vLLM block ids (vLLM recomputes from the first), once; for a background
                     load they come in the same call as its request's finish, as vLLM asks

Every load has a deadline (the fetch's plus a margin). A background load past
it is given up only if its copy has not started (Claim: the pool's loop thread
or vLLM's recompute writes the blocks, never both); a layer-wise load whose
prefix is not held by then loads nothing. Never a hang of vLLM's engine loop.
Knows nothing of vLLM's scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prefixpool.vllm_connector.config import ConnectorConfig
from prefixpool.vllm_connector.scheduler import LoadOp, SaveOp
from prefixpool.vllm_connector.layer_load import LayerLoad
from prefixpool.vllm_connector.loop_thread import LoopThread
from prefixpool.vllm_connector.paged_kv import PagedKV
from prefixpool.vllm_connector.pool_node import Loaded, PoolNode, Prepared
from prefixpool.store.keys import Namespace

log = logging.getLogger(__name__)
MARGIN_S = 2.0  # beyond the fetch deadline: the local copy into vLLM's blocks


class Claim:
    """Who writes a background load's vLLM blocks: the copy, or (past the deadline) vLLM's recompute."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: str | None = None

    def take(self, owner: str) -> bool:
        with self._lock:
            self._owner = self._owner or owner
            return self._owner == owner

    def for_copy(self) -> bool:
        return self.take("copy")


@dataclass
class _Background:
    op: LoadOp
    future: concurrent.futures.Future
    claim: Claim
    deadline: float

    def ended(self) -> bool:
        return self.future.done() or (time.monotonic() > self.deadline and self.claim.take("recompute"))

    def outcome(self) -> Loaded | None:
        """What arrived; None when nothing did (deadline, or an error the log names)."""
        if not self.future.done() or self.future.cancelled():
            return None
        if self.future.exception() is not None:
            log.warning("load for %s failed: %r", self.op.request_id, self.future.exception())
            return None
        return self.future.result()


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace) -> None:
        self.config, self.namespace = config, namespace
        self.node: PoolNode | None = None
        self._loop: LoopThread | None = None
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixpool-copy")
        self._invalid: set[int] = set()
        self._background: dict[str, _Background] = {}
        self._layer_load: LayerLoad | None = None
        self._held: list[Prepared] = []
        self.num_loaded_blocks = self.num_fetched_blocks = self.num_fetched_bytes = self.num_saved_blocks = 0

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        paged = PagedKV(kv_caches, num_blocks, self.namespace.block_size)
        self._loop = LoopThread("prefixpool-pool")
        self.node = PoolNode(self.config, paged, self.namespace)
        self._loop.run(self.node.start())

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        if self._loop is not None and self.node is not None:
            self._loop.run(self.node.stop())
            self._loop.close()

    @property
    def deadline_s(self) -> float:
        return self.config.fetch_timeout_s + MARGIN_S

    def clear(self) -> None:
        num = self._loop.run(self.node.clear())
        log.info("prefixpool pool cleared: %d blocks forgotten (vLLM reset the connector's cache)", num)

    def load(self, ops: Sequence[LoadOp]) -> None:
        for op in ops:
            if op.background:
                claim = Claim()
                future = self._loop.submit(self.node.load(op.keys, op.first, op.block_ids, op.peer_url, claim.for_copy))
                self._background[op.request_id] = _Background(op, future, claim, time.monotonic() + self.deadline_s)
        now = [op for op in ops if not op.background]
        if now:
            self._start_layer_load(now)

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose background load ended since the last call (all blocks, some, or none);
        with `wait_s`, first waits that long at most for one to end, if any is under way."""
        if wait_s and self._background:
            running = [job.future for job in self._background.values()]
            concurrent.futures.wait(running, wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        ended = {request_id for request_id, job in self._background.items() if job.ended()}
        for request_id in ended:
            job = self._background.pop(request_id)
            self._account(job.op, job.outcome())
        return ended

    def _start_layer_load(self, ops: Sequence[LoadOp]) -> None:
        pool_ids: list[int] = []
        vllm_ids: list[int] = []
        for op in ops:
            prepared = self._prepare(op)
            if prepared is not None:
                self._held.append(prepared)
                num_new = prepared.num_new(op.first)
                pool_ids += prepared.hold.block_ids[op.first: op.first + num_new]
                vllm_ids += op.block_ids[:num_new]
            self._account(op, prepared.loaded() if prepared is not None else None)
        self._layer_load = LayerLoad(self.node.paged, self.node.arena, pool_ids, vllm_ids, self._copier)

    def _prepare(self, op: LoadOp) -> Prepared | None:
        """The op's prefix held in the pool, or None past the deadline (then released whenever it comes)."""
        future = self._loop.submit(self.node.prepare(op.keys, op.peer_url))
        try:
            return future.result(self.deadline_s)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(self._release_late)
            return None

    def _release_late(self, future: concurrent.futures.Future) -> None:
        """On the pool's loop (where the future completes): a hold nobody will copy from."""
        if not future.cancelled() and future.exception() is None:
            self.node.release(future.result())

    def _account(self, op: LoadOp, loaded: Loaded | None) -> None:
        if loaded is None:
            log.warning("load for %s failed or passed its deadline: %d blocks recomputed", op.request_id,
                        len(op.block_ids))
            self._invalid.update(op.block_ids)
            return
        num_new = max(0, loaded.num_blocks - op.first)
        self._invalid.update(op.block_ids[num_new:])
        self.num_loaded_blocks += num_new
        self.num_fetched_blocks += loaded.num_fetched
        self.num_fetched_bytes += loaded.num_bytes
        log.info("prefixpool load %s: %d of %d blocks (%d fetched from %s, %d bytes), %d to recompute%s",
                 op.request_id, num_new, len(op.block_ids), loaded.num_fetched, op.peer_url or "-",
                 loaded.num_bytes, len(op.block_ids) - num_new, " [background]" if op.background else "")

    def wait_for_layer(self, layer_name: str) -> None:
        if self._layer_load is not None:
            self._layer_load.wait(layer_name)

    def _end_layer_load(self) -> None:
        layer_load, self._layer_load = self._layer_load, None
        if layer_load is None:
            return
        layer_load.join()
        held, self._held = self._held, []
        for prepared in held:
            self._loop.call(self.node.release, prepared)
        log.info("prefixpool layer-wise load: %d blocks, %d of %d layers waited for by the forward pass",
                 layer_load.num_blocks, len(layer_load.waited), layer_load.num_layers)

    def save(self, ops: Sequence[SaveOp]) -> None:
        self._end_layer_load()
        for op in ops:
            good = next((i for i, block in enumerate(op.block_ids) if block in self._invalid), len(op.block_ids))
            if good:
                self.num_saved_blocks += self._loop.run(self.node.save(op.keys[:good], op.block_ids[:good]))

    def take_invalid(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
