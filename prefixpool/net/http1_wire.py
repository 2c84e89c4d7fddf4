"""HTTP/1.1 framing over one buffered TCP connection, for the lean client (http1_client.py) and server
(http1_server.py).

    conn = Connection()                   an asyncio Protocol: what arrived and is not yet read, in conn.buffer
    await read_until(conn, b"\\r\\n\\r\\n", t)  the buffer up to a mark, taken out (a head: at most MAX_HEAD_BYTES)
    fields(lines)                         header lines -> {lowercased name: value}
    keeps_alive(http10, headers)          whether the connection stays open after this message
    body = Body(conn, chunked, length)    a message body: chunked, Content-Length, or (length None) until close
    async for piece in body.chunks(t)     its pieces as they arrive, the chunked framing removed
    await conn.drained()                  until the transport takes writes again (its buffer was full)

Errors are OSErrors: HttpProtocolError for bytes that are not HTTP/1.x, ConnectionResetError for a peer
that closed the connection mid-message, TimeoutError for any one read past its timeout. Knows nothing of
requests, answers or what the bodies hold.
"""

from __future__ import annotations

import asyncio
import socket
from typing import AsyncIterator

MAX_HEAD_BYTES = 64 * 1024


class HttpProtocolError(ConnectionError):
    """The peer sent bytes that are not the HTTP/1.x this module reads."""


class HeadTooLarge(HttpProtocolError):
    """No end of the head (or line) within MAX_HEAD_BYTES."""


class Connection(asyncio.Protocol):
    """One TCP connection (TCP_NODELAY): what arrived and not yet read, whether the peer closed it, and
    whether the transport's write buffer is full."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.received = 0  # bytes, ever
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._writable: asyncio.Future | None = None  # set while the transport's buffer is over its high mark

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received += len(data)
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def drained(self) -> None:
        """Until the transport takes writes again; ConnectionResetError once the peer is gone."""
        if self._writable is not None:
            await self._writable
        if self.closed:
            raise ConnectionResetError("the peer closed the connection")

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self, timeout_s: float | None) -> None:
        """Until more bytes arrive; ConnectionResetError if the peer closed the connection, TimeoutError."""
        if self.closed:
            raise ConnectionResetError("the peer closed the connection before its message ended")
        size = len(self.buffer)
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._waiter
        finally:
            self._waiter = None
        if len(self.buffer) == size:
            raise ConnectionResetError("the peer closed the connection before its message ended")

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def read_until(conn: Connection, end_mark: bytes, timeout_s: float | None) -> bytes:
    """The buffer up to `end_mark` (waiting for it), taken out with the mark; at most MAX_HEAD_BYTES before it."""
    while (end := conn.buffer.find(end_mark, 0, MAX_HEAD_BYTES + len(end_mark))) < 0:
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"no {end_mark!r} in {MAX_HEAD_BYTES // 1024} KiB")
        await conn.more(timeout_s)
    taken = bytes(conn.buffer[:end])
    del conn.buffer[: end + len(end_mark)]
    return taken


def fields(lines: list[bytes]) -> dict[bytes, bytes]:
    """Header lines as {lowercased name: value} (a repeated name: its last value)."""
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name.strip():
            raise HttpProtocolError(f"not a header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return headers


def keeps_alive(http10: bool, headers: dict[bytes, bytes]) -> bool:
    """Whether a message leaves its connection open: HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with
    `Connection: keep-alive`."""
    connection = headers.get(b"connection", b"").lower()
    return connection == b"keep-alive" if http10 else connection != b"close"


def content_length(value: bytes | None) -> int | None:
    """A Content-Length header's number (None where there is none)."""
    if value is None:
        return None
    if not value.isdigit():
        raise HttpProtocolError(f"Content-Length {value[:40]!r} is not a number")
    return int(value)


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise HttpProtocolError(f"chunk size {line[:40]!r} is not hexadecimal") from None


class Body:
    """One message body on `conn`: chunked, `length` bytes, or (neither) until the peer closes."""

    def __init__(self, conn: Connection, chunked: bool, length: int | None) -> None:
        self.conn, self.chunked = conn, chunked
        self.left = None if chunked else length  # None: chunked or until close
        self.done = self.left == 0

    async def chunks(self, timeout_s: float | None) -> AsyncIterator[bytes]:
        """The body, in the pieces it arrives in (chunked framing removed)."""
        conn = self.conn
        while not self.done:
            if self.chunked:
                size = _chunk_size(await read_until(conn, b"\r\n", timeout_s))
                if size == 0:
                    while await read_until(conn, b"\r\n", timeout_s):  # trailer fields, then the empty line
                        pass
                    self.done = True
                    return
                while len(conn.buffer) < size + 2:
                    await conn.more(timeout_s)
                if conn.buffer[size : size + 2] != b"\r\n":
                    raise HttpProtocolError("a chunk does not end with CRLF")
                piece = bytes(conn.buffer[:size])
                del conn.buffer[: size + 2]
                yield piece
            else:
                if not conn.buffer:
                    try:
                        await conn.more(timeout_s)
                    except ConnectionResetError:
                        if self.left is not None:  # Content-Length promised more
                            raise
                        self.done = True  # the body was "until close": it ended
                        return
                take = len(conn.buffer) if self.left is None else min(self.left, len(conn.buffer))
                piece = bytes(conn.buffer[:take])
                del conn.buffer[:take]
                if self.left is not None:
                    self.left -= take
                    self.done = self.left == 0
                yield piece
