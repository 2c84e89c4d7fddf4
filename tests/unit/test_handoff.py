"""The decode node's handoff loop on a real NodeBlocks, against a hand-written prefill node that commits
its blocks a few per round, stops, or dies."""

import asyncio

from prefixpool.node.exchange import Fetched
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.worker.handoff import HandoffStats, receive

KEYS = chain(list(range(160)), Namespace(model="tiny", dtype="float32", block_size=16))  # 10 blocks


class PrefillNode:
    """The exchange a decode node fetches through: each round, `per_round` more blocks are committed on the
    (imagined) prefill node; it serves what it has from the first key asked; past `stop_after` nothing more
    appears; from round `die_at` on every fetch fails."""

    def __init__(self, per_round: int, stop_after: int = 10, die_at: int | None = None) -> None:
        self.blocks = NodeBlocks(BlockPool(32))
        self.per_round, self.stop_after, self.die_at = per_round, stop_after, die_at
        self.rounds = 0
        self.asked: list[int] = []  # the first block index each round asked for

    async def fetch(self, peer_url, keys, deadline_s, partial_ok=False) -> Fetched:
        self.rounds += 1
        first = KEYS.index(keys[0])
        self.asked.append(first)
        if self.die_at is not None and self.rounds >= self.die_at:
            return Fetched(None, 0, 0)
        committed = min(self.rounds * self.per_round, self.stop_after)
        n = max(0, min(len(keys), committed - first, self.blocks.num_free))  # as the Fetcher: only into free blocks
        hold = self.blocks.acquire(())
        self.blocks.allocate(hold, n)
        for i in range(n):
            self.blocks.commit(hold, i, [keys[i]])
        return Fetched(hold, n, n * 100)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.01  # every look at the clock is 10 ms later
        return self.now


def run(node: PrefillNode, end: int = 10, wait_s: float = 0.05):
    return asyncio.run(receive(node, KEYS, "tcp://prefill:1", end, wait_s=wait_s, fetch_timeout_s=1.0, poll_s=0,
                               clock=Clock()))


def release(node: PrefillNode, received) -> None:
    for hold in received.holds:
        node.blocks.release(hold)
    node.blocks.check_integrity()
    assert node.blocks.pool.ref_count == [0] * 32


def test_blocks_are_fetched_round_by_round_as_the_prefill_node_commits_them():
    node = PrefillNode(per_round=3)
    received = run(node)
    assert received.complete and received.num_blocks == 10 and received.num_bytes == 1000
    assert node.asked == [0, 3, 6, 9]  # each round starts at the first block not yet here
    assert len(node.blocks.match(KEYS)) == 10
    release(node, received)


def test_a_prefill_node_that_stops_committing_is_given_up_after_wait_s():
    node = PrefillNode(per_round=2, stop_after=4)
    received = run(node, wait_s=0.05)
    assert not received.complete and received.num_blocks == 4
    assert 2 < node.rounds < 20 and set(node.asked[2:]) == {4}
    release(node, received)


def test_a_failed_round_ends_the_handoff_at_once_with_what_arrived():
    node = PrefillNode(per_round=3, die_at=3)
    received = run(node)
    assert not received.complete and received.num_blocks == 6 and node.rounds == 3
    stats = HandoffStats()
    stats.observe(received, 0.5)
    assert stats.report() == {"num_handoffs": 1, "num_rounds": 3, "num_incomplete": 1, "num_blocks": 6,
                              "num_bytes": 600, "seconds": 0.5}
    release(node, received)


def test_blocks_already_held_are_not_asked_for():
    node = PrefillNode(per_round=10)
    hold = node.blocks.acquire(())
    node.blocks.allocate(hold, 5)
    node.blocks.commit(hold, 0, KEYS[:5])
    node.blocks.release(hold)
    received = run(node)
    assert received.complete and node.asked == [5] and received.num_blocks == 5
    release(node, received)


def test_a_decode_node_without_a_free_block_stops_asking():
    node = PrefillNode(per_round=3)
    hold = node.blocks.acquire(())
    node.blocks.allocate(hold, 32)  # held by running requests: the pool has no room
    received = run(node, wait_s=100.0)
    assert not received.complete and received.num_blocks == 0 and node.rounds == 1
    node.blocks.release(hold)
    release(node, received)
