"""Hostile input straight at one worker: its internal HTTP API and its transfer port, driven by hypothesis.

One real worker (engine over the tiny model, pool, arena, HTTP API, TCP transfer server) runs
in-process on its own event loop thread for the whole module, served on 127.0.0.1; the tests
talk to it over real sockets only.

    /generate    JSON or msgpack documents with hostile fields (wrong types, huge and negative ids,
                 NaN, nested junk, missing fields, fetch plans outside the prompt): every answer is
                 a 4xx error JSON before any stream, or a 200 stream of tokens ending in Done whose
                 tokens equal an independent engine's, and never for a request that is certainly invalid
    /admin/pin   the same for pins (POST and DELETE); every pin made is released at the end
    transfer     arbitrary bytes, with the write side closed or left open: the server closes every
                 such connection (short deadlines), holds no pin afterwards and still serves a fetch

Never a 5xx, never a hang (every client call has a timeout). Afterwards the worker still
serves a normal request correctly and its pool passes check_integrity with nothing pinned.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import http.client
import json
import socket
import threading

import msgspec
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prefixpool.contract.worker_api import (MAX_TTL_S, MSGPACK, Done, GenerateRequest, SamplingParams, Token,
                                            decode_event)
from prefixpool.engine.checkpoint import random_model
from prefixpool.model.config import preset
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import chain
from prefixpool.node.exchange import BlockExchange
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.transfer import fetch
from prefixpool.transfer.fetcher import Fetcher
from prefixpool.transfer.protocol import ServerDeadlines
from prefixpool.transfer.source import BlockSource
from prefixpool.transfer.tcp import TcpServer
from prefixpool.worker.http_api import build_app
from prefixpool.worker.service import Worker
from tests.support.engine import BLOCK, make_engine

pytestmark = pytest.mark.timeout(600)
NUM_BLOCKS = 64  # pool positions: 64 * BLOCK = 256
VOCAB = preset("tiny").vocab_size
CLIENT_TIMEOUT_S = 60.0  # a hang fails the test; answers take milliseconds
DEADLINES = ServerDeadlines(request_s=0.2, idle_s=0.2, stall_s=2.0)


class _NoEtcd:
    """The worker's publisher without etcd: this module tests the worker's own front doors."""

    def publish(self, stored=(), removed=(), tier="device", tails=None) -> None:
        pass


class LiveWorker:
    """A worker on its own event loop thread, reachable only through 127.0.0.1 sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker-loop", daemon=True)
        self.engine = make_engine(random_model(preset("tiny"), seed=11), num_blocks=NUM_BLOCKS, max_batch_size=4)
        self.pins: set[str] = set()

    def call(self, coroutine, timeout_s: float = CLIENT_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def start(self) -> "LiveWorker":
        self.thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        engine = self.engine
        self.fetcher = Fetcher()
        exchange = BlockExchange(engine.blocks, engine.arena, _NoEtcd(), self.fetcher)
        self.worker = Worker(engine, exchange, fetch_timeout_s=2.0)
        source = BlockSource(engine.blocks, engine.arena)
        self.transfer = TcpServer(source, deadlines=DEADLINES)
        await self.transfer.start("127.0.0.1", 0)
        self.runner = web.AppRunner(build_app(self.worker, source=source), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        self.worker.start()

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.transfer.close()
        await self.worker.stop()
        await self.fetcher.close()

    def request(self, method: str, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT_S)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": content_type})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def report(self) -> dict:
        status, payload = self.request("GET", "/debug/pool", b"")
        assert status == 200
        return json.loads(payload)

    def quiet_report(self) -> dict:
        """The pool report once no stream is open (a closed client's stream ends a moment later)."""
        async def poll() -> None:
            while self.worker._streams or self.engine.has_work():
                await asyncio.sleep(0.01)
        self.call(asyncio.wait_for(poll(), CLIENT_TIMEOUT_S))
        return self.report()


@pytest.fixture(scope="module")
def worker():
    live = LiveWorker().start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oracle():
    """An independent engine over the same weights (a second model made from the same seed)."""
    return make_engine(random_model(preset("tiny"), seed=11), num_blocks=NUM_BLOCKS)


# -- strategies -------------------------------------------------------------------------------------

HOSTILE_NUMBERS = [-1, 0, 1, -(2**63), 2**31, 2**31 - 1, 2**63, 2**64, 10**40, VOCAB, VOCAB - 1, -0.0, 1.5, 1e308,
                   -1e308, float("nan"), float("inf"), 1e-300]
ODD_VALUES = [None, True, False, [], {}, "8", [1, 2], {"a": 1}, "NaN", "", "\ud800", "a\x00b", [[[[]]]], {"x": [None]}]
URLS = ["tcp://127.0.0.1:1", "tcp://[::1]:1", "tcp://127.0.0.1:99999", "http://127.0.0.1:80", "tcp://:5", "tcp://h",
        "ucx://", "", "tcp://127.0.0.1:0"]


def value() -> st.SearchStrategy:
    # a fresh copy each draw: _set mutates what it is given, and a shared {"a": 1} grew a cycle across examples
    odd = st.sampled_from(ODD_VALUES).map(copy.deepcopy)
    return st.one_of(st.sampled_from(HOSTILE_NUMBERS), odd, st.text(max_size=12), st.integers(), st.floats())


def either(good: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(good, good, value())  # mostly well-formed, so the checks behind the types are reached


def token_lists() -> st.SearchStrategy:
    return st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                     st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(HOSTILE_NUMBERS)), max_size=6),
                     st.lists(st.integers(0, VOCAB - 1), min_size=250, max_size=300), value())


@st.composite
def valid_generate(draw) -> dict:
    """A request the worker must serve: every field in range."""
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    sampling = {"max_tokens": draw(st.integers(1, 6)), "temperature": draw(st.sampled_from([0, 0.0, 0.8, 1e-9])),
                "top_p": draw(st.sampled_from([1, 0.5, 1e-6])), "ignore_eos": draw(st.booleans()),
                "stop_token_ids": draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))}
    if draw(st.booleans()):
        sampling["seed"] = draw(st.integers(-(2**63), 2**63 - 1))
    document = {"request_id": draw(st.text(min_size=1, max_size=16)), "tokens": tokens, "sampling": sampling,
                "cache_salt": draw(st.text(max_size=8))}
    if draw(st.booleans()):
        end = draw(st.integers(0, len(tokens) // BLOCK))
        document["fetch"] = {"peer": "w1", "transfer_url": draw(st.sampled_from(["tcp://127.0.0.1:1", "tcp://[::1]:1"])),
                             "start": draw(st.integers(0, end)), "end": end}
    return document


FIELDS = ["request_id", "tokens", "sampling", "cache_salt", "fetch", "extra", "sampling.max_tokens",
          "sampling.temperature", "sampling.top_p", "sampling.seed", "sampling.stop_token_ids", "sampling.ignore_eos",
          "sampling.top_k", "fetch.peer", "fetch.transfer_url", "fetch.start", "fetch.end", "tokens.0", "tokens.-1"]
MISSING = object()


@st.composite
def generate_documents(draw) -> object:
    """A valid request with up to three fields made hostile (or dropped); now and then no document at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(value())
    document = draw(valid_generate())
    for path in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        replacement = draw(st.one_of(value(), token_lists(), st.sampled_from([MISSING, 2**31, -1, VOCAB, 10**6])))
        _set(document, path.split("."), replacement)
    return document


def _set(document: dict, path: list[str], replacement) -> None:
    head, *rest = path
    if rest:
        inner = document.get(head)
        if isinstance(inner, dict):
            _set(inner, rest, replacement)
        elif isinstance(inner, list) and rest[0].isdigit() and int(rest[0]) < len(inner) and _int(replacement):
            inner[int(rest[0])] = replacement  # an earlier mutation may have made a dict field a list: skip then
        return
    if replacement is MISSING:
        document.pop(head, None)
    else:
        document[head] = replacement


@st.composite
def pin_documents(draw) -> object:
    """A valid pin (by tokens or by text) with up to two fields made hostile or dropped; now and then junk."""
    if draw(st.integers(0, 9)) == 0:
        return draw(value())
    prefix = draw(st.one_of(st.fixed_dictionaries({"tokens": st.lists(st.integers(0, VOCAB - 1), min_size=4,
                                                                                    max_size=40)}),
                            st.fixed_dictionaries({"text": st.text(min_size=4, max_size=40)})))
    document = {**prefix, "ttl_s": draw(st.sampled_from([0.5, 60, MAX_TTL_S])), "cache_salt": draw(st.text(max_size=8))}
    if draw(st.booleans()):
        document["name"] = draw(st.text(min_size=1, max_size=12))
    for path in draw(st.lists(st.sampled_from(["tokens", "text", "ttl_s", "cache_salt", "name", "tokens.0"]),
                              max_size=2, unique=True)):
        replacement = draw(st.one_of(value(), token_lists(), st.sampled_from([MISSING, MAX_TTL_S * 2, 0, -1, VOCAB])))
        _set(document, path.split("."), replacement)
    return document


def encode_body(document, as_msgpack: bool) -> tuple[bytes, str]:
    """msgpack (how routers send) where the document can be msgpack, else JSON (NaN and lone surrogates included)."""
    if as_msgpack:
        try:
            return msgspec.msgpack.encode(document), MSGPACK
        except (OverflowError, TypeError, UnicodeEncodeError, msgspec.EncodeError):
            pass
    return json.dumps(document).encode("utf-8", "surrogatepass"), "application/json"


# -- the oracle of validity: what no answer may accept -----------------------------------------------

def _int(value) -> bool:
    return type(value) is int


def refusal_due(document) -> str | None:
    """Why this generate document must be refused, when that is certain (None: it may be served)."""
    if not isinstance(document, dict) or not isinstance(document.get("tokens"), list):
        return None  # msgspec decides the rest (base64 bytes, defaults)
    tokens = document["tokens"]
    if not tokens or not all(_int(t) and 0 <= t < VOCAB for t in tokens):
        return "tokens empty or outside the vocabulary"
    params = document.get("sampling")
    if not isinstance(params, dict):
        return None
    max_tokens = params.get("max_tokens", 16)
    if _int(max_tokens) and (max_tokens < 1 or -(-(len(tokens) + max_tokens - 1) // BLOCK) > NUM_BLOCKS):
        return "max_tokens below 1 or past the pool"
    temperature, top_p = params.get("temperature", 0.0), params.get("top_p", 1.0)
    if isinstance(temperature, (int, float)) and not temperature >= 0:
        return "temperature below 0 or NaN"
    if isinstance(top_p, (int, float)) and not 0 < top_p <= 1:
        return "top_p outside (0, 1]"
    stops = params.get("stop_token_ids", [])
    if isinstance(stops, list) and not all(_int(t) and 0 <= t < VOCAB for t in stops):
        return "stop ids outside the vocabulary"
    plan = document.get("fetch")
    if isinstance(plan, dict) and _int(plan.get("start")) and _int(plan.get("end")):
        if not 0 <= plan["start"] <= plan["end"] <= len(tokens) // BLOCK:
            return "fetch plan outside the prompt's full blocks"
    if isinstance(plan, dict) and plan.get("transfer_url") not in (None, "tcp://127.0.0.1:1", "tcp://[::1]:1"):
        return "fetch plan transfer_url is not tcp|ucx://host:port"  # what value() draws never is
    return None


def assert_error_json(status: int, payload: bytes, sent) -> None:
    assert 400 <= status < 500, f"{status} for {sent!r}: {payload[:300]!r}"
    error = json.loads(payload)["error"]
    assert isinstance(error["message"], str) and error["message"], f"no message for {sent!r}"
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"]


def assert_served(payload: bytes, raw: bytes, content_type: str, oracle) -> None:
    """A 200 is a stream of tokens then Done, with the tokens an independent engine makes."""
    events = [decode_event(line) for line in payload.splitlines() if line.strip()]
    assert events and isinstance(events[-1], Done), events[-3:]
    assert all(isinstance(event, Token) for event in events[:-1]), events
    tokens = [event.token for event in events[:-1]]
    assert all(0 <= token < VOCAB for token in tokens)
    request = (msgspec.msgpack.decode(raw, type=GenerateRequest) if content_type == MSGPACK
               else msgspec.json.decode(raw, type=GenerateRequest))
    params = request.sampling
    if params.temperature < 1e-5 or params.seed is not None:  # deterministic: comparable token for token
        assert tokens == oracle.generate(request.token_list(), params)[0]
    assert events[-1].usage.completion_tokens == len(tokens) <= params.max_tokens


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(document=generate_documents(), as_msgpack=st.booleans())
def test_hostile_generate_bodies_get_a_4xx_or_a_correct_stream(worker, oracle, document, as_msgpack):
    raw, content_type = encode_body(document, as_msgpack)
    status, payload = worker.request("POST", "/generate", raw, content_type)
    event(f"generate answered {status}")
    if status == 200:
        assert refusal_due(document) is None, f"served {document!r}, which must be refused: {refusal_due(document)}"
        assert_served(payload, raw, content_type, oracle)
    else:
        assert_error_json(status, payload, document)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(document=pin_documents(), method=st.sampled_from(["POST", "DELETE"]))
def test_hostile_pin_bodies_get_a_4xx_or_a_pin(worker, document, method):
    raw = json.dumps(document).encode("utf-8", "surrogatepass")
    status, payload = worker.request(method, "/admin/pin", raw)
    event(f"{method} /admin/pin answered {status}")
    if status != 200:
        assert_error_json(status, payload, document)
        return
    tokens = document.get("tokens") if isinstance(document, dict) else None
    assert not (isinstance(tokens, list) and tokens and not all(_int(t) and 0 <= t < VOCAB for t in tokens)), document
    reply = json.loads(payload)
    if method == "POST":
        assert 0 < document.get("ttl_s", 300.0) <= MAX_TTL_S
        assert reply["num_held"] <= reply["num_blocks"]
        worker.pins.add(reply["name"])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=64), st.binary(min_size=4, max_size=4).map(lambda b: b + b"\x00" * 8)),
       close_write=st.booleans())
def test_arbitrary_bytes_to_the_transfer_port_are_closed(worker, data, close_write):
    address = ("127.0.0.1", int(worker.transfer.url.rsplit(":", 1)[1]))
    with socket.create_connection(address, timeout=CLIENT_TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            if close_write:
                sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):  # an answer (a refusal) may come first; then the server closes
                pass
        except (ConnectionResetError, BrokenPipeError, OSError) as err:  # closed on bytes it did not read
            assert not isinstance(err, TimeoutError), "the server kept the connection open"


def test_afterwards_the_worker_serves_correctly_and_its_pool_is_clean(worker, oracle):
    for name in sorted(worker.pins):
        status, payload = worker.request("DELETE", "/admin/pin", json.dumps({"name": name}).encode())
        assert status == 200, payload
    prompt = list(b"still serving after the storm?")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    raw = msgspec.json.encode(GenerateRequest(request_id="after", tokens=prompt, sampling=params))
    status, payload = worker.request("POST", "/generate", raw)
    assert status == 200
    assert_served(payload, raw, "application/json", oracle)
    keys = chain(prompt, worker.engine.namespace)

    async def fetch_back():
        blocks = NodeBlocks(BlockPool(16))
        arena = KVArena(dataclasses.replace(worker.engine.arena.shape, num_blocks=16), worker.engine.arena.dtype)
        result = await fetch(worker.transfer.url, keys, blocks, arena, deadline_s=CLIENT_TIMEOUT_S)
        blocks.release(result.hold)
        blocks.check_integrity()
        return result.keys

    assert worker.call(fetch_back()) == keys, "the transfer port still serves the blocks just computed"
    report = worker.quiet_report()
    assert report["integrity"] == "ok" and report["num_pinned"] == 0 and report["num_streams"] == 0, report
