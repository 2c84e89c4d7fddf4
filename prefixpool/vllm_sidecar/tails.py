"""The vLLM sidecar's chain tails, published once a chain stops growing (run-granular publication: meta/runs.py).

vLLM sends a BlockStored per request per scheduler step (each prefill chunk, each generated block that
fills) and never says that a request ended. A tail per event would cost an etcd put, and later a delete,
per chunk and per generated block; the chain a conversation's next turn shares is the request's whole one.
So each stored chain's last key waits here until the chain has not grown for `delay_s`:

    BlockStored (parent p, last key k)   pending[k] = now; p dropped (the chain went on past it)
    key removed (BlockRemoved, AllBlocksCleared, reset, health lost)   dropped: the node no longer holds it
    due()                                 the tails not grown for delay_s, and the oldest beyond max_pending:
                                          the caller publishes each as a tail

Knows nothing of etcd, sockets or vLLM's wire format.
"""

from __future__ import annotations

import time
from typing import Callable

from prefixpool.store.keys import BlockKey
from prefixpool.vllm_sidecar.ledger import Change

MAX_PENDING = 4096  # chains growing at once (requests running, or ended within delay_s) on one vLLM server


class PendingTails:
    def __init__(self, delay_s: float, max_pending: int = MAX_PENDING,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.delay_s, self.max_pending, self.clock = delay_s, max_pending, clock
        self._since: dict[BlockKey, float] = {}  # tail -> when its chain last grew; oldest first

    def __len__(self) -> int:
        return len(self._since)

    def follow(self, change: Change) -> None:
        """What the ledger learned from one event: removed keys are no tails, a stored chain's last key is one."""
        for key in change.removed:
            self._since.pop(key, None)
        if change.last is not None:
            self._since.pop(change.parent, None)
            self._since.pop(change.last, None)  # re-inserted last: the order stays oldest first
            self._since[change.last] = self.clock()

    def due(self) -> list[BlockKey]:
        """Take the tails whose chains have not grown for delay_s, and the oldest beyond max_pending."""
        cutoff, excess = self.clock() - self.delay_s, len(self._since) - self.max_pending
        due = []
        for key, since in self._since.items():
            if since > cutoff and len(due) >= excess:
                break
            due.append(key)
        for key in due:
            del self._since[key]
        return due
