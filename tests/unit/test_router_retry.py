"""The router's retry rule, with a real Router and a hand-written worker client that injects the faults.

Before the first token, a worker's 5xx (a 503 while it drains, a failed forward pass) is
retried on another worker, and shown to the client only when no other worker can take the
request; a 4xx is the request's own fault and is never retried; after the first token a
failure is passed through, never replayed on another worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.contract.worker_api import Done, Failed, Token, Usage
from prefixpool.router.cost_model import CostModel
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.worker_client import WorkerUnreachable
from prefixpool.store.keys import Namespace

USAGE = Usage(prompt_tokens=5, completion_tokens=2, local_hit_tokens=0, fetched_tokens=0, computed_tokens=5,
              fetched_bytes=0, ttft_s=0.01)


@dataclass
class Info:
    node_id: str
    http_url: str
    transfer_url: str = ""
    num_queued: int = 0
    num_running: int = 0
    load_time: float = 0.0


class View:
    def __init__(self, node_ids: list[str]) -> None:
        self.nodes = {n: Info(n, f"http://{n}") for n in node_ids}

    def longest_prefix(self, keys) -> dict[str, int]:
        return {}

    def lower_tiers(self, node_id, keys) -> dict[str, int]:
        return {}

    def fleet_share(self, worker, exclude) -> tuple[int, int]:
        return 0, 0  # no other router

    def report_revision(self, node_id) -> int:
        return 0

    def workers(self) -> dict[str, Info]:
        return self.nodes

    def num_keys(self) -> int:
        return 0

    def lag_s(self) -> float:
        return 0.0


class ScriptedClient:
    """Each worker URL answers with its scripted events; records which workers were called."""

    def __init__(self, scripts: dict[str, list]) -> None:
        self.scripts = scripts
        self.called: list[str] = []

    async def generate(self, worker_url: str, request):
        self.called.append(worker_url.removeprefix("http://"))
        for event in self.scripts[worker_url.removeprefix("http://")]:
            yield event


def answer(scripts: dict[str, list], client: ScriptedClient | None = None) -> tuple[list, list[str]]:
    client = client or ScriptedClient(scripts)
    config = RouterConfig(model="m", namespace=Namespace("m", block_size=4), max_context=1000, vocab_size=259)
    router = Router(config, ByteTokenizer(), View(list(scripts)), client, CostModel())

    async def run() -> list:
        return [event async for event in router.generate(router.prepare(CompletionBody(model="m", prompt="hello")))]
    return asyncio.run(run()), client.called


DRAINING = [Failed("worker shutting down: draining", 503)]
GOOD = [Token(104), Token(105), Done("length", USAGE)]


class FirstCallDrains(ScriptedClient):
    """Whichever worker the router tries first is draining; any other answers."""

    async def generate(self, worker_url: str, request):
        self.called.append(worker_url.removeprefix("http://"))
        for event in DRAINING if len(self.called) == 1 else GOOD:
            yield event


def test_a_draining_worker_is_retried_on_another():
    events, called = answer({"a": GOOD, "b": GOOD}, FirstCallDrains({}))
    assert events == GOOD
    assert len(called) == 2 and len(set(called)) == 2  # the retry went to the other worker


def test_with_no_other_worker_the_workers_own_failure_reaches_the_client():
    events, called = answer({"a": DRAINING})
    assert events == DRAINING and called == ["a"]


def test_a_4xx_is_never_retried():
    refused = [Failed("this request can never fit this worker", 400)]
    events, called = answer({"a": refused, "b": refused})
    assert events == refused and len(called) == 1


def test_a_failure_after_the_first_token_is_passed_through_not_replayed():
    cut = [Token(104), Failed("worker shutting down: drain deadline", 503)]
    events, called = answer({"a": cut, "b": cut})
    assert events == cut and len(called) == 1


class CutAfterTwoTokens(ScriptedClient):
    """The first worker streams two tokens and then its connection breaks (a SIGKILLed worker);
    any other worker answers the rest. Records every request it was sent."""

    def __init__(self) -> None:
        super().__init__({})
        self.requests = []

    async def generate(self, worker_url: str, request):
        self.called.append(worker_url.removeprefix("http://"))
        self.requests.append(request)
        if len(self.called) == 1:
            yield Token(104)
            yield Token(105)
            raise WorkerUnreachable("connection lost")
        yield Token(106)  # its prompt is the original 5 tokens plus the 2 already streamed; it generated 1
        yield Done("length", Usage(prompt_tokens=7, completion_tokens=1, local_hit_tokens=0, fetched_tokens=0,
                                   computed_tokens=7, fetched_bytes=0, ttft_s=0.01))


def cut_stream(temperature: float) -> tuple[list, CutAfterTwoTokens]:
    client = CutAfterTwoTokens()
    config = RouterConfig(model="m", namespace=Namespace("m", block_size=4), max_context=1000, vocab_size=259)
    router = Router(config, ByteTokenizer(), View(["a", "b"]), client, CostModel())
    body = CompletionBody(model="m", prompt="hello", max_tokens=3, temperature=temperature)

    async def run() -> list:
        return [event async for event in router.generate(router.prepare(body))]
    return asyncio.run(run()), client


def test_a_greedy_stream_cut_mid_way_resumes_on_another_worker_after_what_was_sent():
    events, client = cut_stream(temperature=0.0)
    assert [e.token for e in events if isinstance(e, Token)] == [104, 105, 106]  # each token once
    assert len(set(client.called)) == 2
    first, resumed = client.requests
    assert resumed.token_list() == first.token_list() + [104, 105]  # the rest is asked after what the client has
    assert resumed.sampling.max_tokens == 1 and first.sampling.max_tokens == 3
    done = events[-1]
    assert isinstance(done, Done)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 3)  # as the client asked


def test_a_sampled_stream_cut_mid_way_ends_with_an_error_event():
    events, client = cut_stream(temperature=0.7)
    assert [e.token for e in events if isinstance(e, Token)] == [104, 105]
    assert isinstance(events[-1], Failed) and events[-1].status == 502 and len(client.called) == 1
