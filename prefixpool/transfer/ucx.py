"""The UCX transport through `ucxx`: tagged messages, receives posted ahead into the blocks.

    client                                      server (one task per endpoint)
      create_endpoint (or reuse an idle one) -->  listener callback
      send_obj(FetchRequest)                 -->  admit, pin the prefix
                                             <--  send_obj(FetchResponse)
      recv(header, tag=(i, 0))               <--  send(header, tag=(i, 0))   } up to `window`
      recv(block i's bytes, tag=(i, 1))      <--  send(payload, tag=(i, 1))  } blocks in flight

The receiver posts up to `window` blocks of receives ahead, straight into
the destination blocks, so UCX moves bytes with no copy of ours; blocks are
still verified and committed strictly in order. An endpoint goes back to the
idle pool only after a complete answer; otherwise it is aborted, which also
cancels receives still posted into blocks we are about to free. The server
aborts an endpoint whose peer sends no request, or takes none of its answer,
past its ServerDeadlines (unpinning what it held for it).

Environment: UCX reads its settings at the first call in the process.
`UCX_NET_DEVICES` picks the interface (`lo` for one machine); ucxx's
listener binds every interface, whatever host the URL names. Knows nothing
of TCP sockets.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402

from prefixpool.transfer.address import PeerAddress
from prefixpool.transfer.connections import IdleConnections  # noqa: E402
from prefixpool.transfer.errors import PeerUnreachable, ProtocolError  # noqa: E402
from prefixpool.transfer.protocol import (  # noqa: E402
    HEADER_BYTES,
    STATUS_OK,
    FetchRequest,
    FetchResponse,
    ServerDeadlines,
    admit,
    block_header,
    decode_response,
    encode,
    request_keys,
)
from prefixpool.transfer.sink import BlockSink  # noqa: E402
from prefixpool.transfer.source import BlockSource, Outgoing  # noqa: E402

log = logging.getLogger(__name__)
WINDOW_BYTES = 32 << 20  # bytes in flight per request, each way


def window_for(block_bytes: int) -> int:
    """Blocks in flight: enough to cover a bandwidth-delay product of small blocks, at least 2."""
    return max(2, min(256, WINDOW_BYTES // block_bytes))
_ENDPOINT_ERRORS = (UCXError, ConnectionError, TimeoutError)


class UcxServer:
    def __init__(self, source: BlockSource, token: str = "", deadlines: ServerDeadlines = ServerDeadlines()) -> None:
        self.source = source
        self.token = token
        self.deadlines = deadlines
        self.window = window_for(source.block_bytes)
        self._listener = None
        self._host = ""
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        assert self._listener is not None, "server not started"
        return f"ucx://{self._host}:{self._listener.port}"

    async def start(self, host: str, port: int) -> None:
        self._host = host
        self._listener = ucxx.create_listener(self._serve_endpoint, port=port)

    async def close(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _serve_endpoint(self, endpoint) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        wait_s = self.deadlines.request_s  # a new endpoint speaks at once
        try:
            while True:
                async with asyncio.timeout(wait_s):  # a message arrives whole: no half frames to time apart
                    body = await endpoint.recv_obj()
                if not await self._answer(endpoint, body):
                    break
                wait_s = self.deadlines.idle_s + self.deadlines.request_s  # kept by the client for its next fetch
        except TimeoutError:
            log.info("ucx transfer peer idle or not reading past its deadline: endpoint aborted")
        except _ENDPOINT_ERRORS as err:
            log.debug("ucx transfer endpoint ended: %s", err)
        finally:
            self._handlers.discard(task)
            endpoint.abort()

    async def _answer(self, endpoint, body: bytearray) -> bool:
        """Serve one request; False when the endpoint must close afterwards."""
        request = admit(body, self.token)
        if isinstance(request, FetchResponse):
            async with asyncio.timeout(self.deadlines.stall_s):
                await endpoint.send_obj(encode(request))
            return False
        source = self.source
        async with source.pinned(request_keys(request)) as outgoing:
            async with asyncio.timeout(self.deadlines.stall_s):
                await endpoint.send_obj(encode(FetchResponse(STATUS_OK, outgoing.num_blocks, source.block_bytes)))
            await self._send_blocks(endpoint, outgoing)
        return True

    async def _send_blocks(self, endpoint, outgoing: Outgoing) -> None:
        in_flight: deque[asyncio.Future] = deque()
        index = 0
        try:
            async for header, payload in self.source.records(outgoing):
                sends = (endpoint.send(header.pack(), tag=(index, 0)), endpoint.send(payload, tag=(index, 1)))
                in_flight.append(asyncio.gather(*sends))
                index += 1
                if len(in_flight) >= self.window:
                    await self._sent(in_flight.popleft())
            while in_flight:
                await self._sent(in_flight.popleft())
        finally:
            for future in in_flight:
                future.cancel()

    async def _sent(self, sends: asyncio.Future) -> None:
        """One block's sends done; TimeoutError when the peer takes nothing for stall_s."""
        async with asyncio.timeout(self.deadlines.stall_s):
            await sends


class UcxClient:
    """Fetches over UCX, keeping up to `max_idle` idle endpoints per peer."""

    def __init__(self, max_idle: int = 4) -> None:
        self._conns: IdleConnections = IdleConnections(self._connect, _abort, _ENDPOINT_ERRORS, max_idle)

    async def close(self) -> None:
        self._conns.close()

    def num_idle(self, address: PeerAddress) -> int:
        return self._conns.num_idle(address)

    async def _connect(self, address: PeerAddress):
        try:
            return await ucxx.create_endpoint(address.host, address.port)
        except _ENDPOINT_ERRORS as err:
            raise PeerUnreachable(f"cannot connect to {address.url}: {err}") from err

    async def fetch(self, address: PeerAddress, request: FetchRequest, sink: BlockSink) -> None:
        """Fill `sink` with what the peer sends; a peer dying mid-stream just ends it early."""

        async def exchange(endpoint) -> FetchResponse:
            await endpoint.send_obj(encode(request))
            return decode_response(await endpoint.recv_obj())

        endpoint, response = await self._conns.ask(address, exchange)
        receiving = _Receiving(endpoint, sink, window_for(sink.arena.block_bytes))
        try:
            await receiving.run(response)
        finally:
            if receiving.complete:
                self._conns.give_back(address, endpoint, True)
            else:
                await receiving.abort()  # waits out every posted receive before its block is freed


def _abort(endpoint) -> None:
    endpoint.abort()


class _Receiving:
    """One answer's receives, posted `window` blocks ahead and consumed in order."""

    def __init__(self, endpoint, sink: BlockSink, window: int) -> None:
        self.endpoint = endpoint
        self.sink = sink
        self.window = window
        self.posted: deque[tuple[int, bytearray, asyncio.Task, asyncio.Task]] = deque()
        self.complete = False

    def _post(self, index: int) -> None:
        raw_header = bytearray(HEADER_BYTES)
        header_task = asyncio.ensure_future(self.endpoint.recv(raw_header, tag=(index, 0)))
        payload_task = asyncio.ensure_future(self.endpoint.recv(self.sink.destination(index), tag=(index, 1)))
        self.posted.append((index, raw_header, header_task, payload_task))

    async def run(self, response: FetchResponse) -> bool:
        num_blocks = self.sink.expect(response.num_blocks, response.block_bytes)
        for index in range(min(self.window, num_blocks)):
            self._post(index)
        try:
            while self.posted:
                index, raw_header, header_task, payload_task = self.posted[0]
                await header_task
                await payload_task
                self.posted.popleft()
                if not self.sink.accept(index, block_header(raw_header)):
                    return False
                if index + self.window < num_blocks:
                    self._post(index + self.window)
        except ProtocolError:
            self.sink.reject()
            return False
        except _ENDPOINT_ERRORS as err:
            log.info("ucx transfer peer failed mid-stream after %d blocks: %s", self.sink.num_committed, err)
            return False
        self.complete = num_blocks == response.num_blocks
        return self.complete

    async def abort(self) -> None:
        """Abort the endpoint and wait out every posted receive before its block is freed."""
        self.endpoint.abort()
        tasks = [task for _, _, *pair in self.posted for task in pair]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.posted.clear()
