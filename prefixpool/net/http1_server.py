"""A lean HTTP/1.1 server: one handler coroutine for every request, answers whole or streamed (chunked).

The router's endpoints run on the path of every first token. aiohttp's server builds a request object,
multidicts, a match through its URL dispatcher and a task per request through every middleware, and
its StreamResponse prepares headers through signals; here a request is parsed from the connection's
buffer (http1_wire.py) and its handler is called (benchmarks/gateway.md has the cost of each).

    server = Http1Server(handler, max_body_bytes=...)
    await server.start(sock)             serve a bound socket (SO_REUSEPORT siblings may share the port)
    handler(request) -> Answer           request.method, .path, .query, .headers ({lowercased name: value},
                                         bytes), .body, .arrived (perf_counter when its head was read);
                                         an Answer is written whole
    stream = request.stream(headers)     or a chunked answer: nothing is sent until its first write, which
    await stream.write(data)             carries the head too; a write to a client that left raises
    await stream.end(data)               ConnectionResetError; the handler returns the ended stream
    await server.close(timeout_s)        stop accepting, close idle connections, wait for answers in progress

The connection's rules: keep-alive (HTTP/1.0 only when asked), requests in turn (a pipelined one waits
in the buffer), `Expect: 100-continue` answered, request bodies by Content-Length or chunked. A request
that is not HTTP/1.x gets a 400, a head over 64 KiB a 431, a body past max_body_bytes a 413, and the
connection closes once the client stops sending (what it still sends is read and dropped, bounded, so
it reads the answer); those answers' bodies come from `errors(status, message)`. A connection idle for keep_alive_s,
or slower than it to send a request's head or body, is closed. An exception a handler lets out is
logged and answered 500 (a stream already started is cut). Knows nothing of the router.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import time
from email.utils import formatdate
from typing import Awaitable, Callable

from prefixpool.net.http1_wire import (Body, Connection, HeadTooLarge, HttpProtocolError, content_length, fields,
                                         keeps_alive, read_until)

log = logging.getLogger(__name__)
KEEP_ALIVE_S = 75.0  # as aiohttp's server: an idle connection, or a request this slow to arrive, is closed
LINGER_S = 10.0  # after a 4xx for a request that cannot be read: what the client still sends is dropped this long
LINGER_BYTES = 256 * 1024 * 1024  # and up to this much


class Answer:
    """A whole answer."""

    __slots__ = ("status", "body", "content_type", "close")

    def __init__(self, status: int, body: bytes, content_type: bytes = b"application/json",
                 close: bool = False) -> None:
        self.status, self.body, self.content_type, self.close = status, body, content_type, close


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "arrived", "_conn", "_http10", "_stream")

    def __init__(self, conn: "_ServerConnection", method: str, path: str, query: str,
                 headers: dict[bytes, bytes], http10: bool) -> None:
        self.method, self.path, self.query, self.headers = method, path, query, headers
        self.body = b""
        self.arrived = time.perf_counter()  # its head read
        self._conn, self._http10 = conn, http10
        self._stream: Stream | None = None

    def stream(self, headers: bytes, status: int = 200) -> "Stream":
        """A chunked answer (to HTTP/1.0: its body until the connection closes); `headers` are whole lines,
        each ending in CRLF (e.g. b"Content-Type: text/event-stream\\r\\n")."""
        self._stream = Stream(self._conn, status, headers, self._http10)
        return self._stream


class Stream:
    """A streamed answer: its head leaves with the first write."""

    def __init__(self, conn: "_ServerConnection", status: int, headers: bytes, http10: bool) -> None:
        self._conn, self._http10, self.status = conn, http10, status
        framing = b"Connection: close\r\n" if http10 else b"Transfer-Encoding: chunked\r\n"
        self._head: bytes | None = _status_line(status) + _date() + headers + framing + b"\r\n"
        self.ended = False
        self.close = http10  # close the connection once it ends (set: the client's next request goes elsewhere)

    @property
    def started(self) -> bool:
        return self._head is None

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self._send(data if self._http10 else b"%x\r\n%s\r\n" % (len(data), data))
        await self._conn.drained()

    async def end(self, data: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        if self._http10:
            self._send(data)
        else:
            self._send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        await self._conn.drained()

    def _send(self, data: bytes) -> None:
        if not self._conn.usable():
            raise ConnectionResetError("the client closed the connection")
        head, self._head = self._head, None
        assert self._conn.transport is not None
        self._conn.transport.write(head + data if head is not None else data)


Handler = Callable[[Request], Awaitable["Answer | Stream"]]
Errors = Callable[[int, str], bytes]


def plain_errors(status: int, message: str) -> bytes:
    return message.encode()


class _ServerConnection(Connection):
    """A client's connection; its requests are served in turn by one task."""

    def __init__(self, server: "Http1Server") -> None:
        super().__init__()
        self.server = server
        self.busy = False  # a request is being answered
        self.task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server._connections.add(self)
        self.task = asyncio.get_running_loop().create_task(self.server._serve(self))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server._connections.discard(self)


class Http1Server:
    def __init__(self, handler: Handler, max_body_bytes: int = 32 * 1024 * 1024, keep_alive_s: float = KEEP_ALIVE_S,
                 errors: Errors = plain_errors, error_type: bytes = b"text/plain") -> None:
        self.handler, self.max_body_bytes, self.keep_alive_s = handler, max_body_bytes, keep_alive_s
        self.errors, self.error_type = errors, error_type
        self.closing = False
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), sock=sock)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting; close connections between requests at once, the others once answered (or at the
        timeout)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if not conn.busy:
                conn.close()
        tasks = [conn.task for conn in self._connections if conn.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for conn in list(self._connections):
            conn.close()

    async def _serve(self, conn: _ServerConnection) -> None:
        try:
            while not self.closing:
                if not conn.buffer:
                    await conn.more(self.keep_alive_s)  # idle between requests
                conn.busy = True
                if not await self._one(conn):
                    break
                conn.busy = False
        except (OSError, TimeoutError):
            pass  # the client left, was idle too long, or too slow to send its request: nothing to answer
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            conn.close()

    async def _one(self, conn: _ServerConnection) -> bool:
        """Read, answer and write one request; whether the connection stays open."""
        try:
            request, body = await self._request(conn)
            if body.left is not None and body.left > self.max_body_bytes:
                raise _TooLarge  # (a client that sent Expect: 100-continue has sent none of it)
            if request.headers.get(b"expect", b"").lower() == b"100-continue":
                conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
            request.body = await self._read_body(body)
        except HttpProtocolError as err:
            status = 431 if isinstance(err, HeadTooLarge) else 400
            await self._refuse(conn, status, str(err))
            return False
        except _TooLarge:
            await self._refuse(conn, 413, f"the request body is over the limit of {self.max_body_bytes} bytes")
            return False
        keep = keeps_alive(request._http10, request.headers)
        try:
            answer = await self.handler(request)
        except Exception as err:
            if isinstance(err, ConnectionError) and not conn.usable():
                return False  # the client left mid-answer (a stream's write): nothing more to send
            log.exception("unhandled error on %s %s", request.method, request.path)
            if request._stream is not None and request._stream.started:
                return False  # cut: the client sees the stream end without its last chunk
            answer = Answer(500, self.errors(500, "internal error; see the log"), self.error_type)
        if isinstance(answer, Stream):
            await answer.end()  # (nothing more if the handler ended it)
        elif request._stream is not None and request._stream.started:
            log.error("%s %s answered whole after its stream began; the stream is cut", request.method, request.path)
            return False  # a second answer on the connection would be read as the stream's bytes
        else:
            self._write(conn, answer, keep)
        return keep and not answer.close and not self.closing

    async def _refuse(self, conn: _ServerConnection, status: int, message: str) -> None:
        """Answer a request that cannot be read, then end our side and drop what the client still sends until it
        closes (LINGER_S, LINGER_BYTES): closed with unread bytes, the kernel resets the connection, and a client
        still sending its body would lose the answer."""
        self._write(conn, Answer(status, self.errors(status, message), self.error_type, close=True), False)
        if not conn.usable():
            return
        assert conn.transport is not None
        if conn.transport.can_write_eof():
            conn.transport.write_eof()
        dropped = len(conn.buffer)
        conn.buffer.clear()
        try:
            async with asyncio.timeout(LINGER_S):
                while dropped < LINGER_BYTES:
                    await conn.more(None)
                    dropped += len(conn.buffer)
                    conn.buffer.clear()
        except (OSError, TimeoutError):
            pass  # the client closed (the usual end), or lingered too long

    async def _request(self, conn: _ServerConnection) -> tuple[Request, Body]:
        lines = (await read_until(conn, b"\r\n\r\n", self.keep_alive_s)).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[0].isalpha():
            raise HttpProtocolError(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
        headers = fields(lines[1:])
        target = parts[1].decode("latin-1")
        path, _, query = target.partition("?")
        request = Request(conn, parts[0].decode("ascii"), path, query, headers, parts[2] == b"HTTP/1.0")
        encoding = headers.get(b"transfer-encoding")
        if encoding is not None and encoding.lower() != b"chunked":
            raise HttpProtocolError(f"Transfer-Encoding {encoding[:40]!r}: only chunked is read")
        if encoding is not None and b"content-length" in headers:
            raise HttpProtocolError("both Transfer-Encoding and Content-Length")
        chunked = encoding is not None
        return request, Body(conn, chunked, None if chunked else content_length(headers.get(b"content-length")) or 0)

    async def _read_body(self, body: Body) -> bytes:
        pieces, size = [], 0
        async for piece in body.chunks(self.keep_alive_s):
            size += len(piece)
            if size > self.max_body_bytes:
                raise _TooLarge
            pieces.append(piece)
        return b"".join(pieces)

    def _write(self, conn: _ServerConnection, answer: Answer, keep: bool) -> None:
        if not conn.usable():
            return
        close = b"" if keep and not answer.close and not self.closing else b"Connection: close\r\n"
        assert conn.transport is not None
        conn.transport.write(b"".join((_status_line(answer.status), _date(), b"Content-Type: ", answer.content_type,
                                       b"\r\nContent-Length: ", str(len(answer.body)).encode(), b"\r\n", close,
                                       b"\r\n", answer.body)))


class _TooLarge(Exception):
    pass


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


_DATE: list = [0, b""]  # (the second it was made, the header line)


def _date() -> bytes:
    now = int(time.time())
    if _DATE[0] != now:
        _DATE[0], _DATE[1] = now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
    return _DATE[1]
