"""Work the router has in flight per worker: the load term of every routing decision.

    begin(worker, prefill_tokens) -> ticket   (queued: counts toward queue wait)
    started(ticket)                           (first token seen: prefill done, now decoding)
    end(ticket)                               (finished, failed or cancelled)

The router counts its own requests instead of polling workers, so a burst
of arrivals sees the load it is creating. `on_change` wakes whoever publishes
the snapshot to the other routers (prefixpool.meta.fleet_load). Knows nothing of HTTP
or etcd.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True)
class WorkerInflight:
    queued_prefill_tokens: int = 0
    num_queued: int = 0
    num_running: int = 0
    # an etcd revision ordered after our latest end here: the put that published it (prefixpool.meta.fleet_load),
    # or a read of etcd's revision right after it (a lone router's); None while an end is not yet ordered. A
    # worker's own load report is newer than our count only past it: an older report may still count a request
    # of ours that ended. A begin needs no such point: a report that misses our new request is only below our own
    # count, which includes it.
    published_revision: int | None = 0


IDLE = WorkerInflight()  # what load_of answers for a worker this router has never sent work to; never mutated


@dataclass(slots=True)
class _Ticket:
    worker: str
    prefill_tokens: int
    started: bool = False


@dataclass
class InflightTracker:
    _workers: dict[str, WorkerInflight] = field(default_factory=dict)
    _tickets: dict[int, _Ticket] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
    on_change: Callable[[], None] = lambda: None
    # worker -> block keys routed there and not yet in its KV events, published beside the load (the `pressure`
    # policy's speculative entries; nothing for the other policies)
    routed: Callable[[], dict[str, list[bytes]]] = dict

    def begin(self, worker: str, prefill_tokens: int) -> int:
        ticket_id = next(self._ids)
        self._tickets[ticket_id] = _Ticket(worker, prefill_tokens)
        load = self._workers.setdefault(worker, WorkerInflight())
        load.queued_prefill_tokens += prefill_tokens
        load.num_queued += 1
        self.on_change()
        return ticket_id

    def started(self, ticket_id: int) -> None:
        ticket = self._tickets[ticket_id]
        if ticket.started:
            return
        ticket.started = True
        load = self._workers[ticket.worker]
        load.queued_prefill_tokens -= ticket.prefill_tokens
        load.num_queued -= 1
        load.num_running += 1
        self.on_change()

    def end(self, ticket_id: int) -> None:
        ticket = self._tickets.pop(ticket_id)
        load = self._workers[ticket.worker]
        if ticket.started:
            load.num_running -= 1
        else:
            load.queued_prefill_tokens -= ticket.prefill_tokens
            load.num_queued -= 1
        load.published_revision = None
        self.on_change()

    def load_of(self, worker: str) -> WorkerInflight:
        """Read only: a worker with nothing in flight gets the shared IDLE record (one per decision and worker)."""
        return self._workers.get(worker, IDLE)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """worker -> (requests in flight, queued prefill tokens), idle workers left out."""
        return {worker: self._entry(load) for worker, load in self._workers.items()
                if load.num_queued or load.num_running}

    def unpublished(self) -> bool:
        """Some end is not yet ordered by etcd (a put or a read), even where the load went back to what etcd holds."""
        return any(load.published_revision is None for load in self._workers.values())

    def published(self, snapshot: dict[str, tuple[int, int]], revision: int) -> None:
        """`snapshot` went to etcd at `revision` (or was current when etcd answered that revision to a read):
        workers unchanged since it was taken have their ends ordered."""
        for worker, load in self._workers.items():
            if load.published_revision is None and snapshot.get(worker, (0, 0)) == self._entry(load):
                load.published_revision = revision

    @staticmethod
    def _entry(load: WorkerInflight) -> tuple[int, int]:
        return load.num_queued + load.num_running, load.queued_prefill_tokens

    def check_integrity(self) -> None:
        expected: dict[str, WorkerInflight] = {}
        for ticket in self._tickets.values():
            load = expected.setdefault(ticket.worker, WorkerInflight())
            if ticket.started:
                load.num_running += 1
            else:
                load.num_queued += 1
                load.queued_prefill_tokens += ticket.prefill_tokens
        for worker, load in self._workers.items():
            want = expected.get(worker, WorkerInflight())
            got = (load.queued_prefill_tokens, load.num_queued, load.num_running)
            assert got == (want.queued_prefill_tokens, want.num_queued, want.num_running), f"{worker}: {load} != {want}"
