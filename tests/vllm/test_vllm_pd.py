"""Prefill/decode disaggregation on two real vLLM servers (CPU, tiny random Llama) through PrefixPoolConnector.

Started the way `prefixpool up --vllm-prefill 1 --vllm-decode 1 --vllm-connector` starts them: P =
vllm-prefill-0 (connector kv_producer) and D = vllm-decode-0 (kv_consumer), their sidecars with those
roles, etcd and our router. P computes a prompt (max_tokens 1) and answers where its blocks are
(kv_transfer_params); D, given that answer, loads the blocks from P's pool instead of computing them,
which vLLM's own counter on D shows (vllm:external_prefix_cache_hits: tokens a connector supplied).
The oracle for every answer is D itself asked cold: a fresh cache_salt puts the request in a namespace
nobody holds. P's transfer server has a fault file (prefixpool/node/faults.py): a corrupted transfer
and, last, a dead P leave D computing the prompt itself, with the same answer. The tests run in file
order on one module-scoped pair of servers (vLLM starts slowly).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.vllm_server import VllmConfig
from prefixpool.meta.layout import Layout
from prefixpool.store.keys import chain
from tests.cluster.test_e2e import post
from tests.conftest import etcdctl_get_prefix
from tests.vllm.test_vllm import BLOCK, MODEL, NAMESPACE, cached, client_for, complete, route

pytestmark = pytest.mark.timeout(1200)
TEXT = "Prefill here, decode there: the blocks move through the pool while the cat sleeps by the fire. " * 10
P, D = "vllm-prefill-0", "vllm-decode-0"


def prompt(case: str) -> str:
    return f"Case {case}: {TEXT}"


class Pair:
    """etcd, P and D with the connector (and their sidecars), and our router."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.fault_file = run_dir / "fault"  # only P serves blocks in these tests: the fault is P's
        self.fault_file.write_text("")
        config = VllmConfig(str(model), MODEL, BLOCK, max_model_len=1024, num_blocks=96)
        settings = {"pool_blocks": 64, "fetch_timeout_s": 30.0, "lease_ttl_s": 60, "fault_file": str(self.fault_file)}
        self.cluster = LocalCluster(num_workers=0, vllm=config, num_vllm_prefill=1, num_vllm_decode=1,
                                    vllm_connector=True, connector_settings=settings, log_dir=run_dir)

    def url(self, node: str) -> str:
        return self.cluster.vllm_servers[node].url

    def log(self, node: str) -> str:
        return self.cluster.vllm_servers[node].log_path.read_text(errors="replace")

    def num_tokens(self, text: str) -> int:
        status, body = post(self.url(D), "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200, body
        return len(body["tokens"])

    def num_full_blocks(self, text: str) -> int:
        """Full blocks of the prompt a load can supply (never its last token)."""
        return (self.num_tokens(text) - 1) // BLOCK

    def keys(self, text: str) -> list[bytes]:
        status, body = post(self.url(D), "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200, body
        return chain(body["tokens"][: self.num_full_blocks(text) * BLOCK], NAMESPACE)

    def held_by(self, node: str) -> set[bytes]:
        """Keys of the blocks `node`'s pool publishes in etcd."""
        _, kvs = etcdctl_get_prefix(self.cluster.etcd, Layout("default").blocks_prefix.decode())
        suffix = f"/{node}.pool".encode()
        return {bytes.fromhex(k.rsplit(b"/", 2)[-2].decode()) for k in kvs if k.endswith(suffix)}

    def loads(self) -> list[tuple[int, int, int, int]]:
        """(loaded, planned, fetched, bytes) per load D's connector logged."""
        pattern = r"prefixpool load \S+: (\d+) of (\d+) blocks \((\d+) fetched from \S+, (\d+) bytes\)"
        return [tuple(map(int, m)) for m in re.findall(pattern, self.log(D))]

    def external_hits(self) -> float:
        """vLLM's own count of prompt tokens D's connector supplied (loaded, not computed)."""
        with urllib.request.urlopen(f"{self.url(D)}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(float(v) for v in re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    pair = Pair(model_dir, tmp_path_factory.mktemp("pd"))
    with pair.cluster:
        yield pair


def prefill(url: str, text: str) -> dict:
    """What the router's VllmClient.prefill sends: the prompt alone, asking for a handoff."""
    status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    return body


def decode(url: str, text: str, params: dict | None, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    status, answer = post(url, "/v1/completions", {**body, "kv_transfer_params": params} if params else body)
    assert status == 200, answer
    return answer


def cold(pair: Pair, text: str, salt: str) -> str:
    """D's own answer computing every block (a namespace nobody holds)."""
    return complete(pair.url(D), text, salt=salt).choices[0].text


def test_the_prefill_server_hands_its_blocks_to_the_decode_server_which_loads_them_instead_of_computing(pair):
    text = prompt("direct")
    num_blocks = pair.num_full_blocks(text)
    handoff = prefill(pair.url(P), text)["kv_transfer_params"]
    # P saved every full block of the prompt (one more than a load may take when the prompt ends on a boundary)
    assert handoff == {"prefixpool_pool": f"{P}.pool", "prefixpool_num_blocks": pair.num_tokens(text) // BLOCK}
    hits = pair.external_hits()
    answer = decode(pair.url(D), text, handoff)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == num_blocks * BLOCK
    assert pair.external_hits() - hits == num_blocks * BLOCK  # vLLM's own counter: supplied by the connector
    assert pair.loads()[-1] == (num_blocks, num_blocks, num_blocks, pair.loads()[-1][3])  # all fetched from P
    assert answer["choices"][0]["text"] == cold(pair, text, "direct-cold")


def test_without_a_handoff_the_decode_server_computes_and_saves_nothing_while_the_prefill_pool_holds_blocks(pair):
    text = prompt("no handoff")
    hits, num_loads = pair.external_hits(), len(pair.loads())
    answer = decode(pair.url(D), text, None)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert pair.external_hits() == hits and len(pair.loads()) == num_loads
    keys = pair.keys(text)
    deadline = time.monotonic() + 30
    while not set(pair.keys(prompt("direct"))) <= pair.held_by(D):  # what D fetched from P stays in D's pool
        assert time.monotonic() < deadline, "D's pool never published the blocks it fetched"
        time.sleep(0.2)
    assert not set(keys) & pair.held_by(D)  # kv_consumer: what D computes itself goes nowhere


def test_the_router_names_both_and_streams_the_decode_servers_answer_equal_to_one_vllm_servers(pair):
    url = pair.cluster.router_url
    text = prompt("routed")
    num_blocks = pair.num_full_blocks(text)
    plan = wait_for_pair(url, text)
    assert plan["prefill"]["node"] == P and plan["decode"]["node"] == D and plan["worker"] == D
    assert plan["kinds"] == {P: "vllm", D: "vllm"}  # pools take no requests
    hits, handoffs = pair.external_hits(), router_handoffs(url)
    stream = client_for(url).completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
    chunks = list(stream)
    text_streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert cached(chunks[-1]) == num_blocks * BLOCK  # D computed only the partial last block
    assert pair.external_hits() - hits == num_blocks * BLOCK
    assert router_handoffs(url) - handoffs == 1
    assert text_streamed == cold(pair, text, "routed-cold")
    assert text_streamed == complete(pair.url(P), text, salt="routed-one-server").choices[0].text


def router_handoffs(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(v) for v in re.findall(r"^prefixpool_pd_handoffs_total (\S+)$", text, re.M))


def wait_for_pair(url: str, text: str, timeout_s: float = 60.0) -> dict:
    """Until the router sees both nodes (sidecars registered, pools published) and pairs them for `text`."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = route(url, text)
        if (body.get("prefill") or {}).get("node") == P:
            return body
        assert time.monotonic() < deadline, f"the router never paired {P} with {D}: {json.dumps(body)[:2000]}"
        time.sleep(0.3)


def test_a_corrupted_transfer_leaves_the_decode_server_computing_the_same_answer(pair):
    text = prompt("corrupt")
    num_blocks = pair.num_full_blocks(text)
    pair.fault_file.write_text("corrupt 1")  # every block P sends leaves with a flipped byte
    try:
        handoff = prefill(pair.url(P), text)["kv_transfer_params"]
        answer = decode(pair.url(D), text, handoff)
    finally:
        pair.fault_file.write_text("")
    loaded, planned, _, _ = pair.loads()[-1]
    assert (loaded, planned) == (0, num_blocks)  # the checksum caught the first block: D recomputed all
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer["choices"][0]["text"] == cold(pair, text, "corrupt-cold")


def test_a_dead_prefill_server_leaves_the_decode_server_computing_through_the_router(pair):
    """Last: P is killed. Until its sidecar's health checks revoke it the router may still pair it; the prefill
    fails, and D computes the prompt itself. Never a wrong answer, and then D serves in place."""
    url = pair.cluster.router_url
    text = prompt("dead prefill")
    pair.cluster.vllm_servers[P].kill()
    answers = [client_for(url).completions.create(model=MODEL, prompt=f"{text} {i}", max_tokens=8, temperature=0)
               for i in range(3)]
    for i, answer in enumerate(answers):
        assert answer.choices[0].text == cold(pair, f"{text} {i}", f"dead-cold-{i}")
    # the first of them came before P's sidecar missed 3 health checks: the router still paired P
    assert "the decode server computes the prompt" in pair.cluster.router.log_path.read_text(errors="replace")
    deadline = time.monotonic() + 60
    while (plan := route(url, text + " later")).get("prefill") is not None or P in plan.get("kinds", {}):
        assert time.monotonic() < deadline, f"the router still pairs the dead {P}: {json.dumps(plan)[:1000]}"
        time.sleep(0.5)
    assert plan["worker"] == D
