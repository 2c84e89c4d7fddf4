"""A streamed answer has a frame per token, sent as the token arrives, even while its text is held back.

The router detokenizes and holds back text that ends inside a UTF-8 character; vLLM's own server
still sends a chunk per token (text ""), and clients (vLLM's benchmark among them) time the first
token by the first chunk. Here a real Router behind its real HTTP server streams from a worker that
sends the first byte of "é", then waits until the test has read a chunk before sending the second:
the first chunk must come while the worker waits, and the text put together is still "é".
"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import ClientSession

from prefixpool.contract.worker_api import Done, Token, Usage
from prefixpool.meta.membership import NodeRecord
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router.cost_model import CostModel
from prefixpool.router.http import serve_router
from prefixpool.router.service import Router, RouterConfig
from prefixpool.store.keys import Namespace
from tests.support.index_view import IndexView

NS = Namespace("m", block_size=4)
USAGE = Usage(prompt_tokens=5, completion_tokens=3, local_hit_tokens=0, fetched_tokens=0, computed_tokens=5,
              fetched_bytes=0, ttft_s=0.01)
E_ACUTE = list("é".encode())  # two bytes, two tokens of the byte tokenizer
WAIT_S = 10.0  # bound on every wait: a held-back frame fails the test instead of hanging it


class SplitCharacterWorker:
    """Streams the first byte of "é", then waits for `release` before the second byte and Done."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def generate(self, worker_url: str, request):
        yield Token(E_ACUTE[0])
        await asyncio.wait_for(self.release.wait(), WAIT_S)
        yield Token(E_ACUTE[1])
        yield Token(ord("!"))
        yield Done("length", USAGE)


async def stream(chat: bool, router: Router | None = None) -> tuple[list[dict], bool]:
    """(every data frame's JSON, whether the first frame with a choice came before the worker was released)."""
    worker = SplitCharacterWorker()
    router = router or new_router()
    router.client = worker
    server = serve_router(router)
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}) if chat
                  else ("/v1/completions", {"prompt": "hello"}))
    frames: list[dict] = []
    first_before_release = False
    try:
        async with ClientSession() as session:
            async with session.post(url + path, json={"model": "m", "max_tokens": 3, "stream": True,
                                                                     **body}) as response:
                assert response.status == 200, await response.text()
                while True:
                    line = (await asyncio.wait_for(response.content.readline(), WAIT_S)).decode().strip()
                    if line == "data: [DONE]":
                        break
                    if not line.startswith("data: "):
                        continue
                    frames.append(json.loads(line[6:]))
                    if frames[-1]["choices"] and _text(frames[-1]) is not None and not worker.release.is_set():
                        first_before_release = True
                        worker.release.set()
    finally:
        worker.release.set()
        await server.close()
    return frames, first_before_release


def new_router() -> Router:
    config = RouterConfig(model="m", namespace=NS, max_context=1000, vocab_size=259)
    view = IndexView({"a": NodeRecord("a", "http://a", "", 4, 0, "m", namespace=NS.root().hex())})
    return Router(config, ByteTokenizer(), view, SplitCharacterWorker(), CostModel())


def _text(frame: dict) -> str | None:
    choice = frame["choices"][0]
    return choice["delta"].get("content") if "delta" in choice else choice.get("text")


def test_the_first_token_is_a_frame_even_when_its_text_is_held_back():
    frames, first_before_release = asyncio.run(stream(chat=False))
    assert first_before_release  # before: no frame until the second byte arrived
    texts = [_text(f) for f in frames if f["choices"]]
    assert texts[0] == ""  # the first byte alone is no character yet: held back, not sent half-made
    assert "".join(texts) == "é!"
    assert all("\ufffd" not in t for t in texts)


def test_a_chat_stream_also_has_a_frame_for_the_held_back_token():
    frames, first_before_release = asyncio.run(stream(chat=True))
    assert first_before_release
    contents = [_text(f) for f in frames if f["choices"] and _text(f) is not None]
    assert contents[0] == "" and "".join(contents) == "é!"


def test_the_router_times_its_own_phases_of_a_stream():
    router = new_router()
    asyncio.run(stream(chat=False, router=router))
    asyncio.run(stream(chat=True, router=router))
    counts = {s.labels["phase"]: s.value for m in router.metrics.overhead.collect() for s in m.samples
              if s.name.endswith("_count")}
    sums = {s.labels["phase"]: s.value for m in router.metrics.overhead.collect() for s in m.samples
            if s.name.endswith("_sum")}
    assert counts == {"prepare": 2.0, "decide": 2.0, "relay": 2.0}
    assert all(0 < sums[phase] < 1.0 for phase in counts), sums
