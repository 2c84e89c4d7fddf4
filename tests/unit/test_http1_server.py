"""The lean HTTP/1.1 server (prefixpool/net/http1_server.py) against raw clients: exact bytes on real sockets.

Every wait is bounded (a server that does not answer fails the test instead of hanging it).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from prefixpool.net.http1_server import Answer, Http1Server, Request, Stream

WAIT_S = 10.0


def run(case) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(case(), 30)

    asyncio.run(bounded())


async def echo(request: Request) -> Answer:
    return Answer(200, b"%s %s ?%s %s" % (request.method.encode(), request.path.encode(), request.query.encode(),
                                          request.body), b"text/plain")


class Served:
    """A server on a loopback port and raw connections to it."""

    def __init__(self, handler, **args) -> None:
        self.server = Http1Server(handler, **args)

    async def __aenter__(self) -> "Served":
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await self.server.start(sock)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close(1.0)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a Content-Length: (its head, its body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await asyncio.wait_for(reader.readexactly(length), WAIT_S)


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), WAIT_S)


def post(path: bytes, body: bytes, extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (b"POST %s %s\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path, version, len(body), extra, body))


def test_requests_in_turn_and_pipelined_share_one_connection():
    async def case() -> None:
        async with Served(echo) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/a?x=1", b"one"))
            head, body = await answer(reader)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Date: " in head and b"close" not in head.lower()
            assert body == b"POST /a ?x=1 one"
            writer.write(post(b"/b", b"two") + post(b"/c", b"three"))  # two requests in one write
            assert (await answer(reader))[1] == b"POST /b ? two"
            assert (await answer(reader))[1] == b"POST /c ? three"
            writer.close()

    run(case)


def test_a_chunked_request_body_is_read_whole():
    async def case() -> None:
        async with Served(echo) as served:
            reader, writer = await served.connect()
            writer.write(b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n")
            await asyncio.sleep(0.05)
            writer.write(b"2\r\nde\r\n0\r\nTrailer: x\r\n\r\n")
            assert (await answer(reader))[1] == b"POST /c ? abcde"
            writer.close()

    run(case)


def test_expect_100_continue_is_answered_before_the_body():
    async def case() -> None:
        async with Served(echo) as served:
            reader, writer = await served.connect()
            writer.write(b"POST /e HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"body")
            assert (await answer(reader))[1] == b"POST /e ? body"
            writer.close()

    run(case)


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: ten\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
])
def test_a_malformed_request_gets_its_4xx_and_the_connection_closes(request_bytes, status):
    async def case() -> None:
        async with Served(echo, errors=lambda code, message: f"{code}: {message}".encode()) as served:
            reader, writer = await served.connect()
            writer.write(request_bytes)
            data = await until_closed(reader)
            assert data.startswith(b"HTTP/1.1 %d " % status), data[:100]
            assert b"Connection: close" in data and data.split(b"\r\n\r\n", 1)[1].startswith(b"%d: " % status)
            writer.close()

    run(case)


def test_a_body_over_the_limit_gets_a_413_the_client_can_read():
    async def case() -> None:
        async with Served(echo, max_body_bytes=1000) as served:
            reader, writer = await served.connect()  # the whole body sent, as urllib does
            writer.write(post(b"/big", b"x" * 200_000))
            data = await until_closed(reader)
            assert data.startswith(b"HTTP/1.1 413 "), data[:100]
            reader, writer = await served.connect()  # announced with Expect: answered before any byte is sent
            writer.write(b"POST /big HTTP/1.1\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
            assert (await until_closed(reader)).startswith(b"HTTP/1.1 413 ")
            reader, writer = await served.connect()  # chunked: found out while reading
            writer.write(b"POST /big HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"200\r\n" + b"y" * 512 + b"\r\n" + b"200\r\n" + b"y" * 512 + b"\r\n0\r\n\r\n")
            assert (await until_closed(reader)).startswith(b"HTTP/1.1 413 ")
            reader, writer = await served.connect()  # the server still serves
            writer.write(post(b"/ok", b"small"))
            assert (await answer(reader))[1] == b"POST /ok ? small"

    run(case)


async def streaming(request: Request) -> Stream:
    stream = request.stream(b"Content-Type: text/event-stream\r\n")
    await stream.write(b"first")
    await asyncio.sleep(0.05)
    await stream.write(b"second")
    await stream.end(b"last")
    return stream


def test_a_stream_sends_its_head_with_the_first_chunk_and_keeps_the_connection():
    async def case() -> None:
        async with Served(streaming) as served:
            reader, writer = await served.connect()
            for _ in range(2):
                writer.write(post(b"/s", b""))
                first = await asyncio.wait_for(reader.read(65536), WAIT_S)  # one write: head and first chunk
                assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked\r\n" in first
                assert first.endswith(b"\r\n\r\n5\r\nfirst\r\n"), first
                rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), WAIT_S)
                assert rest == b"6\r\nsecond\r\n4\r\nlast\r\n0\r\n\r\n"
            writer.close()

    run(case)


def test_http_1_0_gets_a_stream_until_close_and_no_keep_alive_unless_asked():
    async def case() -> None:
        async with Served(streaming) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/s", b"", version=b"HTTP/1.0"))
            data = await until_closed(reader)
            assert b"Transfer-Encoding" not in data and b"Connection: close" in data
            assert data.endswith(b"\r\n\r\nfirstsecondlast")
        async with Served(echo) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/a", b"", version=b"HTTP/1.0"))
            assert b"Connection: close" in await until_closed(reader)
            reader, writer = await served.connect()
            writer.write(post(b"/a", b"1", b"Connection: keep-alive\r\n", version=b"HTTP/1.0"))
            writer.write(post(b"/a", b"2", b"Connection: keep-alive\r\n", version=b"HTTP/1.0"))
            assert [(await answer(reader))[1] for _ in range(2)] == [b"POST /a ? 1", b"POST /a ? 2"]
            writer.close()

    run(case)


def test_a_handler_error_is_a_500_and_the_connection_serves_on(caplog):
    async def handler(request: Request) -> Answer:
        if request.path == "/bug":
            raise RuntimeError("a bug")
        return await echo(request)

    async def case() -> None:
        async with Served(handler) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/bug", b""))
            head, _ = await answer(reader)
            assert head.startswith(b"HTTP/1.1 500 ")
            writer.write(post(b"/fine", b""))
            assert (await answer(reader))[1] == b"POST /fine ? "
            writer.close()

    with caplog.at_level(logging.ERROR):
        run(case)
    assert "unhandled error on POST /bug" in caplog.text


def test_a_whole_answer_after_a_stream_began_cuts_the_stream_instead_of_following_it(caplog):
    async def changes_its_mind(request: Request) -> Answer:
        stream = request.stream(b"")
        await stream.write(b"partial")
        return Answer(500, b"an error answer")  # (a handler that caught an error mid-stream)

    async def case() -> None:
        async with Served(changes_its_mind) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/s", b""))
            data = await until_closed(reader)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"7\r\npartial\r\n")
            assert b"HTTP/1.1 500" not in data

    with caplog.at_level(logging.ERROR):
        run(case)
    assert "answered whole after its stream began" in caplog.text


def test_a_client_that_leaves_mid_stream_ends_the_handler_quietly(caplog):
    ended: asyncio.Queue = asyncio.Queue()

    async def endless(request: Request) -> Stream:
        stream = request.stream(b"")
        try:
            for _ in range(1000):  # bounded: the client leaves after the first chunk
                await stream.write(b"tick")
                await asyncio.sleep(0.01)
        except ConnectionResetError:
            ended.put_nowait("reset")
            raise
        ended.put_nowait("finished")
        return stream

    async def case() -> None:
        async with Served(endless) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/s", b""))
            await asyncio.wait_for(reader.read(100), WAIT_S)
            writer.transport.abort()
            assert await asyncio.wait_for(ended.get(), WAIT_S) == "reset"

    with caplog.at_level(logging.ERROR):
        run(case)
    assert not caplog.records


def test_close_ends_idle_connections_at_once_and_answers_the_one_in_progress():
    release = asyncio.Event

    async def case() -> None:
        gate = release()

        async def slow(request: Request) -> Answer:
            await asyncio.wait_for(gate.wait(), WAIT_S)
            return Answer(200, b"done")

        served = Served(slow)
        await served.__aenter__()
        idle_reader, _ = await served.connect()
        reader, writer = await served.connect()
        writer.write(post(b"/slow", b""))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(served.server.close(WAIT_S))
        assert await until_closed(idle_reader) == b""  # closed without a word
        assert not closing.done()
        gate.set()
        data = await until_closed(reader)
        assert data.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in data and data.endswith(b"done")
        await closing

    run(case)


def test_an_idle_connection_is_closed_after_keep_alive_s():
    async def case() -> None:
        async with Served(echo, keep_alive_s=0.2) as served:
            reader, writer = await served.connect()
            writer.write(post(b"/a", b""))
            await answer(reader)
            assert await until_closed(reader) == b""
            reader, writer = await served.connect()  # a head that never ends: also closed
            writer.write(b"GET / HTTP/1.1\r\nX: 1\r\n")
            assert await until_closed(reader) == b""

    run(case)
