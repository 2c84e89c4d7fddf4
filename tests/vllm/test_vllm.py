"""A vLLM fleet behind our router: 2 real vLLM servers (CPU, a tiny random Llama), sidecars, etcd, routers.

One module-scoped fleet (vLLM starts slowly on 2 shared cores); the tests run
in file order and the last ones kill parts of it. The model and tokenizer are
made on the spot by prefixpool/testing/tiny_llama.py (no download).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
import zmq

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.vllm_sidecar.event_stream import EventStream, StreamConfig
from prefixpool.vllm_sidecar.events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch,
                                            encode_seq)
from prefixpool.vllm_sidecar.node import HealthConfig, VllmNode
from prefixpool.deploy.vllm_server import TOPIC, VllmConfig
from prefixpool.model.tokenizer import load_tokenizer
from prefixpool.store.keys import Namespace, chain
from tests.conftest import etcdctl_get_prefix
from tests.cluster.test_e2e import _wait_for_workers, post

pytestmark = pytest.mark.timeout(1200)  # vLLM starts in minutes on 2 loaded cores; nothing here is timed

MODEL = "tiny-vllm"
BLOCK = 32
TTL_S = 10  # the sidecars' etcd lease
NAMESPACE = Namespace(model=MODEL, dtype="float32", block_size=BLOCK)
REPO = Path(__file__).resolve().parents[2]
SHARED = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 8


class EventLog:
    """Every KV event batch one vLLM server publishes (the oracle): collected by our own SUB socket, and
    completed from vLLM's replay buffer (what the SUB missed: ZMQ's slow joiner, a lost batch)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.batches: dict[int, object] = {}
        self.errors: list[BaseException] = []
        self.replay = replay
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sub.poll(200):
                    _, seq, payload = self._sub.recv_multipart()
                    self.batches[int.from_bytes(seq, "big")] = decode_batch(payload)
        except Exception as error:  # the test's message shows it
            self.errors.append(error)

    def complete(self, timeout_ms: int = 10_000) -> int:
        """Ask vLLM's replay buffer for every batch from seq 0; add those the SUB missed (their number)."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay)
        added = 0
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while dealer.poll(timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == encode_seq(END_SEQ):
                    return added
                seq = int.from_bytes(frames[2], "big")
                if seq not in self.batches:
                    self.batches[seq] = decode_batch(frames[3])
                    added += 1
            raise TimeoutError(f"vLLM's replay endpoint {self.replay} did not finish in {timeout_ms} ms")
        finally:
            dealer.close(linger=0)

    def describe(self) -> str:
        seqs = sorted(self.batches)
        missing = seqs[-1] + 1 - len(seqs) if seqs else 0
        return (f"{len(seqs)} event batches, seqs {seqs[:1]}..{seqs[-1:]} with {missing} missing, "
                f"{self.num_removed()} blocks removed, collector errors {self.errors}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        self._context.term()

    def held_keys(self) -> set[bytes]:
        """Stored minus removed, each key computed from the whole token prefix of its block."""
        prefix_of: dict[object, list[int]] = {}
        for _, batch in sorted(self.batches.items(), key=lambda b: b[0]):
            for event in batch.events:
                if isinstance(event, BlockStored):
                    tokens = [] if event.parent_block_hash is None else prefix_of[event.parent_block_hash]
                    for i, block_hash in enumerate(event.block_hashes):
                        prefix_of[block_hash] = tokens + event.token_ids[: (i + 1) * BLOCK]
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        prefix_of.pop(block_hash, None)
                elif isinstance(event, AllBlocksCleared):
                    prefix_of.clear()
        return {chain(tokens, NAMESPACE)[-1] for tokens in prefix_of.values()}

    def num_removed(self) -> int:
        return sum(len(e.block_hashes) for b in self.batches.values() for e in b.events if isinstance(e, BlockRemoved))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    config = VllmConfig(str(model_dir), MODEL, BLOCK, num_blocks=160)
    # The sidecars' lease TTL is the default (10 s): vLLM on CPU spins its threads on every core while it
    # runs, and a 3 s TTL was missed then (the node dropped out of the routers for a moment, then re-registered).
    cluster = LocalCluster(num_workers=0, vllm=config, num_vllm=2, sidecar_args=("--lease-ttl-s", str(TTL_S)),
                           log_dir=tmp_path_factory.mktemp("fleet-logs"))
    with cluster:
        server = cluster.vllm_servers["vllm-0"]
        cluster.events = EventLog(server.events, server.replay)
        extra = {}
        for name, args in [("rr", ("--policy", "round_robin")), ("other-ns", ("--block-size", "64"))]:
            extra[name] = spawn(f"router-{name}", python_argv("router", "--port", "0", *cluster._common(),
                                                              *cluster._model(), *args), cluster.log_dir)
        cluster.extra_routers = extra
        _wait_for_workers(cluster.router_url, 2)
        try:
            yield cluster
        finally:
            for child in extra.values():
                child.stop()
            cluster.events.close()


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, prompt: str, salt: str = "", max_tokens: int = 8):
    return client_for(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body={"cache_salt": salt} if salt else None)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def route(url: str, prompt: str, salt: str = "") -> dict:
    status, body = post(url, "/v1/route", {"model": MODEL, "prompt": prompt, "cache_salt": salt})
    assert status == 200, body
    return body


def wait_for_route(url: str, prompt: str, worker: str, timeout_s: float = 30.0) -> dict:
    """Until the router's index (events -> sidecar -> etcd -> mirror) shows `worker` holding the prefix."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = route(url, prompt)
        if body["matches"].get(worker, 0) > 0:
            return body
        time.sleep(0.2)
    raise AssertionError(f"the router never learned that {worker} holds the prefix: {body}")


def test_router_tokenizes_exactly_like_vllm(fleet, model_dir):
    tokenizer = load_tokenizer(model_dir)
    url = fleet.vllm_servers["vllm-0"].url
    for prompt in [SHARED, "Hello, world! 123 (ok) [x] {y}", "unicode: héllo wörld ✓", "  leading  spaces\n\tand tabs"]:
        status, body = post(url, "/tokenize", {"model": MODEL, "prompt": prompt})
        assert status == 200 and tokenizer.encode(prompt) == body["tokens"], prompt
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a fox?"}]
    status, body = post(url, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and tokenizer.encode(tokenizer.apply_chat_template(messages)) == body["tokens"]


def test_shared_prefix_lands_on_the_holder_where_round_robin_does_not(fleet):
    first = SHARED + "First question about foxes."
    answer = complete(fleet.router_url, first)
    holder = route(fleet.router_url, first)["worker"]
    wait_for_route(fleet.router_url, first, holder)
    second = SHARED + "Second question, other words."
    plan = route(fleet.router_url, second)
    assert plan["worker"] == holder and plan["kinds"] == {"vllm-0": "vllm", "vllm-1": "vllm"} and plan["fetch"] is None
    again = complete(fleet.router_url, second)
    assert cached(again) >= len(SHARED) // 4 // BLOCK * BLOCK // 2 and cached(answer) == 0
    # The same two-request pattern on a fresh prefix through a round-robin router: the second misses.
    rr = fleet.extra_routers["rr"].url
    other = "A different shared prefix, about routers and caches and blocks of tokens. " * 8
    assert cached(complete(rr, other + "One.")) == 0
    assert cached(complete(rr, other + "Two.")) == 0
    # Answers equal a cold computation (a fresh cache_salt makes vLLM recompute every block).
    cold = complete(fleet.vllm_servers["vllm-0"].url, second, salt="cold-oracle")
    assert cached(cold) == 0 and again.choices[0].text == cold.choices[0].text


def test_chat_and_stream_pass_through_with_usage(fleet):
    client = client_for(fleet.router_url)
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Tell me about the dog."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    direct = client_for(fleet.vllm_servers["vllm-1"].url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"cache_salt": "cold"})
    assert chat.choices[0].message.content == direct.choices[0].message.content
    assert chat.usage.prompt_tokens == direct.usage.prompt_tokens and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second time: a hit, reported by vLLM


def test_logprobs_through_the_router_are_vllms_own_in_the_openai_shape(fleet):
    """Completion and chat logprobs asked of a vLLM node through our router equal vLLM's own answer, computed cold."""
    router, direct = client_for(fleet.router_url), client_for(fleet.vllm_servers["vllm-1"].url)
    prompt = SHARED + "Logprobs of a fox."
    ours = router.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    theirs = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                       extra_body={"cache_salt": "lp-cold"})
    got, want = ours.choices[0].logprobs, theirs.choices[0].logprobs
    assert ours.choices[0].text == theirs.choices[0].text and len(got.tokens) == ours.usage.completion_tokens
    assert got.tokens == want.tokens and got.text_offset == want.text_offset
    assert [list(top) for top in got.top_logprobs] == [list(top) for top in want.top_logprobs]
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
    assert [v for top in got.top_logprobs for v in top.values()] == pytest.approx(
        [v for top in want.top_logprobs for v in top.values()], abs=1e-4), (got.top_logprobs, want.top_logprobs)
    messages = [{"role": "user", "content": "Logprobs of a dog."}]
    asked = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
             "top_logprobs": 2}
    want_chat = direct.chat.completions.create(**asked, extra_body={"cache_salt": "lp-cold"}).choices[0].logprobs
    for answer in (router.chat.completions.create(**asked).choices[0].logprobs.content,
                   [e for c in router.chat.completions.create(**asked, stream=True) if c.choices and
                    c.choices[0].logprobs for e in c.choices[0].logprobs.content]):
        assert [(e.token, e.bytes) for e in answer] == [(e.token, e.bytes) for e in want_chat.content]
        assert [[t.token for t in e.top_logprobs] for e in answer] == [
            [t.token for t in e.top_logprobs] for e in want_chat.content]
        assert [e.logprob for e in answer] == pytest.approx([e.logprob for e in want_chat.content], abs=1e-4)
    status, body = post(fleet.router_url, "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21})
    assert status == 422 and body["error"]["param"] == "logprobs"  # our limit, vLLM's default max_logprobs


def test_bad_input_through_the_router_is_a_4xx_with_a_message(fleet):
    url = fleet.router_url
    too_long = {"model": MODEL, "prompt": "hello", "max_tokens": 3000}  # our check: 4096; vLLM's max_model_len: 2048
    status, body = post(url, "/v1/completions", too_long)
    assert status == 400 and "max_model_len" in body["error"]["message"]
    assert post(url, "/v1/completions", b"{not json")[0] == 400
    status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]})
    assert status == 400 and "vocabulary" in body["error"]["message"]
    assert post(url, "/v1/chat/completions", {"model": MODEL, "messages": []})[0] == 422
    status, body = post(url, "/v1/completions", {"model": "sql-lora", "prompt": "hello", "max_tokens": 2})
    assert status == 404 and "LoRA adapters" in body["error"]["message"]  # an adapter's name: refused, and why


def test_a_router_of_another_namespace_refuses_clearly(fleet):
    url = fleet.extra_routers["other-ns"].url
    status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 503 and "refusing to route across namespaces" in body["error"]["message"]
    assert "block size 32" in body["error"]["message"]


def test_a_sidecar_told_another_model_refuses_to_register(fleet):
    server = fleet.vllm_servers["vllm-0"]
    argv = python_argv("vllm-node", "--vllm-url", server.url, "--kv-events", server.events, "--model", "not-this-one",
                       "--cluster", "mismatch", *fleet._common())
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--served-model-name not-this-one" in done.stderr
    _, kvs = etcdctl_get_prefix(fleet.etcd, Layout("mismatch").prefix.decode())
    assert kvs == {}


def requests_seen(url: str, node: str) -> int:
    return route(url, "load probe")["loads"][node]["requests"]


@contextlib.contextmanager
def explained_by_sidecar(cluster, name: str):
    """A failure inside says what the node's sidecar warned of (a lost lease, vLLM not answering)."""
    try:
        yield
    except (AssertionError, KeyError) as error:
        path = cluster.log_dir / f"{name}-sidecar.log"
        lines = path.read_text().splitlines() if path.exists() else []
        warned = [line for line in lines if " WARNING " in line or " ERROR " in line]
        raise AssertionError(f"{error!r}; {name}'s sidecar warned: {warned[-10:]}") from error


def test_load_sent_to_vllm_directly_reaches_every_router_through_the_sidecar(fleet):
    """No router sent this request: both routers learn of it from vLLM's /metrics, via the node's record."""
    with explained_by_sidecar(fleet, "vllm-1"):
        _load_reaches_every_router(fleet)


def _load_reaches_every_router(fleet):
    server = fleet.vllm_servers["vllm-1"]
    routers = [fleet.router_url, fleet.extra_routers["rr"].url]
    deadline = time.monotonic() + 60  # the second router's mirror may not list vllm-1 yet
    while any("vllm-1" not in route(url, "load probe")["loads"] for url in routers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [requests_seen(url, "vllm-1") for url in routers] == [0, 0]
    seen: list[list[int]] = []
    streamed: list[int] = []  # tokens the busy stream got, so a failure says whether it ran at all

    failed: list[BaseException] = []

    def busy() -> None:  # streams, one after another until the load was seen (a fast vLLM ends one early)
        try:
            while not seen and time.monotonic() < deadline:
                stream = client_for(server.url).completions.create(
                    model=MODEL, prompt="Busy " + SHARED, max_tokens=1500, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
                for _ in stream:
                    streamed.append(1)
                    if seen:
                        break
                stream.close()
        except Exception as error:  # the failure's message shows it
            failed.append(error)

    deadline = time.monotonic() + 90
    thread = threading.Thread(target=busy)
    thread.start()
    history = []
    while not seen and time.monotonic() < deadline:
        counts = [requests_seen(url, "vllm-1") for url in routers]
        history.append((len(streamed), counts))
        if all(counts):
            seen.append(counts)
        time.sleep(0.1)
    seen.append([])  # lets the stream go even when the load was never seen
    thread.join(120)
    assert seen[0] == [1, 1], (f"the routers never saw vLLM's own count: (tokens streamed, counts) {history[::5]}; "
                               f"the stream failed: {failed}")
    _, kvs = etcdctl_get_prefix(fleet.etcd, Layout("default").node_key("vllm-1").decode())
    assert len(kvs) == 1  # the record that carries it
    deadline = time.monotonic() + 60
    while any(requests_seen(url, "vllm-1") for url in routers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [requests_seen(url, "vllm-1") for url in routers] == [0, 0]


def test_etcd_keys_equal_what_vllm_reported_stored_minus_removed(fleet):
    """Rounds of new prompts through a 160-block cache until vLLM has evicted, then etcd's keys for the
    server must equal what it published: stored minus removed, every batch it ever sent."""
    url = fleet.vllm_servers["vllm-0"].url
    layout = Layout("default")
    held: set[bytes] = set()
    for i in range(24):  # ~19 blocks a round: vLLM evicts from round 8 on at the latest, and says so
        complete(url, f"Eviction round {i}: " + SHARED * 2, max_tokens=2)
        if i < 7:
            continue
        fleet.events.complete()
        if not fleet.events.num_removed():
            continue
        expected = fleet.events.held_keys()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            _, kvs = etcdctl_get_prefix(fleet.etcd, layout.blocks_prefix.decode())
            held = {e.key for e in map(layout.parse_block, kvs) if e is not None and e.node_id == "vllm-0"}
            if held == expected:
                break
            time.sleep(0.3)
        break
    assert fleet.events.num_removed() > 0, f"no eviction reported after {i + 1} rounds: {fleet.events.describe()}"
    expected = fleet.events.held_keys()
    assert held == expected and len(expected) > 20, (
        f"etcd holds {len(held)} keys, vLLM reported {len(expected)} ({len(held - expected)} extra, "
        f"{len(expected - held)} missing): {fleet.events.describe()}")


def test_dropped_events_are_repaired_from_the_replay_endpoint(fleet):
    """A second, in-process sidecar for vllm-1 that loses every third batch once: it must end up equal."""
    server = fleet.vllm_servers["vllm-1"]
    dropped: set[int] = set()

    def drop(seq: int) -> bool:
        if seq % 3 == 1 and seq not in dropped:
            dropped.add(seq)
            return True
        return False

    async def scenario() -> tuple[set, set, set, EventStream]:
        etcd = EtcdClient(fleet.etcd.endpoint)
        layout = Layout("repair-probe")
        record = NodeRecord("probe", server.url, "", BLOCK, 0, MODEL, kind="vllm", namespace=NAMESPACE.root().hex())
        stream = EventStream(StreamConfig(server.events, server.replay, TOPIC), drop=drop)
        node = VllmNode(etcd, layout, record, NAMESPACE, stream, MembershipConfig(ttl_s=5), HealthConfig(0.5))
        task = asyncio.create_task(node.run())
        await asyncio.wait_for(node.registered.wait(), 60)
        await asyncio.sleep(1.0)  # slow joiner
        main, probe = Layout("default"), layout
        before = await _settled_keys(etcd, main, "vllm-1")  # stored before the probe listened: it cannot know them
        for i in range(4):
            await asyncio.to_thread(complete, server.url, f"Repair round {i}: " + SHARED, max_tokens=4)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            await node.publisher.flush()
            ours = await _keys(etcd, probe, "probe")
            theirs = await _keys(etcd, main, "vllm-1")
            if learned_alike(ours, theirs, before) and stream.num_replayed:
                break
            await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stream.close()
        await etcd.close()
        return ours, theirs, before, stream

    ours, theirs, before, stream = asyncio.run(scenario())
    assert dropped and stream.num_gaps > 0 and stream.num_replayed >= len(dropped) - 1
    assert learned_alike(ours, theirs, before), (f"advertised by the probe only: {len(ours - theirs)}, "
                                                 f"missed since it listened: {len(theirs - ours - before)}")
    assert len(ours) > 10


def learned_alike(ours: set[bytes], theirs: set[bytes], before: set[bytes]) -> bool:
    """The probe advertises only what vLLM holds, and misses only what vLLM stored before it listened."""
    return ours <= theirs and theirs - ours <= before


async def _settled_keys(etcd: EtcdClient, layout: Layout, node_id: str) -> set[bytes]:
    """The node's keys once its sidecar has published all it was told (no traffic runs now): equal twice, 1 s apart."""
    keys = await _keys(etcd, layout, node_id)
    for _ in range(30):
        await asyncio.sleep(1.0)
        keys, previous = await _keys(etcd, layout, node_id), keys
        if keys == previous:
            break
    return keys


async def _keys(etcd: EtcdClient, layout: Layout, node_id: str) -> set[bytes]:
    snapshot = await etcd.get_prefix(layout.blocks_prefix)
    return {e.key for e in map(layout.parse_block, (kv.key for kv in snapshot.kvs)) if e and e.node_id == node_id}


def test_a_killed_vllm_server_takes_its_keys_with_it(fleet):
    layout = Layout("default")
    server = fleet.vllm_servers["vllm-1"]
    assert _node_keys(fleet, layout, "vllm-1")
    server.kill()
    deadline = time.monotonic() + 30  # 3 missed health checks of 1 s, then a revoke
    while _node_keys(fleet, layout, "vllm-1") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _node_keys(fleet, layout, "vllm-1")
    _, nodes = etcdctl_get_prefix(fleet.etcd, layout.node_key("vllm-1").decode())
    assert nodes == {}
    # Requests keep being served, by the node left.
    assert complete(fleet.router_url, SHARED + "After the kill.").choices[0].finish_reason == "length"


def test_a_killed_sidecar_takes_its_keys_with_it_within_the_ttl(fleet):
    layout = Layout("default")
    assert _node_keys(fleet, layout, "vllm-0")
    fleet.sidecars["vllm-0"].process.kill()
    deadline = time.monotonic() + 3 * TTL_S
    while _node_keys(fleet, layout, "vllm-0") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _node_keys(fleet, layout, "vllm-0")


def _node_keys(fleet, layout: Layout, node_id: str) -> set[bytes]:
    _, kvs = etcdctl_get_prefix(fleet.etcd, layout.blocks_prefix.decode())
    return {e.key for e in map(layout.parse_block, kvs) if e is not None and e.node_id == node_id}
