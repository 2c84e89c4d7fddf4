"""The router's fast path keeps its answers: frames, hashing once, fleet load bookkeeping."""

import json

import numpy as np

from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.contract.worker_api import Usage
from prefixpool.router import openai_format as fmt
from prefixpool.router.cost_model import CostModel
from prefixpool.meta.fleet_load import RouterLoad, decode_load, encode_load
from prefixpool.meta.index import BlockIndex
from prefixpool.router.inflight import InflightTracker
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import Namespace, chain
from tests.support.index_view import IndexView

USAGE = Usage(prompt_tokens=5, completion_tokens=2, local_hit_tokens=0, fetched_tokens=0, computed_tokens=5,
              fetched_bytes=0, ttft_s=0.1)


def _payload(frame: bytes) -> dict:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    return json.loads(frame[6:-2])


def test_stream_frames_equal_the_dict_chunks():
    for chat in (False, True):
        frames = fmt.StreamFrames("cmpl-1", "tiny", chat)
        shape = fmt.chat_chunk if chat else fmt.completion_chunk
        for text in ("hello", 'quote " and \\ backslash', "ünïcode ✓", "\n\t"):
            got = _payload(frames.text(text))
            want = shape("cmpl-1", "tiny", text, None)
            want["created"] = got["created"]
            assert got == want
        assert _payload(frames.last("end", "stop"))["choices"][0]["finish_reason"] == "stop"
        assert _payload(frames.usage(USAGE))["usage"]["total_tokens"] == 7


class _View(IndexView):
    def __init__(self, index: BlockIndex) -> None:
        super().__init__({"w": type("W", (), {"node_id": "w", "http_url": "", "transfer_url": "", "num_queued": 0,
                                              "num_running": 0})()}, index)


def _router(view) -> Router:
    config = RouterConfig(model="tiny", namespace=Namespace("tiny", block_size=4), max_context=4096, vocab_size=259,
                          router_id="me")
    return Router(config, ByteTokenizer(), view, WorkerClient(), CostModel(block_size=4))


def test_prepare_hashes_once_into_the_keys_every_decision_uses():
    view = _View(BlockIndex())
    router = _router(view)
    text = "héllo, prefix world! " * 3
    for body in (CompletionBody(model="tiny", prompt=text, cache_salt="t"),
                 CompletionBody(model="tiny", prompt=list(text.encode()), cache_salt="t")):
        prepared = router.prepare(body)
        assert prepared.ids.tolist() == list(text.encode())
        assert prepared.keys == chain(list(text.encode()), Namespace("tiny", block_size=4, cache_salt="t"))
    view.index.add("w", prepared.keys[:3])
    plan, matches = router.decide(prepared)
    assert matches == {"w": 3} and plan.local_blocks == 3


def test_load_is_own_plus_the_other_routers_latest_entries():
    view = _View(BlockIndex())
    router = _router(view)
    ticket = router.inflight.begin("w", 100)
    view.fleet.put(RouterLoad("other", {"w": (2, 50)}), revision=7)
    view.fleet.put(RouterLoad("me", {"w": (9, 900)}), revision=8)  # our own entry: the live count wins
    assert not view.fleet.put(RouterLoad("other", {"w": (5, 5)}), revision=6)  # older than what is held
    load = router._load("w", view.workers()["w"])
    assert (load.num_running, load.queued_prefill_tokens) == (3, 150)
    router.inflight.end(ticket)
    view.fleet.delete("other")
    load = router._load("w", view.workers()["w"])
    assert (load.num_running, load.queued_prefill_tokens) == (0, 0)
    assert decode_load(encode_load(RouterLoad("x", {"w": (1, 2)}))) == RouterLoad("x", {"w": (1, 2)})


def test_tracker_marks_workers_published_only_when_unchanged_since_the_snapshot():
    """Only an end needs a put to order the workers' own reports after it; a begin leaves the mark as it was."""
    tracker = InflightTracker()
    changes = []
    tracker.on_change = lambda: changes.append(1)
    a, b = tracker.begin("a", 10), tracker.begin("b", 20)
    assert tracker.load_of("a").published_revision == tracker.load_of("b").published_revision == 0
    assert not tracker.unpublished()
    tracker.started(a)
    tracker.end(a)
    assert tracker.load_of("a").published_revision is None and tracker.unpublished()
    snapshot = tracker.snapshot()
    tracker.end(b)  # changed after the snapshot was taken
    tracker.published(snapshot, 5)
    assert tracker.load_of("a").published_revision == 5
    assert tracker.load_of("b").published_revision is None
    assert len(changes) == 5 and tracker.snapshot() == {}
    tracker.published({}, 9)
    assert tracker.load_of("a").published_revision == 5 and tracker.load_of("b").published_revision == 9
    assert not tracker.unpublished()
    tracker.check_integrity()


def test_index_counts_lower_tier_keys_and_longest_prefix_matches_a_brute_force():
    rng = np.random.default_rng(3)
    keys = chain(rng.integers(0, 250, 64).tolist(), Namespace("tiny", block_size=4))
    index = BlockIndex()
    index.add("a", keys[:10])
    index.add("a", keys[3:5], tier="host")
    index.add("b", keys[:2] + keys[3:8])
    index.add("c", keys[1:9])
    index.check_integrity()
    assert index.longest_prefix(keys) == {"a": 10, "b": 2}
    assert index.lower_tiers("a", keys[:10]) == {"host": 2} and index.lower_tiers("b", keys) == {}
    index.add("a", keys[3:4])  # back up to the device
    index.remove("a", keys[4:5])
    index.check_integrity()
    assert index.lower_tiers("a", keys) == {} and index.num_lower("a") == 0
