"""LoRA adapters and several base models in one fleet, with a real Router and hand-written nodes.

A request naming an adapter goes only to nodes that advertise it (their NodeRecord.adapters), retries
included; its keys are the ones the vLLM sidecar's ledger computes from vLLM's BlockStored events for
that adapter (never the base model's); an unknown name is a 404 naming what exists; a node of another
base model is never a candidate. The vLLM integration test (tests/vllm/test_vllm_lora.py) checks the
same against real vLLM servers.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixpool.contract.worker_api import Done, Failed, GenerateRequest, RequestLimits, SamplingParams, Token, Usage
from prefixpool.contract.worker_api import RequestRefused, check_request
from prefixpool.meta.membership import NodeRecord
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router.cost_model import CostModel
from prefixpool.router.errors import ModelNotFound, ServiceUnavailable
from prefixpool.router.fleet import adapters_of, serving
from prefixpool.router.openai_schema import CompletionBody, RouteBody
from prefixpool.router.served_models import listing
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.vllm_client import VllmClient
from prefixpool.store.keys import Namespace, chain
from prefixpool.vllm_sidecar.events import BlockStored
from prefixpool.vllm_sidecar.ledger import Ledger

B = 4
NS = Namespace("m", block_size=B)
OTHER = Namespace("n", block_size=B)
USAGE = Usage(prompt_tokens=5, completion_tokens=2, local_hit_tokens=0, fetched_tokens=0, computed_tokens=5,
              fetched_bytes=0, ttft_s=0.01)
GOOD = [Token(104), Token(105), Done("length", USAGE)]


def record(node_id: str, namespace: Namespace = NS, adapters: tuple[str, ...] = ()) -> NodeRecord:
    return NodeRecord(node_id, f"http://{node_id}", "", B, 0, namespace.model, kind="vllm",
                      namespace=namespace.root().hex(), adapters=adapters)


class View:
    def __init__(self, nodes: list[NodeRecord]) -> None:
        self.nodes = {n.node_id: n for n in nodes}

    def longest_prefix(self, keys) -> dict[str, int]:
        return {}

    def lower_tiers(self, node_id, keys) -> dict[str, int]:
        return {}

    def fleet_share(self, worker, exclude) -> tuple[int, int]:
        return 0, 0

    def report_revision(self, node_id) -> int:
        return 0

    def workers(self) -> dict[str, NodeRecord]:
        return self.nodes

    def num_keys(self) -> int:
        return 0

    def lag_s(self) -> float:
        return 0.0


class Client:
    """Every node answers GOOD unless scripted otherwise; records (node, request) of each call."""

    def __init__(self, scripts: dict[str, list] | None = None) -> None:
        self.scripts = scripts or {}
        self.calls: list[tuple[str, GenerateRequest]] = []

    async def generate(self, url: str, request: GenerateRequest):
        node = url.removeprefix("http://")
        self.calls.append((node, request))
        for event in self.scripts.get(node, GOOD):
            yield event


FLEET = [record("a", adapters=("sql", "chat")), record("b", adapters=("chat",)), record("c"),
         record("n-0", OTHER, adapters=("sql",))]


def router_for(nodes: list[NodeRecord], policy: str = "cost", client: Client | None = None) -> Router:
    config = RouterConfig(model="m", namespace=NS, max_context=1000, vocab_size=259, policy=policy)
    return Router(config, ByteTokenizer(), View(nodes), client or Client(), CostModel(), rng=random.Random(1))


def run(router: Router, model: str, prompt: str) -> list:
    async def go() -> list:
        return [e async for e in router.generate(router.prepare(CompletionBody(model=model, prompt=prompt)))]
    return asyncio.run(go())


def test_adapters_of_lists_each_adapter_with_its_nodes_and_serving_filters_by_it():
    workers = {n.node_id: n for n in FLEET[:3]}
    assert adapters_of(workers) == {"chat": ["a", "b"], "sql": ["a"]}
    assert set(serving(workers, "sql")) == {"a"}
    assert set(serving(workers, "chat")) == {"a", "b"}
    assert set(serving(workers, None)) == {"a", "b", "c"}
    assert serving(workers, "nope") == {}


@pytest.mark.parametrize("policy", ["cost", "round_robin"])
def test_adapter_requests_go_only_to_nodes_that_serve_the_adapter(policy):
    client = Client()
    router = router_for(FLEET, policy, client)
    for model, n in [("sql", 8), ("chat", 8), ("m", 9)]:  # one model at a time: round robin's turn is shared
        for i in range(n):
            assert run(router, model, f"prompt {i} " * 3) == GOOD
    by_model: dict[str, set[str]] = {}
    for node, request in client.calls:
        by_model.setdefault(request.adapter or "m", set()).add(node)
    assert by_model["sql"] == {"a"}
    assert by_model["chat"] <= {"a", "b"}
    assert "n-0" not in set().union(*by_model.values())  # another base model's node serves "sql" too: never used
    if policy == "round_robin":
        assert by_model["chat"] == {"a", "b"} and by_model["m"] == {"a", "b", "c"}


def test_the_forwarded_request_names_the_adapter_and_vllm_gets_it_as_model():
    client = Client()
    run(router_for(FLEET, client=client), "sql", "hello there")
    (_, request), = client.calls
    assert request.adapter == "sql"
    assert VllmClient("m").body(request)["model"] == "sql"
    base = GenerateRequest(request_id="r", tokens=[1], sampling=SamplingParams())
    assert VllmClient("m").body(base)["model"] == "m"


def test_an_adapter_request_is_retried_only_on_nodes_that_serve_it():
    failing = [Failed("engine died", 503)]
    client = Client({"a": failing})
    events = run(router_for(FLEET, client=client), "sql", "hello there")
    assert events == failing  # the only "sql" node failed; b and c serve the base model and "chat" only
    assert [node for node, _ in client.calls] == ["a"]
    client = Client({"a": failing})
    assert run(router_for(FLEET, client=client), "chat", "hello there") == GOOD
    assert [node for node, _ in client.calls] in (["a", "b"], ["b"])


def test_an_adapter_whose_nodes_are_all_excluded_is_a_503_not_a_base_model_answer():
    router = router_for(FLEET)
    prepared = router.prepare(CompletionBody(model="sql", prompt="hello there"))
    with pytest.raises(ServiceUnavailable, match="sql"):
        router.decide(prepared, exclude=frozenset({"a"}))


def test_adapter_keys_are_the_ledgers_keys_for_vllms_events_of_that_adapter_and_not_the_base_models():
    router = router_for(FLEET)
    tokens = list(range(1, 17))  # 4 blocks
    for salt in ("", "tenant-1"):
        adapter_keys = router.prepare(RouteBody(model="sql", prompt=tokens, cache_salt=salt)).keys
        base_keys = router.prepare(RouteBody(model="m", prompt=tokens, cache_salt=salt)).keys
        chat_keys = router.prepare(RouteBody(model="chat", prompt=tokens, cache_salt=salt)).keys
        assert len(adapter_keys) == 4 and not set(adapter_keys) & set(base_keys)
        assert not set(adapter_keys) & set(chat_keys)
        assert adapter_keys == chain(tokens, NS.for_request(salt, "sql"))
        # what vLLM 0.32 publishes for the same prompt under adapter "sql": the LoRA name first in each
        # block's extra keys, the salt after it in the first block's (kv_cache_utils.to_event_extra_keys)
        first = ("sql", salt) if salt else ("sql",)
        event = BlockStored([1, 2, 3, 4], None, tokens, B, lora_id=1, lora_name="sql",
                            extra_keys=[first, ("sql",), ("sql",), ("sql",)])
        assert Ledger(NS).apply(event).stored == adapter_keys
        salted = [(salt,), None, None, None] if salt else None
        base_event = BlockStored([5, 6, 7, 8], None, tokens, B, extra_keys=salted)
        assert Ledger(NS).apply(base_event).stored == base_keys


def test_an_unknown_model_is_a_404_naming_the_models_and_adapters_that_exist():
    router = router_for(FLEET)
    with pytest.raises(ModelNotFound) as raised:
        router.prepare(CompletionBody(model="nope", prompt="hi"))
    error = raised.value
    assert error.status == 404 and error.code == "model_not_found" and error.param == "model"
    assert "'m'" in error.message and "['chat', 'sql']" in error.message
    assert "['n']" in error.message  # the other base model registered in the cluster, with its own router


def test_another_base_models_name_is_a_404_here_and_its_nodes_never_candidates():
    client = Client()
    router = router_for(FLEET, "round_robin", client)
    with pytest.raises(ModelNotFound, match="nodes of models"):
        router.prepare(CompletionBody(model="n", prompt="hi"))
    for i in range(8):
        run(router, "m", f"base {i}")
    assert {node for node, _ in client.calls} == {"a", "b", "c"}
    # the other model's router routes to its node only, the adapter included
    other = Router(RouterConfig(model="n", namespace=OTHER, max_context=1000, vocab_size=259), ByteTokenizer(),
                   View(FLEET), Client(), CostModel())
    assert other.decide(other.prepare(CompletionBody(model="sql", prompt="hi")))[0].worker == "n-0"
    with pytest.raises(ModelNotFound):
        other.prepare(CompletionBody(model="chat", prompt="hi"))  # served on m's nodes only


def test_models_lists_the_base_and_each_adapter_with_the_base_as_parent():
    router = router_for(FLEET)
    models = listing(router.model, router.live_workers())
    assert [(m["id"], m["parent"]) for m in models] == [("m", None), ("chat", "m"), ("sql", "m")]


def test_our_own_workers_refuse_an_adapter_request():
    limits = RequestLimits(vocab_size=259, max_model_len=100, block_size=B, num_blocks=64)
    check_request(GenerateRequest(request_id="r", tokens=[1, 2], sampling=SamplingParams()), limits)
    with pytest.raises(RequestRefused, match="LoRA") as raised:
        check_request(GenerateRequest(request_id="r", tokens=[1, 2], sampling=SamplingParams(), adapter="sql"), limits)
    assert raised.value.param == "adapter"
