"""Two real vLLM servers (CPU, tiny random Llama) sharing KV through PrefixPoolConnector, etcd and TCP.

Started the way `prefixpool up --vllm 2 --vllm-connector` starts them (etcd,
sidecars, our router). A computes a prompt; B, asked the same prompt, loads its
prefix from A's pool instead of recomputing it, and the router's plan for B
names A's pool as the peer. The oracle for every answer is B itself asked cold:
a fresh cache_salt puts the request in a namespace nobody holds, so vLLM
recomputes every block. A's transfer server has a fault file (prefixpool/node/faults.py)
that the tests switch between serving normally, corrupting blocks, pausing
and stalling mid-fetch; a test kills A during such a stall. B loads from A and from its own SSD in
the background (vLLM runs its other requests meanwhile) and from its own host
arena layer by layer; both pools write saved blocks through to their SSD tier. The tests run
in file order on one module-scoped pair of servers (vLLM starts slowly).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.meta.layout import Layout
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.tier_names import DEVICE
from tests.conftest import etcdctl_get_prefix
from tests.cluster.test_e2e import post
from tests.vllm.test_vllm import BLOCK, MODEL, cached, client_for, complete, wait_for_route

pytestmark = pytest.mark.timeout(1200)
NAMESPACE = Namespace(model=MODEL, dtype="float32", block_size=BLOCK)
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 8
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # layers * (k, v) * tokens * kv heads * head dim * float32


def prompt(case: str) -> str:
    return f"Case {case}: {TEXT}"


class Pair:
    """etcd, A = vllm-0 and B = vllm-1 with the connector (and their sidecars), and our router."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.fault_file = run_dir / "fault"  # only A serves in these tests: the fault is A's
        self.fault_file.write_text("")
        config = VllmConfig(str(model), MODEL, BLOCK, max_model_len=1024, num_blocks=96)
        self.ssd = run_dir / "ssd"
        settings = {"pool_blocks": 16, "disk_tier_dir": str(self.ssd), "disk_tier_blocks": 512,
                    "ssd_write_through": True, "fetch_timeout_s": 30.0, "lease_ttl_s": 60,
                    "fault_file": str(self.fault_file)}
        self.cluster = LocalCluster(num_workers=0, vllm=config, num_vllm=2, vllm_connector=True,
                                    connector_settings=settings, log_dir=run_dir)
        self.names = {"a": "vllm-0", "b": "vllm-1"}

    @property
    def etcd(self):
        return self.cluster.etcd

    def server(self, name: str) -> VllmServer:
        return self.cluster.vllm_servers[self.names[name]]

    def url(self, name: str) -> str:
        return self.server(name).url

    def log(self, name: str) -> str:
        return self.server(name).log_path.read_text(errors="replace")

    def keys(self, text: str) -> list[bytes]:
        """The keys of the blocks a request for `text` can load (its full blocks, never its last token)."""
        status, body = post(self.url("b"), "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200, body
        tokens = body["tokens"]
        return chain(tokens[: (len(tokens) - 1) // BLOCK * BLOCK], NAMESPACE)

    def held_by(self, name: str) -> dict[bytes, str]:
        """{key: tier} of the blocks `name`'s pool publishes in etcd."""
        _, kvs = etcdctl_get_prefix(self.etcd, Layout("default").blocks_prefix.decode())
        suffix = f"/{self.names[name]}.pool".encode()
        return {bytes.fromhex(k.rsplit(b"/", 2)[-2].decode()): v.decode() for k, v in kvs.items() if k.endswith(suffix)}

    def on_ssd(self, name: str) -> set[bytes]:
        return {bytes.fromhex(p.stem) for p in (self.ssd / self.names[name]).glob("*.blk")}

    def pauses(self) -> int:
        return self.log("a").count("prefixpool fault: pausing")

    def wait_held(self, name: str, keys: list[bytes], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(keys) <= self.held_by(name).keys():
            assert time.monotonic() < deadline, f"{name}'s pool never published the prompt's blocks"
            time.sleep(0.2)
        time.sleep(1.0)  # B's etcd mirror follows a watch: give it the moment etcdctl already had

    def loads(self, name: str) -> list[tuple[int, int, int, int]]:
        """(loaded, planned, fetched, bytes) per load the connector logged."""
        pattern = r"prefixpool load \S+: (\d+) of (\d+) blocks \((\d+) fetched from \S+, (\d+) bytes\)"
        return [tuple(map(int, m)) for m in re.findall(pattern, self.log(name))]


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's /reset_prefix_cache (its own cache; the pool keeps its blocks)
        pair = Pair(model_dir, tmp_path_factory.mktemp("conn"))
        with pair.cluster:
            yield pair


def test_b_loads_a_prefix_computed_on_a_and_answers_like_a_cold_recompute(pair):
    text = prompt("one")
    keys = pair.keys(text)
    first = complete(pair.url("a"), text)
    pair.wait_held("a", keys)
    plan = wait_for_route(pair.cluster.router_url, text, "vllm-0.pool")
    assert plan["kinds"] == {"vllm-0": "vllm", "vllm-1": "vllm"}  # a pool takes no requests
    assert plan["matches"]["vllm-0.pool"] >= len(keys)
    assert [c["fetch_from"] for c in plan["candidates"] if c["worker"] == "vllm-1"] == ["vllm-0.pool"]
    loads_before = len(pair.loads("b"))
    answer = complete(pair.url("b"), text)
    assert cached(answer) == len(keys) * BLOCK  # vLLM counts the connector's tokens as cached
    assert pair.loads("b")[loads_before:] == [(len(keys), len(keys), len(keys), len(keys) * BLOCK_BYTES)]
    assert set(keys) <= pair.held_by("b").keys()  # the fetched blocks are B's now, published under B's lease
    cold = complete(pair.url("b"), text, salt="cold-one")
    assert cached(cold) == 0
    assert answer.choices[0].text == cold.choices[0].text == first.choices[0].text


def test_b_runs_another_request_to_its_end_while_a_prefix_loads_in_the_background(pair):
    """Ordering, not timing: A holds B's fetch (fault "pause") until the test lets go, and
    B's other request streams all its tokens before that; a load on vLLM's engine thread
    would hold that stream until the fetch's deadline and then recompute."""
    text = prompt("five")
    keys = pair.keys(text)
    complete(pair.url("a"), text)
    pair.wait_held("a", keys)
    pauses, loads_before = pair.pauses(), len(pair.loads("b"))
    pair.fault_file.write_text("pause 2")
    answers = []
    asking = threading.Thread(target=lambda: answers.append(complete(pair.url("b"), text)))
    asking.start()
    try:
        deadline = time.monotonic() + 120
        while pair.pauses() == pauses:
            assert time.monotonic() < deadline and asking.is_alive(), "B never fetched from A"
            time.sleep(0.1)
        stream = client_for(pair.url("b")).completions.create(
            model=MODEL, prompt=prompt("other"), max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "other-five", "ignore_eos": True})
        chunks = list(stream)  # vLLM may merge tokens into one chunk when the reader lags: count usage
        assert chunks[-1].usage.completion_tokens == 16  # the other request ran to its end...
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert asking.is_alive() and not answers  # ...while the loading one still waited for A
        assert pair.loads("b")[loads_before:] == []  # and its load had not ended
    finally:
        pair.fault_file.write_text("")
    asking.join(180)
    assert answers, "B never answered once A let the fetch go on"
    assert pair.loads("b")[loads_before:] == [(len(keys), len(keys), len(keys), len(keys) * BLOCK_BYTES)]
    assert pair.log("b").count("[background]") >= 2  # test 1's load and this one
    assert cached(answers[0]) == len(keys) * BLOCK
    cold = complete(pair.url("b"), text, salt="cold-five")
    assert answers[0].choices[0].text == cold.choices[0].text


def test_write_through_puts_saved_blocks_on_the_ssd_while_they_are_still_in_memory(pair):
    text = prompt("six")
    keys = pair.keys(text)
    complete(pair.url("b"), text)
    pair.wait_held("b", keys)
    deadline = time.monotonic() + 60
    while not set(keys) <= pair.on_ssd("b"):
        assert time.monotonic() < deadline, "the saved blocks never reached B's SSD tier"
        time.sleep(0.2)
    held = pair.held_by("b")
    assert {held[key] for key in keys} == {DEVICE}  # in the pool's arena still: written through, not evicted


def test_corrupted_blocks_are_rejected_and_recomputed(pair):
    text = prompt("two")
    keys = pair.keys(text)
    complete(pair.url("a"), text)
    pair.wait_held("a", keys)
    pair.fault_file.write_text("corrupt 3")  # blocks 3, 6, ... of each fetch leave A damaged
    loads_before = len(pair.loads("b"))
    answer = complete(pair.url("b"), text)
    pair.fault_file.write_text("")
    assert pair.loads("b")[loads_before:] == [(2, len(keys), 2, 2 * BLOCK_BYTES)]  # exactly the intact prefix
    cold = complete(pair.url("b"), text, salt="cold-two")
    assert answer.choices[0].text == cold.choices[0].text


def test_a_dying_mid_fetch_costs_b_a_recompute_not_an_answer(pair):
    text = prompt("three")
    keys = pair.keys(text)
    complete(pair.url("a"), text)
    pair.wait_held("a", keys)
    pair.fault_file.write_text("stall 4")
    loads_before = len(pair.loads("b"))
    answers = []
    asking = threading.Thread(target=lambda: answers.append(complete(pair.url("b"), text)))
    asking.start()
    deadline = time.monotonic() + 120
    while "prefixpool fault: stalling" not in pair.log("a"):
        assert time.monotonic() < deadline and asking.is_alive(), "A never stalled mid-fetch"
        time.sleep(0.1)
    pair.server("a").kill()
    asking.join(180)
    assert answers, "B never answered after A died"
    assert pair.loads("b")[loads_before:] == [(4, len(keys), 4, 4 * BLOCK_BYTES)]
    cold = complete(pair.url("b"), text, salt="cold-three")
    assert answers[0].choices[0].text == cold.choices[0].text


def test_b_restarted_serves_a_prefix_from_its_warm_ssd_tier(pair):
    text = prompt("one")  # test 1's prompt: on B's SSD (written through, and pushed out of its 16-block arena since)
    keys = pair.keys(text)
    assert set(keys) <= pair.on_ssd("b")
    pair.server("b").stop()
    restarted = VllmServer.launch(pair.cluster.vllm_config_for("vllm-1"), pair.cluster.log_dir, "vllm-1-again",
                                  vllm_temp_dir())
    pair.cluster.vllm_servers["vllm-1"] = restarted
    restarted.wait_healthy(900)
    pair.wait_held("b", keys)  # the SSD scan re-published them under the new process's lease
    answer = complete(pair.url("b"), text)
    assert cached(answer) == len(keys) * BLOCK
    assert pair.loads("b") == [(len(keys), len(keys), 0, 0)]  # all from its own SSD: A is dead
    assert "[background]" in pair.log("b")  # read from the disk while vLLM could run other requests
    cold = complete(pair.url("b"), text, salt="cold-four")
    assert answer.choices[0].text == cold.choices[0].text


def test_b_loads_a_prefix_from_its_own_arena_layer_by_layer(pair):
    """B computes a prompt (its pool saves the blocks into the host arena); with vLLM's own cache reset,
    B takes the prefix from the arena a layer at a time under the forward pass."""
    text = prompt("seven")
    keys = pair.keys(text)
    first = complete(pair.url("b"), text)
    pair.wait_held("b", keys)
    held = pair.held_by("b")
    assert {held[key] for key in keys} == {DEVICE}  # in the arena (also written through to SSD)
    status, body = post(pair.url("b"), "/reset_prefix_cache", b"")
    assert (status, body) == (200, {"success": True})  # nothing running holds a block
    loads_before = len(pair.loads("b"))
    answer = complete(pair.url("b"), text)
    assert cached(answer) == len(keys) * BLOCK
    assert pair.loads("b")[loads_before:] == [(len(keys), len(keys), 0, 0)]
    # vLLM's CPU attention waited for both layers' copies
    assert f"prefixpool layer-wise load: {len(keys)} blocks, 2 of 2 layers waited for" in pair.log("b")
    cold = complete(pair.url("b"), text, salt="cold-seven")
    assert answer.choices[0].text == cold.choices[0].text == first.choices[0].text


def test_a_reset_of_the_connector_cache_empties_b_s_pool_so_nothing_stale_is_loaded(pair):
    """`/reset_prefix_cache?reset_external=true` (after a weight update): B's pool forgets its blocks at
    vLLM's next step, before that step's loads; the request that step plans from the pool recomputes."""
    text = prompt("seven")  # in B's arena (the test above)
    keys = pair.keys(text)
    assert set(keys) <= pair.held_by("b").keys()
    status, body = post(pair.url("b"), "/reset_prefix_cache?reset_external=true", b"")
    assert (status, body) == (200, {"success": True})
    loads_before = len(pair.loads("b"))
    answer = complete(pair.url("b"), text)
    cleared = re.findall(r"prefixpool pool cleared: (\d+) blocks forgotten", pair.log("b"))
    assert len(cleared) == 1 and int(cleared[0]) >= len(keys)
    assert [loaded for loaded, *_ in pair.loads("b")[loads_before:]] in ([], [0])  # a plan made before: nothing
    cold = complete(pair.url("b"), text, salt="cold-eight")
    assert answer.choices[0].text == cold.choices[0].text
