"""Reused connections: a stale reused connection is retried once on a fresh one, never more."""

import asyncio

import pytest

from prefixpool.transfer.address import parse_url
from prefixpool.transfer.connections import IdleConnections
from prefixpool.transfer.errors import PeerUnreachable

PEER = parse_url("tcp://127.0.0.1:1")


class Conn:
    def __init__(self, number: int) -> None:
        self.number, self.closed = number, False


def pool(max_idle=2):
    opened: list[Conn] = []

    async def connect(address):
        opened.append(Conn(len(opened)))
        return opened[-1]

    def discard(conn):
        conn.closed = True

    return IdleConnections(connect, discard, (ConnectionError,), max_idle), opened


def test_reuse_then_stale_retry_then_fresh_failure():
    async def scenario():
        conns, opened = pool()

        async def ok(conn):
            return conn.number

        conn, result = await conns.ask(PEER, ok)
        conns.give_back(PEER, conn, True)
        assert (result, conns.num_idle(PEER)) == (0, 1)

        async def stale_once(conn):
            if conn.number == 0:
                raise ConnectionResetError("stale")
            return conn.number

        conn, result = await conns.ask(PEER, stale_once)  # the reused one broke: a fresh one answers
        assert result == 1 and opened[0].closed and not conn.closed

        async def always_broken(conn):
            raise ConnectionResetError("down")

        with pytest.raises(PeerUnreachable):
            await conns.ask(PEER, always_broken)  # a fresh connection that breaks is not retried
        assert len(opened) == 3 and opened[2].closed

    asyncio.run(scenario())


def test_give_back_keeps_at_most_max_idle_and_close_discards_all():
    async def scenario():
        conns, opened = pool(max_idle=1)
        a, _ = await conns.ask(PEER, lambda c: asyncio.sleep(0))
        b, _ = await conns.ask(PEER, lambda c: asyncio.sleep(0))
        conns.give_back(PEER, a, True)
        conns.give_back(PEER, b, True)
        assert conns.num_idle(PEER) == 1 and b.closed and not a.closed
        conns.give_back(PEER, Conn(9), False)
        conns.close()
        assert a.closed and conns.num_idle(PEER) == 0

    asyncio.run(scenario())
