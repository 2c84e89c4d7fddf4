"""The connector's scheduler-side lookup (prefixpool/vllm_connector/scheduler.py) on a real etcd, without vLLM.

A peer pool "a.pool" publishes a prompt's blocks; the connector's scheduler
side on node "b" plans a background load of them. Its lookup runs on the etcd
mirror's thread: while that thread is busy (the fault: a task that holds it),
num_matched answers None, vLLM's "ask me again next step", instead of holding
vLLM's scheduler; once the thread is free the same request gets its plan; past
lookup_timeout_s a request is computed without the pool (0). A request fetches
from a peer once. Prefill/decode: a handoff names the prefill server's pool and
its saved blocks before etcd does; a decode side saves nothing.
"""

from __future__ import annotations

import threading
import time

import pytest

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import Membership, MembershipConfig, NodeRecord
from prefixpool.meta.publisher import Publisher
from prefixpool.vllm_connector.config import POOL_KIND, ConnectorConfig
from prefixpool.vllm_connector.handoff import Handoff
from prefixpool.vllm_connector.scheduler import SchedulerSide
from prefixpool.vllm_connector.loop_thread import LoopThread
from prefixpool.store.keys import Namespace, chain

BLOCK = 32
NAMESPACE = Namespace(model="lookup-model", dtype="float32", block_size=BLOCK)
TOKENS = list(range(3 * BLOCK + 5))  # 3 full blocks, then a partial one


class PeerPool:
    """A pool's record and its blocks in etcd (a peer's, or node b's own), kept alive on a loop thread of its own."""

    def __init__(self, endpoint: str, ns: str, keys: list[bytes], node_id: str = "a.pool",
                 tiers: tuple[str, ...] = ("device",)) -> None:  # fmt: skip
        self.loop = LoopThread("peer-pool")
        self.etcd = EtcdClient(endpoint)
        record = NodeRecord(node_id, "", "tcp://127.0.0.1:9", BLOCK, 64, NAMESPACE.model, kind=POOL_KIND,
                            namespace=NAMESPACE.root().hex())
        self.membership = Membership(self.etcd, Layout(ns), record, MembershipConfig(ttl_s=10))
        placed = [(key, tiers[min(i, len(tiers) - 1)]) for i, key in enumerate(keys)]  # the last tier repeats
        self.publisher = Publisher(self.etcd, self.membership, lambda: placed)
        self.loop.run(self.publisher.start())
        self.loop.run(self.membership.start())

    def close(self) -> None:
        self.loop.run(self.publisher.stop())
        self.loop.run(self.membership.stop())
        self.loop.run(self.etcd.close())
        self.loop.close()


@pytest.fixture
def peer(etcd, ns):
    pool = PeerPool(etcd.endpoint, ns, chain(TOKENS[: 3 * BLOCK], NAMESPACE))
    yield pool
    pool.close()


def side_for(etcd, ns: str, lookup_timeout_s: float) -> SchedulerSide:
    config = ConnectorConfig(etcd_endpoints=etcd.endpoint, cluster=ns, node_id="b", lookup_timeout_s=lookup_timeout_s)
    return SchedulerSide(config, NAMESPACE)


def matched(side: SchedulerSide, request_id: str) -> int | None:
    return side.num_matched(request_id, TOKENS, None, None, 0)


def until_planned(side: SchedulerSide, request_id: str, timeout_s: float = 30.0) -> int:
    """Ask the way vLLM does, step after step, until the mirror has A's blocks."""
    deadline = time.monotonic() + timeout_s
    while not (num := matched(side, request_id)):
        assert time.monotonic() < deadline, "the mirror never showed A's blocks"
        time.sleep(0.05)
    return num


def answer(side: SchedulerSide, request_id: str, timeout_s: float = 30.0) -> int:
    """Ask step after step until the lookup answers (a loaded machine may take over LOOKUP_WAIT_S)."""
    deadline = time.monotonic() + timeout_s
    while (num := matched(side, request_id)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.05)
    return num


def hold_thread(side: SchedulerSide) -> threading.Event:
    """Fault: a task that keeps the mirror's thread busy until the event is set."""
    free = threading.Event()

    async def busy() -> None:
        free.wait()

    side._loop.submit(busy())
    return free


def test_a_busy_mirror_thread_makes_vllm_ask_again_and_the_answer_comes_once_it_is_free(etcd, ns, peer):
    side = side_for(etcd, ns, lookup_timeout_s=60.0)
    try:
        assert until_planned(side, "r1") == 3 * BLOCK
        assert side.loads_in_background("r1")  # from a peer: vLLM parks the request while it loads
        free = hold_thread(side)
        try:
            assert matched(side, "r2") is None
            assert matched(side, "r2") is None  # asked again next step: still running, still not blocking
        finally:
            free.set()
        assert until_planned(side, "r2") == 3 * BLOCK
        side.allocated("r2", 3 * BLOCK)  # vLLM took the load: r2 has had its one fetch from a peer
        assert answer(side, "r2") == 0  # asked again (its load failed): its own pool has nothing
    finally:
        side.close()


def test_a_lookup_past_its_timeout_computes_the_request_without_the_pool(etcd, ns, peer):
    side = side_for(etcd, ns, lookup_timeout_s=0.0)
    try:
        assert until_planned(side, "r1") == 3 * BLOCK
        free = hold_thread(side)
        try:
            assert matched(side, "r2") == 0  # no None: past the timeout at once, the request goes on
        finally:
            free.set()
    finally:
        side.close()


@pytest.mark.parametrize("tiers, background", [(("device",), False), (("device", "disk"), True)])
def test_a_load_from_the_own_pool_waits_in_the_background_only_when_blocks_are_on_its_ssd(etcd, ns, tiers,
                                                                                         background):  # fmt: skip
    own = PeerPool(etcd.endpoint, ns, chain(TOKENS[: 3 * BLOCK], NAMESPACE), node_id="b.pool", tiers=tiers)
    side = side_for(etcd, ns, lookup_timeout_s=60.0)
    try:
        assert until_planned(side, "r1") == 3 * BLOCK
        # in the host arena: copied layer by layer under the forward pass; on the SSD: read while vLLM runs others
        assert side.loads_in_background("r1") is background
    finally:
        side.close()
        own.close()


def test_a_handoff_plans_the_prefill_pools_blocks_before_etcd_names_them(etcd, ns):
    """Prefill/decode (handoff.py): the prefill server's pool saved 3 blocks that etcd does not show yet; the
    decode server's lookup, given the handoff, plans them from that pool at once, in the background."""
    prefill = PeerPool(etcd.endpoint, ns, [], node_id="p.pool")  # its record only: no block published
    side = side_for(etcd, ns, lookup_timeout_s=60.0)
    try:
        def ask(request_id: str, handoff: Handoff | None) -> int:
            deadline = time.monotonic() + 30.0
            while not (num := side.num_matched(request_id, TOKENS, None, None, 0, handoff)):
                assert time.monotonic() < deadline, "the handoff was never planned"
                time.sleep(0.05)
            return num

        assert ask("r1", Handoff("p.pool", 3)) == 3 * BLOCK
        assert side.loads_in_background("r1")
        assert ask("r2", Handoff("p.pool", 7)) == 3 * BLOCK  # never past the prompt's full blocks
        assert answer(side, "r3") == 0  # no handoff, nothing in etcd: computed
        assert side.num_matched("r4", TOKENS, None, None, 0, Handoff("gone.pool", 3)) in (0, None)  # unknown pool
        assert answer(side, "r4") == 0
        assert side.num_matched("r5", TOKENS, None, None, 3 * BLOCK, Handoff("p.pool", 3)) in (0, None)  # held
    finally:
        side.close()
        prefill.close()


def test_a_decode_side_saves_nothing_and_a_prefill_side_hands_off_what_it_saved(etcd, ns):
    class Request:
        num_computed_tokens = 0
        all_token_ids = TOKENS

    config = ConnectorConfig(etcd_endpoints=etcd.endpoint, cluster=ns, node_id="b")
    decode, prefill = SchedulerSide(config, NAMESPACE, saves=False), SchedulerSide(config, NAMESPACE)
    try:
        for side in (decode, prefill):
            answer(side, "r")
            loads, saves = side.step({"r": len(TOKENS)}, {"r": Request()}, lambda rid: list(range(10, 14)))
            assert loads == []
            assert [len(op.keys) for op in saves] == ([] if side is decode else [3])
        assert decode.handoff("r") is None
        assert prefill.handoff("r") == Handoff("b.pool", 3)
        assert prefill.handoff("never-seen") is None
    finally:
        decode.close()
        prefill.close()
