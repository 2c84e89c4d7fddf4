"""Other routers' in-flight work, as each publishes it to etcd: the fleet's share of a worker's load.

    router R puts  /prefixpool/<ns>/routers/<R>  = RouterLoad{url, worker: [requests, queued prefill tokens],
                                                             routed: {worker: [block keys]}}
                   under R's own lease, coalesced (one put per period at most, only when it changed)
    every router:  load(W) = its own live in-flight on W + sum over the other routers' entries for W
                   routed(keys) = per worker, keys[0..n) that other routers just sent there and its KV
                   events may not show yet (their speculative entries, prefixpool.router.speculative),
                   for routed_ttl_s after the entry arrived

Entries are replaced in etcd revision order (the mirror applies watch events in order; an
entry older than the one held is ignored), never compared by wall clocks. A router that dies
stops renewing its lease and etcd deletes its entry: its share vanishes by itself. Knows
nothing of etcd clients, HTTP or policies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgspec


class RouterLoad(msgspec.Struct, frozen=True):
    """One router's in-flight work per worker: worker -> (requests, queued prefill tokens), and where it serves."""

    router_id: str
    workers: dict[str, tuple[int, int]] = {}
    url: str = ""  # the router's advertised http URL ("" from routers that predate it)
    routed: dict[str, list[bytes]] = {}  # worker -> block keys sent there, not yet confirmed by its KV events


_decoder = msgspec.json.Decoder(RouterLoad)


def encode_load(load: RouterLoad) -> bytes:
    return msgspec.json.encode(load)


def decode_load(raw: bytes) -> RouterLoad:
    """Raises msgspec.ValidationError / DecodeError on anything that is not a RouterLoad."""
    return _decoder.decode(raw)


@dataclass(slots=True)
class _Entry:
    load: RouterLoad
    revision: int
    received_at: float = 0.0  # time.monotonic() when this router took it: routed keys age from here
    routed: dict[str, set[bytes]] = field(default_factory=dict)


@dataclass
class FleetLoad:
    """The latest RouterLoad of every live router, each with the etcd revision that wrote it."""

    _entries: dict[str, _Entry] = field(default_factory=dict)
    routed_ttl_s: float = 5.0
    clock: Callable[[], float] = time.monotonic

    def put(self, load: RouterLoad, revision: int) -> bool:
        """Keep `load` unless a later revision is already held; True when it was kept."""
        held = self._entries.get(load.router_id)
        if held is not None and held.revision > revision:
            return False
        routed = {worker: set(keys) for worker, keys in load.routed.items() if keys}
        self._entries[load.router_id] = _Entry(load, revision, self.clock(), routed)
        return True

    def delete(self, router_id: str) -> None:
        self._entries.pop(router_id, None)

    def routers(self) -> dict[str, int]:
        """Router id -> revision of its entry."""
        return {router_id: entry.revision for router_id, entry in self._entries.items()}

    def active(self, exclude: str, within_s: float) -> int:
        """Routers but `exclude` that have work in flight or changed their entry within `within_s`: the ones
        that read the others' entries to decide (an idle router's entry stays as it is, empty)."""
        recent = self.clock() - within_s
        return sum(1 for router_id, entry in self._entries.items() if router_id != exclude and (
            entry.received_at >= recent or any(num for num, _ in entry.load.workers.values())))

    def share(self, worker: str, exclude: str = "") -> tuple[int, int]:
        """(requests, queued prefill tokens) on `worker` summed over every router but `exclude`."""
        requests = tokens = 0
        for router_id, entry in self._entries.items():
            if router_id != exclude:
                num, queued = entry.load.workers.get(worker, (0, 0))
                requests += num
                tokens += queued
        return requests, tokens

    def routed(self, keys: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """Per worker, how many keys from keys[0] on routers other than `exclude` sent there lately (0 omitted)."""
        found: dict[str, int] = {}
        oldest = self.clock() - self.routed_ttl_s
        for router_id, entry in self._entries.items():
            if router_id == exclude or not entry.routed or entry.received_at < oldest:
                continue
            for worker, held in entry.routed.items():
                n = 0
                while n < len(keys) and keys[n] in held:
                    n += 1
                if n > found.get(worker, 0):
                    found[worker] = n
        return found
