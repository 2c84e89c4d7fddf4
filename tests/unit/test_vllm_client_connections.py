"""The router's vLLM client keeps one connection per server across requests.

vLLM streams a completion as token chunks, a usage chunk, then `data: [DONE]`. The client's
answer ends at the usage chunk; unless it also reads what follows, aiohttp closes the connection
and every request opens a new one (a TCP connect, and an accept in vLLM's server, on the path of
the first token). A small aiohttp server streams that shape (the real vLLM servers of tests/vllm
answer through the same client) and counts the connections it accepts. A server that holds the
stream open after the usage chunk still gets its answer at once, and costs its connection only.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from prefixpool.contract.worker_api import Done, GenerateRequest, SamplingParams, Token
from prefixpool.router.vllm_client import VllmClient

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


WAIT_S = 30.0  # bound on a held stream: the test releases it long before
GAP_S = 0.05  # between the usage chunk and [DONE] (well under the client's wait for it)


class Streams:
    """What the server saw and whether it holds `[DONE]` until released."""

    def __init__(self, hold: bool) -> None:
        self.peers: set = set()
        self.bodies: list[dict] = []  # each request's JSON body, as vLLM would read it
        self.hold = hold
        self.release = asyncio.Event()


STREAMS = web.AppKey("streams", Streams)


async def answer_like_vllm(request: web.Request) -> web.StreamResponse:
    streams = request.app[STREAMS]
    streams.peers.add(request.transport.get_extra_info("peername"))
    assert request.content_type == "application/json", request.content_type
    streams.bodies.append(await request.json())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for token in (7, 8):
        await response.write(sse({"choices": [{"index": 0, "text": "", "token_ids": [token], "finish_reason": None}]}))
    await response.write(sse({"choices": [], "usage": USAGE}))
    if streams.hold:  # until the client has its answer
        await asyncio.wait_for(streams.release.wait(), WAIT_S)
    else:  # a moment, as when [DONE] comes in a TCP segment of its own
        await asyncio.sleep(GAP_S)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def serve_and_ask(requests: int, hold: bool = False) -> tuple[list[list], Streams]:
    """(each answer's events, what the server saw: client addresses and request bodies). `hold`: the server sends
    `[DONE]` only once the client has its answer (each answer is checked to be complete before it is released)."""
    app = web.Application()
    streams = app[STREAMS] = Streams(hold)
    app.add_routes([web.post("/v1/completions", answer_like_vllm)])
    server = TestServer(app)
    await server.start_server()
    client = VllmClient("m")
    answers = []
    try:
        for i in range(requests):
            request = GenerateRequest(request_id=f"r{i}", tokens=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
            answers.append([event async for event in client.generate(str(server.make_url("")).rstrip("/"), request)])
            streams.release.set()
            await asyncio.sleep(0)
            streams.release.clear()
    finally:
        streams.release.set()
        await client.close()
        await server.close()
    return answers, streams


def test_requests_in_turn_share_one_connection():
    answers, streams = asyncio.run(serve_and_ask(5))
    for events in answers:
        assert events[:2] == [Token(7), Token(8)] and isinstance(events[2], Done) and len(events) == 3
    assert len(streams.peers) == 1, streams.peers  # before: one connection (a new client port) per request
    body = streams.bodies[0]  # the prompt goes as token ids, the stream asks for them back
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m" and body["max_tokens"] == 2
    assert body["stream"] is True and body["return_token_ids"] is True and len(streams.bodies) == 5


def test_a_stream_held_open_after_its_usage_is_answered_all_the_same():
    answers, streams = asyncio.run(serve_and_ask(2, hold=True))  # answered while the server still holds it
    assert all(isinstance(events[-1], Done) and len(events) == 3 for events in answers)
    assert len(streams.peers) == 2  # what the bound costs: that connection
