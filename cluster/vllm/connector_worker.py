"""The connector's worker side: load planned prefixes into vLLM's paged KV, save completed blocks to the pool.

    register_kv_caches(caches)  PagedKV over vLLM's layer tensors; the pool node starts (server, lease)
    load(ops)        before the forward pass: per request, the pool's longest intact prefix -> vLLM blocks;
                     the planned blocks that did not arrive -> invalid (vLLM recomputes from the first)
    save(ops)        after the forward pass: each op's blocks up to the first invalid one -> the pool
    take_invalid()   the invalid vLLM block ids of this step, once

A load runs under a deadline of its own (the fetch's plus a margin): past it
the whole op counts as failed, never a hang of vLLM's engine loop. Knows
nothing of vLLM's scheduler.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch

from cluster.vllm.connector_config import ConnectorConfig
from cluster.vllm.connector_scheduler import LoadOp, SaveOp
from cluster.vllm.loop_thread import LoopThread
from cluster.vllm.paged_kv import PagedKV
from cluster.vllm.pool_node import PoolNode
from store.keys import Namespace

log = logging.getLogger(__name__)
MARGIN_S = 2.0  # beyond the fetch deadline: the local copy into vLLM's blocks


class WorkerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace) -> None:
        self.config, self.namespace = config, namespace
        self.node: PoolNode | None = None
        self._loop: LoopThread | None = None
        self._invalid: set[int] = set()
        self.num_loaded_blocks = self.num_fetched_blocks = self.num_fetched_bytes = self.num_saved_blocks = 0

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        paged = PagedKV(kv_caches, num_blocks, self.namespace.block_size)
        self._loop = LoopThread("prefixpool-pool")
        self.node = PoolNode(self.config, paged, self.namespace)
        self._loop.run(self.node.start())

    def close(self) -> None:
        if self._loop is not None and self.node is not None:
            self._loop.run(self.node.stop())
            self._loop.close()

    def load(self, ops: Sequence[LoadOp]) -> None:
        for op in ops:
            try:
                loaded = self._loop.run(self.node.load(op.keys, op.first, op.block_ids, op.peer_url),
                                        self.config.fetch_timeout_s + MARGIN_S)
            except TimeoutError:
                log.warning("load for %s passed its deadline: %d blocks recomputed", op.request_id, len(op.block_ids))
                self._invalid.update(op.block_ids)
                continue
            num_new = max(0, loaded.num_blocks - op.first)
            self._invalid.update(op.block_ids[num_new:])
            self.num_loaded_blocks += num_new
            self.num_fetched_blocks += loaded.num_fetched
            self.num_fetched_bytes += loaded.num_bytes
            log.info("prefixpool load %s: %d of %d blocks (%d fetched from %s, %d bytes), %d to recompute",
                     op.request_id, num_new, len(op.block_ids), loaded.num_fetched, op.peer_url or "-",
                     loaded.num_bytes, len(op.block_ids) - num_new)

    def save(self, ops: Sequence[SaveOp]) -> None:
        for op in ops:
            good = next((i for i, block in enumerate(op.block_ids) if block in self._invalid), len(op.block_ids))
            if good:
                self.num_saved_blocks += self._loop.run(self.node.save(op.keys[:good], op.block_ids[:good]))

    def take_invalid(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
