"""The router's HTTP client for workers: POST /generate and read the NDJSON event stream.

Connection problems become WorkerUnreachable, so the caller can retry
elsewhere while nothing has been streamed; a request the worker refuses whole
(a 4xx error JSON) becomes one Failed event with that status. Knows nothing of routing.
"""

from __future__ import annotations

from typing import AsyncIterator

import aiohttp
import msgspec

from prefixpool.contract.worker_api import (MSGPACK, AUTH_HEADER, Event, Failed, GenerateRequest, PinReply, PinRequest,
                                            decode_event, encode, encode_request)

REFUSALS = (400, 413, 422)  # the worker's answers to a request it refuses whole, as error JSON


class WorkerUnreachable(Exception):
    """The worker could not be reached or its stream broke off."""


def _error_message(body: bytes) -> str:
    """The message of the worker's {"error": {"message": ...}} body (or the start of the body)."""
    try:
        return str(msgspec.json.decode(body)["error"]["message"])[:2000]
    except (msgspec.DecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


class WorkerClient:
    def __init__(self, token: str = "", connect_timeout_s: float = 3.0, read_timeout_s: float = 120.0) -> None:
        self._headers = {AUTH_HEADER: token} if token else {}
        self._timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, worker_url: str, request: GenerateRequest) -> AsyncIterator[Event]:
        """Yield the worker's events; raise WorkerUnreachable if it cannot be reached or breaks off."""
        try:
            async with self._client().post(f"{worker_url}/generate", data=encode_request(request),
                                           headers={"Content-Type": MSGPACK}) as response:
                if response.status in REFUSALS:  # checked whole before admission: no other worker serves it either
                    yield Failed(_error_message(await response.read()), response.status)
                    return
                if response.status != 200:
                    raise WorkerUnreachable(f"worker answered {response.status}: {(await response.text())[:200]}")
                async for line in response.content:
                    if line.strip():
                        yield decode_event(line)
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
            raise WorkerUnreachable(f"{worker_url}: {err!r}") from err

    async def pin(self, worker_url: str, request: PinRequest, unpin: bool = False) -> PinReply:
        """POST (pin) or DELETE (unpin) {worker}/admin/pin."""
        try:
            async with self._client().request("DELETE" if unpin else "POST", f"{worker_url}/admin/pin",
                                              data=encode(request)) as response:
                if response.status != 200:
                    raise WorkerUnreachable(f"worker answered {response.status}: {(await response.text())[:200]}")
                return msgspec.json.decode(await response.read(), type=PinReply)
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
            raise WorkerUnreachable(f"{worker_url}: {err!r}") from err
