"""The one fault injector (prefixpool/node/faults.py), over a real TCP server and a real fetch on 127.0.0.1.

Faults count per fetch: "corrupt N" damages blocks N, 2N, ... of every fetch served, whether it
is fixed for the node's life (the worker's --corrupt-transfer-every) or read from a fault file
(the vLLM pool's fault_file, rewritten by a test between fetches). The receiver's checksum must
reject the damaged block and everything after it; the holder's own blocks are never touched.
"""

import asyncio
import contextlib
from dataclasses import dataclass

import pytest
import torch

from prefixpool.node.faults import Fault, Faults, FaultySource, num_corrupted, read_fault
from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.transfer import Fetcher, TransferTimeout, serve
from prefixpool.transfer.source import BlockSource
from tests.support.blocks import commit_random

KEYS = chain_ids(range(6), Namespace("faults"))
HANG_GUARD_S = 60  # a hang fails the test; every fetch here takes milliseconds


def node(num_blocks: int = 8) -> tuple[NodeBlocks, KVArena]:
    return NodeBlocks(BlockPool(num_blocks)), KVArena(ArenaShape(num_blocks, 2, 4, 2, 8))


@dataclass
class Holder:
    url: str
    source: BlockSource
    fetcher: Fetcher

    async def fetch(self, num_keys: int, deadline_s: float = HANG_GUARD_S) -> int:
        """Fetch KEYS[:num_keys] into a fresh receiver; how many arrived intact (released and checked)."""
        receiver, arena = node()
        result = await self.fetcher.fetch(self.url, KEYS[:num_keys], receiver, arena, deadline_s=deadline_s)
        assert result.keys == KEYS[:result.num_blocks]
        receiver.release(result.hold)
        receiver.check_integrity()
        return len(result.keys)


@contextlib.asynccontextmanager
async def holding(faults: Faults):
    """A node holding KEYS, serving through the source `faults` gives; its own bytes are checked after."""
    blocks, arena = node()
    commit_random(blocks, arena, KEYS)
    before = arena.tensor.view(torch.uint8).clone()  # bytes: random bytes make NaNs, and NaN != NaN
    source = faults.source(blocks, arena)
    server = await serve(blocks, arena, "tcp://127.0.0.1:0", source=source)
    fetcher = Fetcher()
    try:
        yield Holder(server.url, source, fetcher)
    finally:
        await fetcher.close()
        await server.close()  # cancels a stalled send: the holder's pins go
    assert arena.tensor.view(torch.uint8).equal(before)  # only the wire was damaged
    blocks.check_integrity()
    assert sum(blocks.pool.ref_count) == 0


def fetched_counts(faults: Faults, fetches: list[int], between=lambda index: None) -> tuple[list[int], BlockSource]:
    """How many blocks each fetch (of the first n KEYS) got intact; `between(i)` runs before fetch i."""
    async def scenario():
        counts = []
        async with holding(faults) as holder:
            for index, num_keys in enumerate(fetches):
                between(index)
                counts.append(await holder.fetch(num_keys))
        return counts, holder.source

    return asyncio.run(scenario())


def test_no_fault_is_the_plain_source_and_serves_everything():
    counts, source = fetched_counts(Faults(), [6, 6])
    assert type(source) is BlockSource and counts == [6, 6] and num_corrupted(source) == 0


def test_a_fixed_corruption_counts_blocks_per_fetch_not_per_life():
    """Block 3 of each fetch: a 2-block fetch leaves whole, and the next fetch still keeps 2 blocks."""
    counts, source = fetched_counts(Faults(corrupt_every=3), [2, 6, 6])
    assert counts == [2, 2, 2]
    assert num_corrupted(source) >= 2


def test_every_block_corrupted_gives_nothing():
    counts, source = fetched_counts(Faults(corrupt_every=1), [6, 6])
    assert counts == [0, 0] and num_corrupted(source) >= 2


def test_a_fault_file_picks_each_fetch_s_fault(tmp_path):
    path = tmp_path / "fault"
    script = ["corrupt 2", "", "corrupt 5", "nonsense here"]
    counts, _ = fetched_counts(Faults(fault_file=str(path)), [6, 6, 6, 6], lambda i: path.write_text(script[i]))
    assert counts == [1, 6, 4, 6]


def test_pause_holds_a_fetch_until_the_file_lets_go(tmp_path, caplog):
    path = tmp_path / "fault"
    path.write_text("pause 2")

    async def scenario():
        async with holding(Faults(fault_file=str(path))) as holder:
            fetching = asyncio.ensure_future(holder.fetch(6))
            async with asyncio.timeout(HANG_GUARD_S):
                while "prefixpool fault: pausing after 2 blocks" not in caplog.text:
                    await asyncio.sleep(0.01)
            assert not fetching.done() and holder.source.num_sending == 1
            path.write_text("")
            assert await fetching == 6

    asyncio.run(scenario())


def test_stall_sends_n_blocks_then_nothing_and_the_fetch_keeps_them(tmp_path, caplog):
    path = tmp_path / "fault"
    path.write_text("stall 4")

    async def scenario():
        async with holding(Faults(fault_file=str(path))) as holder:
            with pytest.raises(TransferTimeout) as caught:
                await holder.fetch(6, deadline_s=1.0)
        assert caught.value.stored == KEYS[:4]
        assert "prefixpool fault: stalling after 4 blocks" in caplog.text

    asyncio.run(scenario())


def test_reading_a_fault_file(tmp_path):
    path = tmp_path / "fault"
    assert read_fault(path) == Fault()  # absent
    for text, fault in [("", Fault()), ("corrupt 3", Fault("corrupt", 3)), ("pause 1\n", Fault("pause", 1)),
                        ("stall 0", Fault()), ("corrupt x", Fault()), ("melt 2", Fault()), ("stall 2 3", Fault())]:
        path.write_text(text)
        assert read_fault(path) == fault, text


def test_a_negative_fixed_corruption_is_refused():
    blocks, arena = node()
    with pytest.raises(ValueError, match="N >= 1"):
        Faults(corrupt_every=-1).source(blocks, arena)
    assert isinstance(Faults(fault_file="/nonexistent/fault").source(blocks, arena), FaultySource)
