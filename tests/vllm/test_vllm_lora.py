"""LoRA adapters through the router: 2 real vLLM servers (CPU, a tiny random Llama), only vllm-0 with adapter "sql".

One module-scoped fleet (`prefixpool up --vllm 2 --lora-modules sql=DIR --lora-nodes 1`, as LocalCluster),
its router (cost policy) and a round-robin router beside it. The adapter is written by
prefixpool/testing/tiny_lora.py (random A and B: its answers differ from the base model's). Oracles
independent of the router: vLLM's own answers and request counters, and etcd read by etcdctl.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import openai
import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.deploy.vllm_server import DEFAULT_PYTHON, VllmConfig
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import decode_record
from prefixpool.model.tokenizer import load_tokenizer
from prefixpool.store.keys import Namespace, chain
from tests.cluster.test_e2e import _wait_for_workers, post
from tests.conftest import etcdctl_get_prefix

pytestmark = pytest.mark.timeout(1200)  # vLLM starts in minutes on 2 loaded cores; nothing here is timed

MODEL = "tiny-vllm"
ADAPTER = "sql"
BLOCK = 32
NAMESPACE = Namespace(model=MODEL, dtype="float32", block_size=BLOCK)
LAYOUT = Layout("default")
SHARED = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 6


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-sql")
    subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_lora", str(model_dir), str(out),
                    "--rank", "8"], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def fleet(model_dir, adapter_dir, tmp_path_factory):
    config = VllmConfig(str(model_dir), MODEL, BLOCK, num_blocks=160, lora_modules=((ADAPTER, str(adapter_dir)),),
                        max_lora_rank=8)
    cluster = LocalCluster(num_workers=0, vllm=config, num_vllm=2, lora_nodes=1,
                           log_dir=tmp_path_factory.mktemp("lora-fleet-logs"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # read by vLLM at start: the last test loads one
        cluster.start()  # stops what it started if it fails
    try:
        rr = spawn("router-rr", python_argv("router", "--port", "0", *cluster._common(), *cluster._model(),
                                            "--policy", "round_robin"), cluster.log_dir)
        cluster.extra_routers = {"rr": rr}
        try:
            for url in (cluster.router_url, rr.url):
                _wait_for_workers(url, 2, timeout_s=60)
            yield cluster
        finally:
            rr.stop()
    finally:
        cluster.stop()


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, prompt: str, model: str = ADAPTER, max_tokens: int = 8):
    return client_for(url).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def text_of(response) -> str:
    """The answer's text without U+FFFD: a random model's tokens split UTF-8 characters, which vLLM holds back
    at the end of a stream and the router's detokenizer shows as replacement characters."""
    return response.choices[0].text.replace("\ufffd", "")


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def route(url: str, prompt: str, model: str = ADAPTER) -> dict:
    status, body = post(url, "/v1/route", {"model": model, "prompt": prompt})
    assert status == 200, body
    return body


def requests_done(vllm_url: str) -> float:
    """vLLM's own count of finished requests (every model and adapter, every finish reason)."""
    with urllib.request.urlopen(f"{vllm_url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def etcd_keys(fleet, node_id: str) -> set[bytes]:
    _, kvs = etcdctl_get_prefix(fleet.etcd, LAYOUT.blocks_prefix.decode())
    return {e.key for e in map(LAYOUT.parse_block, kvs) if e is not None and e.node_id == node_id}


def wait_for_keys(fleet, node_id: str, keys: list[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not set(keys) <= etcd_keys(fleet, node_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(keys) <= etcd_keys(fleet, node_id), f"{node_id} never published the keys"


def test_only_the_node_started_with_the_adapter_advertises_it(fleet):
    records = {}
    for node_id in ("vllm-0", "vllm-1"):
        _, kvs = etcdctl_get_prefix(fleet.etcd, LAYOUT.node_key(node_id).decode())
        (raw,) = kvs.values()
        records[node_id] = decode_record(raw)
    assert records["vllm-0"].adapters == (ADAPTER,) and records["vllm-1"].adapters == ()
    with urllib.request.urlopen(f"{fleet.router_url}/v1/models") as reply:
        models = [(m["id"], m["parent"]) for m in json.load(reply)["data"]]
    assert models == [(MODEL, None), (ADAPTER, MODEL)]
    assert [m.id for m in client_for(fleet.router_url).models.list()] == [MODEL, ADAPTER]


def test_adapter_requests_always_land_on_its_node_with_its_answers(fleet):
    """Round robin and cost alike: vllm-1 never sees one (vLLM there would answer 404 for "sql")."""
    adapter_node, other = fleet.vllm_servers["vllm-0"].url, fleet.vllm_servers["vllm-1"].url
    before = requests_done(other)
    answers = {}
    for i in range(4):
        for router in (fleet.router_url, fleet.extra_routers["rr"].url):
            prompt = f"Question {i} about foxes and dogs, asked through the router."
            assert route(router, prompt)["worker"] == "vllm-0"
            answers[prompt] = text_of(complete(router, prompt))
    assert requests_done(other) == before  # vLLM's own count: nothing reached vllm-1
    for prompt, text in answers.items():  # the adapter's answer, not the base model's
        assert text == text_of(complete(adapter_node, prompt))
    base = {p: text_of(complete(adapter_node, p, model=MODEL)) for p in answers}
    assert base != answers  # a random adapter changes greedy answers: the router forwarded "sql" as the model
    # the base model still goes to both nodes through the round-robin router
    before = requests_done(other)
    for i in range(4):
        complete(fleet.extra_routers["rr"].url, f"Base question {i}.", model=MODEL)
    deadline = time.monotonic() + 30  # vLLM counts a request after its answer is out
    while requests_done(other) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert requests_done(other) > before


def test_repeated_adapter_prompts_reuse_its_cache_under_its_own_namespace(fleet):
    prompt, second = SHARED + "Adapter question one.", SHARED + "Adapter question two."
    tokenizer = load_tokenizer(fleet.vllm.model_path)
    tokens, second_tokens = tokenizer.encode(prompt), tokenizer.encode(second)
    common = next(i for i, (a, b) in enumerate(zip(tokens, second_tokens)) if a != b)
    adapter_keys = chain(tokens, NAMESPACE.for_request("", ADAPTER))
    base_keys = chain(tokens, NAMESPACE)
    assert len(adapter_keys) >= 4 and not set(adapter_keys) & set(base_keys)
    assert cached(complete(fleet.router_url, prompt)) == 0
    wait_for_keys(fleet, "vllm-0", adapter_keys)  # vLLM's events (lora_name "sql") -> sidecar -> etcd
    plan = route(fleet.router_url, second)
    assert plan["worker"] == "vllm-0" and plan["adapter"] == ADAPTER and plan["matches"]["vllm-0"] == common // BLOCK
    again = complete(fleet.router_url, second)
    assert cached(again) >= common // BLOCK * BLOCK > 0  # vLLM's own prefix-cache hit on the shared blocks
    # the base model's keys for the same tokens are not the adapter's: no node holds them yet
    assert not set(base_keys) & (etcd_keys(fleet, "vllm-0") | etcd_keys(fleet, "vllm-1"))
    assert not any(route(fleet.router_url, prompt, model=MODEL)["matches"].values())
    base = complete(fleet.vllm_servers["vllm-0"].url, prompt, model=MODEL)
    assert cached(base) == 0  # vLLM too keeps them apart
    wait_for_keys(fleet, "vllm-0", base_keys)
    assert set(adapter_keys) <= etcd_keys(fleet, "vllm-0")  # both held, each under its own namespace


def test_an_unknown_adapter_is_a_404_naming_the_models_and_adapters_that_exist(fleet):
    status, body = post(fleet.router_url, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert repr(MODEL) in body["error"]["message"] and repr([ADAPTER]) in body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        complete(fleet.router_url, "hi", model="nope")


def served_models(router_url: str) -> list[str]:
    with urllib.request.urlopen(f"{router_url}/v1/models") as reply:
        return [m["id"] for m in json.load(reply)["data"]]


def wait_for_models(router_url: str, expected: list[str], timeout_s: float = 60.0) -> None:
    """Until the sidecar's next look at vLLM's /v1/models (every 5 s) reached the router through etcd."""
    deadline = time.monotonic() + timeout_s
    while served_models(router_url) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served_models(router_url) == expected


def lora_admin(vllm_url: str, action: str, body: dict) -> None:
    request = urllib.request.Request(f"{vllm_url}/v1/{action}_lora_adapter", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200


def test_an_adapter_loaded_at_runtime_is_advertised_and_routed_and_gone_once_unloaded(fleet, adapter_dir):
    """vLLM's /v1/load_lora_adapter on vllm-0 (the env VLLM_ALLOW_RUNTIME_LORA_UPDATING allows it)."""
    server = fleet.vllm_servers["vllm-0"].url
    lora_admin(server, "load", {"lora_name": "extra", "lora_path": str(adapter_dir)})
    wait_for_models(fleet.router_url, [MODEL, "extra", ADAPTER])
    for i in range(3):
        prompt = f"Runtime adapter question {i}."
        assert route(fleet.extra_routers["rr"].url, prompt, model="extra")["worker"] == "vllm-0"
        assert text_of(complete(fleet.extra_routers["rr"].url, prompt, model="extra")) == text_of(
            complete(server, prompt, model="extra"))
    lora_admin(server, "unload", {"lora_name": "extra"})
    wait_for_models(fleet.router_url, [MODEL, ADAPTER])
    with pytest.raises(openai.NotFoundError):
        complete(fleet.router_url, "hi", model="extra")
