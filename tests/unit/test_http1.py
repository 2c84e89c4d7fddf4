"""The lean HTTP/1.1 client (prefixpool/net/http1_client.py) against scripted servers: exact bytes on real sockets.

Each server is an asyncio TCP server on 127.0.0.1 whose handler reads requests and writes the answer
a case needs (chunked with extensions and trailers, Content-Length, until close, split across writes,
malformed, never); it counts the connections it accepts, which is how reuse is checked.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

import pytest

from prefixpool.net.http1_client import Http1Client, HttpProtocolError, Response
from prefixpool.router.vllm_client import VllmClient
from prefixpool.router.worker_client import WorkerUnreachable
from prefixpool.contract.worker_api import GenerateRequest, SamplingParams

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]
TIMEOUT_S = 10.0  # bound on every case


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next request's line (None at EOF); headers and body kept in self.requests."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head[:-4].split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        self.requests.append((lines[0], headers, body))
        return lines[0]


def run(case: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(TIMEOUT_S):
            await case()
    asyncio.run(bounded())


def answering(*answers: bytes) -> Handler:
    """Answer each request on a connection with the next of `answers` (the last repeats)."""
    async def handler(reader, writer, server) -> None:
        for i in range(1000):
            if await server.request(reader) is None:
                return
            writer.write(answers[min(i, len(answers) - 1)])
            await writer.drain()
    return handler


def chunk(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data)


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           + chunk(b'data: {"a":1}\n\n')
           + chunk(b"data: {", b";ext=1")  # a chunk with an extension, a line split across chunks
           + chunk(b'"b":2}\n\n')
           + b"0\r\nX-Trailer: t\r\n\r\n")


async def ask(handler: Handler, *reads: Callable[[Response], Awaitable[None]], pause_s: float = 0.0,
              **client_args) -> Server:
    """A request per `reads` item, in turn through one client, each answer given to its read (then `pause_s`
    idle). The server, for its counts."""
    async with Server(handler) as server:
        client = Http1Client(**client_args)
        for read in reads:
            async with client.post(server.url, b"/v1/completions", b'{"x":1}') as response:
                await read(response)
            await asyncio.sleep(pause_s)
        await client.close()
    return server


def reads_body(body: bytes) -> Callable[[Response], Awaitable[None]]:
    async def read(response: Response) -> None:
        assert await response.read() == body
    return read


async def reads_chunked(response: Response) -> None:
    assert response.status == 200 and response.headers[b"content-type"] == b"text/event-stream"
    assert [line async for line in response.lines()] == [b'data: {"a":1}\n', b"\n", b'data: {"b":2}\n', b"\n"]


def test_chunked_lines_and_one_connection_for_requests_in_turn():
    async def case() -> None:
        server = await ask(answering(CHUNKED), reads_chunked, reads_chunked, reads_chunked)
        assert server.connections == 1
        line, headers, body = server.requests[0]
        assert line == b"POST /v1/completions HTTP/1.1" and body == b'{"x":1}'
        assert headers[b"content-type"] == b"application/json" and headers[b"host"] == server.url[7:].encode()
    run(case)


def test_content_length_body_split_across_writes_is_read_whole_and_the_connection_kept():
    async def handler(reader, writer, server) -> None:
        while await server.request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b" world")
            await writer.drain()

    async def case() -> None:
        assert (await ask(handler, reads_body(b"hello world"), reads_body(b"hello world"))).connections == 1
    run(case)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\n\r\nuntil the server closes",  # no length: the body ends with the connection
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 23\r\n\r\nuntil the server closes",
    b"HTTP/1.0 200 OK\r\nContent-Length: 23\r\n\r\nuntil the server closes",  # 1.0 without keep-alive
])
def test_an_answer_that_ends_its_connection_is_read_and_the_next_request_opens_a_new_one(answer):
    async def handler(reader, writer, server) -> None:
        await server.request(reader)
        writer.write(answer)
        await writer.drain()

    async def case() -> None:
        read = reads_body(b"until the server closes")
        assert (await ask(handler, read, read)).connections == 2
    run(case)


def test_a_body_left_unread_closes_its_connection():
    async def leaves(response: Response) -> None:
        async for line in response.lines():
            assert line == b'data: {"a":1}\n'
            break  # the client went away mid-stream

    async def case() -> None:
        assert (await ask(answering(CHUNKED), leaves, reads_chunked)).connections == 2
    run(case)


def test_drain_reads_the_rest_so_the_connection_is_kept():
    async def drains(response: Response) -> None:
        assert await anext(response.lines()) == b'data: {"a":1}\n'
        await response.drain(1.0)

    async def case() -> None:
        assert (await ask(answering(CHUNKED), drains, drains, reads_chunked)).connections == 1
    run(case)


def test_a_kept_connection_the_server_closed_as_the_request_left_is_replaced_once():
    async def handler(reader, writer, server) -> None:
        if server.connections == 1:  # the first connection: one answer, then the next request is dropped unanswered
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await server.request(reader)
            return
        await answering(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nagain")(reader, writer, server)

    async def case() -> None:
        server = await ask(handler, reads_body(b"ok"), reads_body(b"again"))
        assert server.connections == 2 and len(server.requests) == 3  # the second request, sent twice
    run(case)


def test_an_idle_connection_past_idle_s_is_not_reused():
    async def case() -> None:
        ok = reads_body(b"ok")
        answer = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        assert (await ask(answer, ok, ok, pause_s=0.1, idle_s=0.05)).connections == 2
        assert (await ask(answer, ok, ok, pause_s=0.1, idle_s=5.0)).connections == 1
    run(case)


def test_interim_1xx_answers_are_skipped():
    async def created(response: Response) -> None:
        assert response.status == 201 and await response.read() == b"new"

    run(lambda: ask(answering(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nnew"),
                    created))


async def raises(handler: Handler, error: type[Exception], **client_args) -> Server:
    """Ask `handler`'s server once, reading the whole body: it must raise `error`. The server, for its counts."""
    async with Server(handler) as server:
        client = Http1Client(**client_args)
        with pytest.raises(error):
            async with client.post(server.url, b"/p", b"") as response:
                await response.read()
        await client.close()
    return server


def test_a_new_connection_closed_before_an_answer_raises():
    async def handler(reader, writer, server) -> None:
        await server.request(reader)

    async def case() -> None:
        server = await raises(handler, ConnectionResetError)
        assert server.connections == 1  # not retried: the server really closes it
    run(case)


@pytest.mark.parametrize("answer", [
    b"SSH-2.0-OpenSSH\r\n\r\n",
    b"HTTP/1.1 abc OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
])
def test_an_answer_that_is_not_http_raises_a_protocol_error(answer):
    run(lambda: raises(answering(answer), HttpProtocolError))


def test_a_body_cut_short_of_its_length_raises():
    async def handler(reader, writer, server) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        await writer.drain()

    run(lambda: raises(handler, ConnectionResetError))


def test_a_server_that_never_answers_times_out():
    async def handler(reader, writer, server) -> None:
        await server.request(reader)
        await asyncio.sleep(TIMEOUT_S)

    run(lambda: raises(handler, TimeoutError, read_timeout_s=0.2))


def test_a_refused_connection_raises_an_os_error():
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"

        async def case() -> None:
            client = Http1Client()
            with pytest.raises(ConnectionRefusedError):
                async with client.post(url, b"/p", b""):
                    pass
            await client.close()
        run(case)


def test_only_plain_http_urls():
    with pytest.raises(ValueError, match="only http"):
        run(lambda: Http1Client().post("https://127.0.0.1:1", b"/p", b"").__aenter__())


def test_the_vllm_client_calls_a_server_that_drops_the_request_unreachable():
    async def handler(reader, writer, server) -> None:
        await server.request(reader)

    async def case() -> None:
        async with Server(handler) as server:
            client = VllmClient("m")
            request = GenerateRequest(request_id="r", tokens=[1, 2], sampling=SamplingParams(max_tokens=1))
            with pytest.raises(WorkerUnreachable, match="closed the connection"):
                async for _ in client.generate(server.url, request):
                    pass
            assert await client.prefill(server.url, request) is None  # a failed prefill: the decode side computes
            await client.close()
    run(case)


def test_a_kept_connection_closed_after_part_of_an_answer_is_not_sent_again():
    async def handler(reader, writer, server) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 O")  # the server had the request: sending it again would run it twice
        await writer.drain()

    async def case() -> None:
        async with Server(handler) as server:
            client = Http1Client()
            async with client.post(server.url, b"/p", b"") as response:
                assert await response.read() == b"ok"
            with pytest.raises(ConnectionResetError):
                async with client.post(server.url, b"/p", b""):
                    pass
            await client.close()
            assert server.connections == 1 and len(server.requests) == 2
    run(case)
