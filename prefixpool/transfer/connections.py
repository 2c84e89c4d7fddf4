"""Reused connections per peer, shared by both transports.

    ask(address, exchange):  take an idle connection (or open one), run `exchange` on it;
                             a reused connection that breaks was stale: close it, retry
                             once on a fresh one. A fresh one that breaks is PeerUnreachable.
    give_back(address, conn, reusable): keep it for the next fetch, or discard it.

Knows nothing of sockets or UCX endpoints: the transport passes how to open,
discard and recognise a broken connection.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Awaitable, Callable, Generic, TypeVar

from prefixpool.transfer.address import PeerAddress
from prefixpool.transfer.errors import PeerUnreachable

C = TypeVar("C")
R = TypeVar("R")


class IdleConnections(Generic[C]):
    def __init__(self, connect: Callable[[PeerAddress], Awaitable[C]], discard: Callable[[C], None],
                 broken: tuple[type[BaseException], ...], max_idle: int = 4) -> None:
        self.connect, self.discard, self.broken, self.max_idle = connect, discard, broken, max_idle
        self._idle: dict[tuple[str, int], list[C]] = defaultdict(list)

    def num_idle(self, address: PeerAddress) -> int:
        return len(self._idle.get((address.host, address.port), ()))

    async def ask(self, address: PeerAddress, exchange: Callable[[C], Awaitable[R]]) -> tuple[C, R]:
        """Run `exchange` on a connection to `address`; return the connection (still open) and its result."""
        idle = self._idle[(address.host, address.port)]
        while True:
            reused = bool(idle)
            conn = idle.pop() if reused else await self.connect(address)
            try:
                return conn, await exchange(conn)
            except self.broken as err:
                self.discard(conn)
                if not reused:
                    raise PeerUnreachable(f"{address.url} failed before answering: {err}") from err
            except BaseException:
                self.discard(conn)
                raise

    def give_back(self, address: PeerAddress, conn: C, reusable: bool) -> None:
        idle = self._idle[(address.host, address.port)]
        if reusable and len(idle) < self.max_idle:
            idle.append(conn)
        else:
            self.discard(conn)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                self.discard(conn)
        self._idle.clear()
