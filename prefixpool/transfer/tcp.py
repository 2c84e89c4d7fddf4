"""The TCP transport: an asyncio server that streams blocks, and a client with reused connections.

    client                                  server (one task per connection)
      connect (or reuse an idle socket) -->   accept
      [len|FetchRequest]                -->   check token, pin the prefix
                                        <--   [len|FetchResponse]
      recvmsg_into(headers, blocks, ...) <--  sendmsg([RecordHeader, payload]) x num_blocks
      connection back to the idle pool        unpin, wait for the next request

Raw non-blocking sockets driven by the event loop: payloads are sent from
and received into the arena's own memory, no stream buffers in between. One
receive syscall scatters many records (headers into small buffers, payloads
straight into their blocks) and wakes only once a megabyte has arrived; it
takes about that much at a time, so each block's checksum reads bytes the
copy has just left in cache. The per-block cost is the checksum and the
commit, not syscalls and wake-ups.
A connection goes back to the pool only after a complete answer; after a
rejection, a short allocation or any error it is closed, since bytes may
still be in flight on it. The server closes a peer that is idle, sends half
a request, or stops reading its answer past its ServerDeadlines (unpinning
what it held for it), so no peer keeps a connection or a pin for ever.
Knows nothing of UCX.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Iterator

from prefixpool.transfer.address import PeerAddress
from prefixpool.transfer.connections import IdleConnections
from prefixpool.transfer.errors import PeerUnreachable, ProtocolError
from prefixpool.transfer.protocol import (
    HEADER_BYTES,
    STATUS_OK,
    FetchRequest,
    FetchResponse,
    ServerDeadlines,
    admit,
    block_header,
    decode_response,
    framed,
    request_keys,
)
from prefixpool.transfer.sink import BlockSink
from prefixpool.transfer.source import BlockSource
from prefixpool.transfer.stream import Scatter, recv_message, send_all, send_buffers, wait_readable

log = logging.getLogger(__name__)


def _tune(sock: socket.socket) -> None:
    """Non-blocking and no Nagle delay. The kernel's buffers stay autotuned: a fixed SO_RCVBUF
    would lock the window (and net.core.rmem_max caps it, 4 MiB on our machines), while
    autotuning grows it up to tcp_rmem's maximum (32 MiB on our machines)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpServer:
    def __init__(self, source: BlockSource, token: str = "", deadlines: ServerDeadlines = ServerDeadlines()) -> None:
        self.source = source
        self.token = token
        self.deadlines = deadlines
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        assert self._listener is not None, "server not started"
        host, port = self._listener.getsockname()[:2]
        return f"tcp://{host}:{port}"

    async def start(self, host: str, port: int) -> None:
        listener = socket.create_server((host, port), backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._spawn(self._accept_loop(listener))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            _tune(sock)
            self._spawn(self._serve_connection(sock))

    async def _serve_connection(self, sock: socket.socket) -> None:
        idle_s = self.deadlines.request_s  # a new connection speaks at once
        try:
            while (body := await self._next_request(sock, idle_s)) is not None:
                if not await self._answer(sock, body):
                    return
                idle_s = self.deadlines.idle_s  # kept by the client for its next fetch
        except TimeoutError:
            log.info("transfer peer idle, slow or not reading past its deadline: connection closed")
        except (ConnectionError, ProtocolError) as err:
            log.debug("transfer connection ended: %s", err)
        finally:
            sock.close()

    async def _next_request(self, sock: socket.socket, idle_s: float) -> bytearray | None:
        """The next request frame, or None on a clean close; TimeoutError past `idle_s` or request_s."""
        async with asyncio.timeout(idle_s):
            await wait_readable(sock)
        async with asyncio.timeout(self.deadlines.request_s):  # from its first byte
            return await recv_message(sock, eof_ok=True)

    async def _answer(self, sock: socket.socket, body: bytearray) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        request = admit(body, self.token)
        stall_s = self.deadlines.stall_s
        if isinstance(request, FetchResponse):
            await send_buffers(sock, [framed(request)], stall_s)
            return False
        source = self.source
        async with source.pinned(request_keys(request)) as outgoing:
            ok = FetchResponse(STATUS_OK, outgoing.num_blocks, source.block_bytes)
            await send_buffers(sock, [framed(ok)], stall_s)
            async for header, payload in source.records(outgoing):
                await send_buffers(sock, [header.pack(), payload], stall_s)  # a record leaves as soon as it exists
        return True


class TcpClient:
    """Fetches over TCP, keeping up to `max_idle` idle connections per peer."""

    def __init__(self, max_idle: int = 4) -> None:
        self._conns: IdleConnections[socket.socket] = IdleConnections(self._connect, socket.socket.close,
                                                                       (ConnectionError,), max_idle)

    async def close(self) -> None:
        self._conns.close()

    def num_idle(self, address: PeerAddress) -> int:
        return self._conns.num_idle(address)

    async def _connect(self, address: PeerAddress) -> socket.socket:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise PeerUnreachable(f"unknown peer {address.url}: {err}") from err
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        _tune(sock)
        try:
            await loop.sock_connect(sock, infos[0][4])
        except OSError as err:
            sock.close()
            raise PeerUnreachable(f"cannot connect to {address.url}: {err}") from err
        return sock

    async def fetch(self, address: PeerAddress, request: FetchRequest, sink: BlockSink) -> None:
        """Fill `sink` with what the peer sends; a peer dying mid-stream just ends it early."""

        async def exchange(sock: socket.socket) -> FetchResponse:
            await send_all(sock, framed(request))
            return decode_response(await recv_message(sock))

        sock, response = await self._conns.ask(address, exchange)
        try:
            complete = await _receive(sock, response, sink)
        except BaseException:
            sock.close()
            raise
        self._conns.give_back(address, sock, complete)


def _record_buffers(sink: BlockSink, num_blocks: int) -> Iterator[memoryview]:
    """Where each record lands, in wire order: a fresh header buffer, then the block's destination."""
    for index in range(num_blocks):
        yield memoryview(bytearray(HEADER_BYTES))
        yield sink.destination(index)


class _Records:
    """Alternating header / payload buffers of the answer, checked and handed to the sink in order."""

    def __init__(self, sink: BlockSink) -> None:
        self.sink, self.index, self.header = sink, 0, None

    def consume(self, buffers: list[memoryview]) -> bool:
        """False once the sink rejects a header or a block (the rest of the answer is dropped)."""
        for buffer in buffers:
            if self.header is None:
                self.header = block_header(buffer)
                if not self.sink.check_header(self.index, self.header):
                    return False
            elif not self.sink.accept(self.index, self.header):
                return False
            else:
                self.index, self.header = self.index + 1, None
        return True


async def _receive(sock: socket.socket, response: FetchResponse, sink: BlockSink) -> bool:
    """Receive each block into its destination; True if the whole answer was consumed.

    Several records arrive per syscall, so a payload may land in its (allocated,
    uncommitted) block before its header is checked; a bad header still rejects
    that block and the rest, which are then freed without a key.
    """
    num_blocks = sink.expect(response.num_blocks, response.block_bytes)
    scatter = Scatter(sock, _record_buffers(sink, num_blocks))
    records = _Records(sink)
    try:
        while records.index < num_blocks:
            if not records.consume(await scatter.receive()):
                return False
    except ProtocolError:
        sink.reject()
        return False
    except ConnectionError as err:
        log.info("transfer peer closed mid-stream after %d blocks: %s", sink.num_committed, err)
        return False
    except asyncio.CancelledError:
        # The deadline passed while the peer stalled (a cut link): whole blocks already in the
        # kernel, under the wake-up threshold, are still verified and kept.
        with contextlib.suppress(ProtocolError):
            while records.index < num_blocks and (ready := scatter.receive_now()) and records.consume(ready):
                pass
        raise
    finally:
        scatter.close()
    return num_blocks == response.num_blocks
