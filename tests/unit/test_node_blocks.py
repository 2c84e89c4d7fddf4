"""The one owner of a node's blocks: requests, transfer source and sink holds, TTL pins and
promotion from a host tier, all driven at random against a brute-force model, with
check_integrity after every step.

The model keeps its own copy of every block id each open hold was handed, of every named pin's
keys and deadline, and of every key it saw cached while pinned; from those it recomputes each
block's ref count and which keys the pool must pin, and checks the pool against them.
"""

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.host_tier import HostTier
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pins import PrefixPins
from prefixpool.store.pool import BlockPool, PoolExhausted
from prefixpool.store.record import header_for
from prefixpool.store.tiers import TierChain
from prefixpool.transfer.sink import BlockSink
from prefixpool.transfer.source import BlockSource

NS = Namespace("node-blocks", block_size=1)
NUM_BLOCKS = 6
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NodeBlocksMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.arena = KVArena(ArenaShape(NUM_BLOCKS, num_layers=1, block_size=1, num_kv_heads=1, head_dim=2))
        host = HostTier(3, self.arena.block_bytes, pin_memory=False)
        self.blocks = NodeBlocks(BlockPool(NUM_BLOCKS, clock=self.clock), TierChain(self.arena, host),
                                 PrefixPins(soft_budget_blocks=2))
        self.source = BlockSource(self.blocks, self.arena)
        self.loop = asyncio.new_event_loop()
        self.requests = []        # [hold, keys, model block ids, next index to commit, indices committed]
        self.held = []            # (hold, model block ids): transfer source holds and fetch results
        self.named = {}           # name -> (keys, expires_at)
        self.pinned_cached = {}   # key -> block: cached while pinned, so it must stay

    def teardown(self):
        self.loop.close()

    # -- oracle ----------------------------------------------------------------------------
    def index(self):
        return dict(self.blocks.pool.index)

    def deadline(self, key):
        times = [exp for keys, exp in self.named.values() if key in keys and exp > self.clock.now]
        return max(times, default=None)

    def model_holds(self):
        return [r[2] for r in self.requests] + [ids for _, ids in self.held]

    def free_for_allocation(self):
        """Blocks no hold and no pin keeps: what an allocation may take."""
        taken = {b for ids in self.model_holds() for b in ids} | set(self.pinned_cached.values())
        return NUM_BLOCKS - len(taken)

    # -- rules ------------------------------------------------------------------------------
    @rule(tokens=TOKENS)
    def request(self, tokens):
        keys = chain(tokens, NS)
        before = self.index()
        hold = self.blocks.acquire(keys)
        num_hit = 0
        while num_hit < len(keys) and keys[num_hit] in before:
            num_hit += 1
        assert hold.block_ids == [before[k] for k in keys[:num_hit]], "acquire is not the longest cached prefix"
        busy = {b for ids in self.model_holds() for b in ids} | set(self.pinned_cached.values())
        room = self.free_for_allocation() - sum(1 for b in hold.block_ids if b not in busy)
        try:
            self.blocks.allocate(hold, len(keys) - num_hit)
        except PoolExhausted:
            assert len(keys) - num_hit > room, "refused although the model has room"
            self.blocks.release(hold)
            assert hold.block_ids == []
            return
        new = hold.block_ids[num_hit:]
        assert not set(new) & busy and not set(new) & set(hold.block_ids[:num_hit]), "a held block was reallocated"
        self.requests.append([hold, keys, list(hold.block_ids), num_hit, list(range(num_hit))])

    @precondition(lambda self: any(r[3] < len(r[1]) for r in self.requests))
    @rule(i=st.integers(0, 10))
    def commit(self, i):
        open_requests = [r for r in self.requests if r[3] < len(r[1])]
        request = open_requests[i % len(open_requests)]
        hold, keys, _, index, committed = request
        cached = keys[index] in self.blocks.pool.index
        assert self.blocks.commit(hold, index, [keys[index]]) == ([] if cached else [keys[index]])
        if not cached:
            committed.append(index)
        request[3] += 1

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        hold, *_ = self.requests.pop(i % len(self.requests))
        self.blocks.release(hold)

    @rule(tokens=TOKENS)
    def serve(self, tokens):
        """The transfer source holds the prefix it serves (a real BlockSource)."""
        keys = chain(tokens, NS)
        num_device = len(self.blocks.match(keys))
        outgoing = self.loop.run_until_complete(self.source.pin(keys))  # promotes the host run first
        assert len(outgoing.keys) >= num_device and outgoing.keys == keys[: len(outgoing.keys)]
        assert outgoing.block_ids == [self.blocks.lookup(k) for k in outgoing.keys]
        assert self.blocks.match(keys) == outgoing.block_ids, "served less than the node holds on the device"
        self.held.append((outgoing.hold, list(outgoing.block_ids)))

    @rule(tokens=TOKENS, num_intact=st.integers(0, 4))
    def receive(self, tokens, num_intact):
        """The transfer sink receives `num_intact` good blocks of a fetch, then a bad one."""
        keys = chain(tokens, NS)
        sink = BlockSink(self.blocks, self.arena, keys)
        room = self.free_for_allocation()
        num = sink.expect(len(keys), self.arena.block_bytes)
        assert num == min(len(keys), room), "the sink asked for what the pool cannot give"
        for index in range(num):
            payload = bytes([index + 1]) * self.arena.block_bytes
            sink.destination(index)[:] = payload
            header = header_for(keys[index], payload if index < num_intact else b"\0" * len(payload))
            if not sink.accept(index, header):
                break
        result = sink.finish()
        assert result.keys == keys[: min(num, num_intact)]
        assert [self.blocks.lookup(k) for k in result.keys] == result.block_ids
        self.held.append((result.hold, list(result.block_ids)))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def release_transfer(self, i):
        hold, _ = self.held.pop(i % len(self.held))
        self.blocks.release(hold)

    @rule(tokens=TOKENS)
    def promote(self, tokens):
        """Lift the host run after the device prefix: unheld, committed, gone from host."""
        keys = chain(tokens, NS)
        device = self.blocks.match(keys)
        num_device = len(device)
        busy = {b for ids in self.model_holds() for b in ids} | set(self.pinned_cached.values())
        room = self.free_for_allocation() - sum(1 for b in device if b not in busy)  # the prefix is kept
        in_host = set(self.blocks.tiers.host.index)
        run = 0
        while num_device + run < len(keys) and keys[num_device + run] in in_host:
            run += 1
        lifted = self.blocks.promote(keys).stored.get("device", [])
        assert lifted == keys[num_device: num_device + len(lifted)] and len(lifted) <= run
        assert len(lifted) == min(run, room), "promoted less than the pool could hold"
        assert all(k in self.blocks.pool.index and k not in self.blocks.tiers.host for k in lifted)

    @rule(name=st.sampled_from(["a", "b"]), tokens=TOKENS, ttl_s=st.floats(1.0, 20.0))
    def pin(self, name, tokens, ttl_s):
        keys = chain(tokens, NS)
        held = self.blocks.pin(name, keys, ttl_s)
        self.named[name] = (tuple(keys), self.clock.now + ttl_s)
        assert held == [k for k in keys if k in self.blocks.pool.index]

    @rule(name=st.sampled_from(["a", "b"]))
    def unpin(self, name):
        assert self.blocks.unpin(name) is (name in self.named)
        self.named.pop(name, None)

    @rule(dt=st.floats(0.0, 8.0))
    def tick(self, dt):
        self.clock.now += dt
        self.blocks.expire_pins()
        self.blocks.live_names()
        self.named = {n: (keys, exp) for n, (keys, exp) in self.named.items() if exp > self.clock.now}

    # -- after every step -------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self):
        self.blocks.check_integrity()
        pool = self.blocks.pool
        pinned = {k: d for k in pool.pins if (d := self.deadline(k)) is not None}
        wanted = {k: d for keys, _ in self.named.values() for k in keys if (d := self.deadline(k)) is not None}
        assert pinned == wanted and set(pool.pins) == set(wanted), "pool pins differ from the named pins"
        assert all(pool.pins[k].expires_at == d for k, d in wanted.items())
        for key, block_id in list(self.pinned_cached.items()):
            if key in wanted:
                assert pool.index.get(key) == block_id, "a pinned block was evicted"
            else:
                del self.pinned_cached[key]
        self.pinned_cached.update((k, pool.index[k]) for k in wanted if k in pool.index)
        expected = [0] * NUM_BLOCKS
        for ids in self.model_holds():
            for block_id in ids:
                expected[block_id] += 1
        for block_id in self.pinned_cached.values():
            expected[block_id] += 1
        assert pool.ref_count == expected, "ref counts differ from the model's holds and pins"
        for hold, keys, ids, _, committed in self.requests:
            assert hold.block_ids == ids
            for index in committed:
                assert pool.index.get(keys[index]) == ids[index], "a held request's block lost its key"


NodeBlocksMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestNodeBlocksMachine = NodeBlocksMachine.TestCase


def test_check_integrity_catches_a_ref_taken_behind_the_owners_back():
    blocks = NodeBlocks(BlockPool(4))
    hold = blocks.acquire(())
    blocks.allocate(hold, 2)
    blocks.check_integrity()
    blocks.pool.touch([hold.block_ids[0]])  # a ref no hold or pin accounts for
    with pytest.raises(AssertionError, match="holds and pins account for"):
        blocks.check_integrity()


def test_check_integrity_catches_a_pool_pin_no_named_pin_wants():
    blocks = NodeBlocks(BlockPool(4))
    blocks.pool.pin(chain([1], NS), ttl_s=5.0)
    with pytest.raises(AssertionError, match="nobody wants"):
        blocks.check_integrity()


def test_a_released_hold_cannot_allocate():
    blocks = NodeBlocks(BlockPool(4))
    hold = blocks.acquire(())
    blocks.release(hold)
    with pytest.raises(AssertionError, match="released hold"):
        blocks.allocate(hold, 1)
