"""Exact reads, framed messages and scatter/gather on a non-blocking socket, through the event loop.

`recv_exactly` fills a caller's buffer (an arena block, a header) with
`loop.sock_recv_into`, so payload bytes go from the kernel straight into their
destination. For streams of many buffers, `send_buffers` gathers a batch
into one `sendmsg` and `Scatter` fills the next several buffers (headers and
payloads alike) with one `recvmsg_into`, waking only once a useful amount
has arrived (SO_RCVLOWAT): one syscall and one wake-up per batch, not per
buffer. Knows nothing of pools or of what the messages mean.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Iterator

from prefixpool.transfer.protocol import LENGTH_PREFIX, message_length


class PeerClosed(ConnectionError):
    """The peer closed the stream before a message was complete."""


async def recv_exactly(sock: socket.socket, buffer: memoryview | bytearray) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(buffer).cast("B")
    while view:
        received = await loop.sock_recv_into(sock, view)
        if received == 0:
            raise PeerClosed("peer closed the connection mid-message")
        view = view[received:]


async def recv_message(sock: socket.socket, *, eof_ok: bool = False) -> bytearray | None:
    """One length-prefixed message; None on a clean close between messages when eof_ok."""
    prefix = bytearray(LENGTH_PREFIX.size)
    loop = asyncio.get_running_loop()
    first = await loop.sock_recv_into(sock, prefix)
    if first == 0:
        if eof_ok:
            return None
        raise PeerClosed("peer closed the connection before answering")
    await recv_exactly(sock, memoryview(prefix)[first:])
    body = bytearray(message_length(prefix))
    await recv_exactly(sock, body)
    return body


async def send_all(sock: socket.socket, *buffers: bytes | memoryview) -> None:
    loop = asyncio.get_running_loop()
    for buffer in buffers:
        await loop.sock_sendall(sock, buffer)


SCATTER_BUFFERS = 64  # buffers one receive syscall may fill (Linux allows 1024)
# ... and bytes (at least one buffer): the checksum then reads what the copy just wrote, in cache
SCATTER_BYTES = 1 << 20
WAKE_BYTES = 1 << 20  # a waiting receive wakes once this much (or all it still needs) has arrived


async def _ready(sock: socket.socket, writing: bool) -> None:
    """Until the socket is writable (or readable): one wake-up, no busy loop."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writing else (loop.add_reader, loop.remove_reader)
    add(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(sock.fileno())


async def wait_readable(sock: socket.socket) -> None:
    """Until bytes, or the peer's close, can be read: what an idle connection waits for."""
    await _ready(sock, writing=False)


async def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview], stall_s: float | None = None) -> None:
    """Send the buffers in order, as few `sendmsg` calls as the kernel's send buffer allows.

    With `stall_s`, a peer that takes no byte for that long raises TimeoutError (it stopped reading)."""
    views = [memoryview(buffer) for buffer in buffers]
    first = 0
    while first < len(views):
        try:
            sent = sock.sendmsg(views[first : first + SCATTER_BUFFERS])
        except BlockingIOError:
            async with asyncio.timeout(stall_s):
                await _ready(sock, writing=True)
            continue
        while sent and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


class Scatter:
    """Fills a lazily produced sequence of buffers in order, several per receive syscall.

    Reads never go past the last buffer, so the bytes after it (the next
    message on a reused connection) stay in the socket. A waiting receive
    wakes at WAKE_BYTES (or all it still needs), or when the peer closes:
    bytes under that threshold from a peer that stalls wait in the kernel
    until `receive_now()` takes them (a caller whose deadline passed).
    `close()` restores the socket's wake-up threshold; call it before
    anything else reads.
    """

    def __init__(self, sock: socket.socket, buffers: Iterator[memoryview]) -> None:
        self.sock = sock
        self._source = buffers
        self._pending: deque[memoryview] = deque()
        self._offset = 0  # bytes already in the first pending buffer
        self._lowat = 1

    def _window(self) -> list[memoryview]:
        pending = self._pending
        while len(pending) < SCATTER_BUFFERS and (buffer := next(self._source, None)) is not None:
            pending.append(buffer)
        window, size = [], -self._offset
        for buffer in pending:
            window.append(buffer)
            size += buffer.nbytes
            if size >= SCATTER_BYTES:
                break
        if window and self._offset:
            window[0] = window[0][self._offset :]
        return window

    async def receive(self) -> list[memoryview]:
        """Receive once; returns the buffers completed by it (maybe none). [] at the end of the sequence."""
        window = self._window()
        if not window:
            return []
        while True:
            try:
                received = self.sock.recvmsg_into(window)[0]
                break
            except BlockingIOError:
                self._wake_at(min(sum(view.nbytes for view in window), WAKE_BYTES))
                await _ready(self.sock, writing=False)
        if received == 0:
            raise PeerClosed("peer closed the connection mid-stream")
        return self._complete(received)

    def receive_now(self) -> list[memoryview]:
        """Receive what already sits in the kernel, without waiting; [] if nothing (or the end)."""
        window = self._window()
        try:
            received = self.sock.recvmsg_into(window, 0, socket.MSG_DONTWAIT)[0] if window else 0
        except (BlockingIOError, ConnectionError):
            return []
        return self._complete(received) if received else []

    def _complete(self, received: int) -> list[memoryview]:
        pending, done = self._pending, []
        received += self._offset
        while pending and received >= pending[0].nbytes:
            received -= pending[0].nbytes
            done.append(pending.popleft())
        self._offset = received
        return done

    def _wake_at(self, num_bytes: int) -> None:
        if num_bytes != self._lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, num_bytes)
            self._lowat = num_bytes

    def close(self) -> None:
        self._wake_at(1)
