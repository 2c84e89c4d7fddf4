"""The drain contract: admit requests until told to stop, then let the admitted ones finish by a deadline.

    gate = Drain()
    async with gate.admitted():          # raises Draining once a drain began: answer a 503 the caller retries
        async with gate.until_deadline():  # raises DrainDeadline past the deadline (the stream is cancelled);
            ...stream...                 #   the handler then ends its body with a clean error event
    gate.begin(deadline_s)               # SIGTERM: refuse new requests, arm the deadline on every stream
    report = await gate.wait()           # until nothing is admitted (bounded: deadline + grace)

    serving ──begin()──▶ draining: new requests 503 ──all admitted done──▶ idle (exit)
                              └── deadline ──▶ streams left end with an error event ──▶ idle

Both sides keep it: a worker's /generate and a router's OpenAI endpoints. A
draining process never cuts an admitted stream without a clean error event.
Knows nothing of HTTP, engines or etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator


class Draining(Exception):
    """A request arrived after the drain began: answer 503, the caller retries elsewhere."""


class DrainDeadline(Exception):
    """An admitted stream outlived the drain deadline: end it with an error event."""


@dataclass(frozen=True)
class DrainReport:
    seconds: float  # from begin() until nothing was admitted any more
    num_admitted: int  # requests in flight when the drain began
    num_cut: int  # of all requests, those ended by the deadline
    idle: bool  # False: handlers were still running when the grace ran out


class Drain:
    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s  # after the deadline: time for cut streams to write their error event
        self.serving = True
        self.num_cut = 0
        self._num_admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._deadline: float | None = None  # loop time; None while serving
        self._deadline_s = 0.0
        self._began = 0.0
        self._num_at_begin = 0
        self._timeouts: set[asyncio.Timeout] = set()

    @property
    def num_admitted(self) -> int:
        return self._num_admitted

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Count one request while it runs; refuse it with Draining once the drain began."""
        if not self.serving:
            raise Draining("draining for shutdown; retry on another instance")
        self._num_admitted += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_admitted -= 1
            if self._num_admitted == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def until_deadline(self) -> AsyncIterator[None]:
        """Run the body until it ends or the drain deadline passes (no deadline while serving)."""
        timeout = asyncio.timeout_at(self._deadline)
        self._timeouts.add(timeout)
        try:
            async with timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise
            self.num_cut += 1
            raise DrainDeadline(f"drain deadline ({self._deadline_s:g}s) passed before the stream finished") from None
        finally:
            self._timeouts.discard(timeout)

    def begin(self, deadline_s: float) -> None:
        """Refuse new requests from now on; streams still running end by `deadline_s` from now."""
        if not self.serving:
            return
        self.serving = False
        self._began = time.monotonic()
        self._num_at_begin = self._num_admitted
        self._deadline_s = deadline_s
        self._deadline = asyncio.get_running_loop().time() + deadline_s
        for timeout in self._timeouts:
            timeout.reschedule(self._deadline)

    async def wait(self) -> DrainReport:
        """Until nothing is admitted, or the deadline plus the grace passed."""
        assert not self.serving, "begin() first"
        try:
            remaining = self._deadline - asyncio.get_running_loop().time() + self.grace_s
            await asyncio.wait_for(self._idle.wait(), max(remaining, 0.0))
        except TimeoutError:
            pass
        return DrainReport(time.monotonic() - self._began, self._num_at_begin, self.num_cut, self._idle.is_set())
