"""A lean HTTP/1.1 client: keep-alive connections per server, one request at a time on each.

The router's calls to vLLM run on the path of every first token. aiohttp's client builds a request
object, header multidicts, a cookie jar lookup, trace hooks and a stream reader for each request;
this one sends a request in one write and reads the answer straight from the connection's buffer
(the router's CPU a request 4.9 against 5.2 ms with aiohttp's, lower in 6 of 6 rounds:
benchmarks/gateway.md). Connections at once are not capped (aiohttp's were, at 100).

    async with client.post(url, path, body) as response:    status and headers read, the body follows
        a connection from the pool (the latest used first; one the server closed, or idle past
        idle_s, is dropped: servers close idle keep-alive connections, vLLM's uvicorn after 5 s),
        else a new one. A reused connection that closes before any byte of an answer (the server
        closed it as the request left) is replaced once by a new one.
    response.lines()   the body line by line, each with its b"\\n" (the last may lack it)
    response.read()    the whole body
    response.drain(s)  read what is left of the body for at most s seconds, so the connection is kept
    leaving the block: a connection whose answer was read to its end goes back to the pool; any other
        (the body left unread, an error, `Connection: close`) is closed

Bodies: chunked, Content-Length, or until the server closes. Errors are OSErrors: ConnectionError
(refused, reset, closed before the answer ended, an answer that is not HTTP/1.x: HttpProtocolError)
and TimeoutError (connect_timeout_s to connect, read_timeout_s for any one read). Knows nothing of
vLLM or of what the bodies hold.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

from prefixpool.net.http1_wire import (Body, Connection, HttpProtocolError, content_length, fields, keeps_alive,
                                       read_until)

IDLE_S = 2.0  # an idle connection older than this is closed, not reused (uvicorn's keep-alive: 5 s)
MAX_IDLE = 64  # idle connections kept per server


class Response:
    """An answer whose status and headers are read; its body is read from the connection on demand."""

    def __init__(self, client: "Http1Client", address: tuple[str, int], conn: Connection, status: int,
                 headers: dict[bytes, bytes], keep_alive: bool) -> None:
        self.status, self.headers = status, headers
        self._client, self._address, self._conn = client, address, conn
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = None if chunked else content_length(headers.get(b"content-length"))
        self._body = Body(conn, chunked, 0 if status in (204, 304) else length)
        self._keep_alive = keep_alive and (chunked or length is not None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, in the pieces it arrives in (chunked framing removed)."""
        assert self._conn is not None, "the response was released"
        async for piece in self._body.chunks(self._client.read_timeout_s):
            yield piece

    async def lines(self) -> AsyncIterator[bytes]:
        pending = b""
        async for piece in self.chunks():
            pending += piece
            start = 0
            while (end := pending.find(b"\n", start)) >= 0:
                yield pending[start : end + 1]
                start = end + 1
            pending = pending[start:]
        if pending:
            yield pending

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", errors="replace")

    async def drain(self, timeout_s: float) -> None:
        """Read what is left of the body, for at most `timeout_s` (then the connection is closed on release)."""
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self.chunks():
                    pass
        except (TimeoutError, OSError):
            pass

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._body.done and self._keep_alive and not conn.buffer and conn.usable():
            self._client._keep(self._address, conn)
        else:
            self._client._drop(conn)


class _Post:
    """client.post(...): `async with` it for the Response."""

    def __init__(self, client: "Http1Client", url: str, path: bytes, body: bytes, content_type: bytes) -> None:
        self._args = client, url, path, body, content_type
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        client, url, path, body, content_type = self._args
        self._response = await client._send(url, path, body, content_type)
        return self._response

    async def __aexit__(self, *exc: object) -> None:
        if self._response is not None:
            self._response.release()


class Http1Client:
    def __init__(self, connect_timeout_s: float = 3.0, read_timeout_s: float = 300.0, idle_s: float = IDLE_S,
                 max_idle: int = MAX_IDLE) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.idle_s, self.max_idle = idle_s, max_idle
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._open: set[Connection] = set()
        self.num_connects = 0

    def post(self, url: str, path: bytes, body: bytes, content_type: bytes = b"application/json") -> _Post:
        """POST `body` to `url` (http://host:port) + `path`."""
        return _Post(self, url, path, body, content_type)

    async def close(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()

    async def _send(self, url: str, path: bytes, body: bytes, content_type: bytes) -> Response:
        address, host = _address(url)
        request = b"".join((b"POST ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\nContent-Type: ", content_type,
                            b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n\r\n", body))
        for attempt in range(2):
            conn, reused = self._reuse(address), True
            if conn is None:
                conn, reused = await self._connect(address), False
            assert conn.transport is not None
            conn.transport.write(request)
            received = conn.received
            try:
                status, headers, keep_alive = await _head(conn, self.read_timeout_s)
                return Response(self, address, conn, status, headers, keep_alive)
            except ConnectionResetError:
                self._drop(conn)
                if not reused or attempt or conn.received != received:
                    raise
                # closed by the server as the request left (its keep-alive ran out): once more, on a new one
            except BaseException:
                self._drop(conn)
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _reuse(self, address: tuple[str, int]) -> Connection | None:
        idle, now = self._idle.get(address), time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable() and now - conn.idle_since <= self.idle_s:
                return conn
            self._drop(conn)
        return None

    async def _connect(self, address: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(Connection, *address)
        self._open.add(conn)
        self.num_connects += 1
        return conn

    def _keep(self, address: tuple[str, int], conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(address, [])
        idle.append(conn)
        if len(idle) > self.max_idle:
            self._drop(idle.pop(0))

    def _drop(self, conn: Connection) -> None:
        conn.close()
        self._open.discard(conn)


@functools.lru_cache(maxsize=1024)
def _address(url: str) -> tuple[tuple[str, int], bytes]:
    """((host, port), the Host header) of http://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url!r}: only http://host[:port] URLs")
    port = parts.port or 80
    return (parts.hostname, port), parts.netloc.encode()


async def _head(conn: Connection, timeout_s: float) -> tuple[int, dict[bytes, bytes], bool]:
    """The status, headers (names lowercased) and whether the connection stays open, of the next final answer
    (1xx answers are skipped). HTTP/1.1 keeps it unless `Connection: close`; HTTP/1.0 only with keep-alive."""
    while True:
        lines = (await read_until(conn, b"\r\n\r\n", timeout_s)).split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(rest[:3])
        headers = fields(lines[1:])
        if status >= 200:
            return status, headers, keeps_alive(version == b"HTTP/1.0", headers)
