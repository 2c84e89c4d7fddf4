"""A node hashes each committed block once: on its first send, or never when it arrived verified.

The cached checksum must go when the block is allocated to be written again, or
a peer would be sent new bytes under the old checksum and reject them.
"""

import asyncio

import pytest

from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.record import checksum
from tests.unit.test_transfer import TRANSPORTS, assert_received, hold, keys_for, node, release, url
from prefixpool.transfer import fetch, serve


def test_a_blocks_checksum_is_kept_while_committed_and_forgotten_when_it_is_allocated_again():
    blocks = NodeBlocks(BlockPool(1))
    first, second = b"a" * 64, b"b" * 64
    held = blocks.acquire(())
    blocks.allocate(held, 1)
    (block_id,) = held.block_ids
    blocks.commit(held, 0, keys_for(1))
    blocks.release(held)
    assert blocks.checksums.of(block_id, first) == checksum(first)
    assert blocks.checksums.of(block_id, second) == checksum(first)  # cached: the bytes are not read again
    blocks.check_integrity()
    again = blocks.acquire(())
    assert blocks.allocate(again, 1) == keys_for(1)  # the only block: its key is evicted, its bytes rewritten
    assert block_id not in blocks.checksums
    blocks.check_integrity()
    blocks.commit(again, 0, keys_for(1, start=7))
    assert blocks.checksums.of(block_id, second) == checksum(second)
    blocks.release(again)
    blocks.check_integrity()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_holders_reuse_checksums_and_a_rewritten_block_is_sent_with_its_new_one(transport):
    async def run():
        keys, later = keys_for(4), keys_for(4, start=100)
        holder, holder_arena = node(4)  # exactly 4 blocks: `later` overwrites every block of `keys`
        sent = hold(holder, holder_arena, keys, seed=1)
        first, first_arena = node(6)
        second, second_arena = node(6)
        third, third_arena = node(6)
        server = await serve(holder, holder_arena, url(transport))
        relay = await serve(first, first_arena, url(transport))
        try:
            got = await fetch(server.url, keys, first, first_arena, deadline_s=10)
            assert_received(got, first, first_arena, keys, sent)
            assert {b: first.checksums.of(b, b"") for b in got.block_ids} == \
                {b: checksum(first_arena.read_bytes(b)) for b in got.block_ids}  # remembered as verified
            assert len(holder.checksums) == 4
            for _ in range(1000):  # the holder unpins once its send is done, which may be after our receive
                if not any(holder.pool.ref_count):
                    break
                await asyncio.sleep(0.01)
            rewritten = hold(holder, holder_arena, later, seed=2)  # same blocks, other bytes
            assert len(holder.checksums) == 0
            new = await fetch(server.url, later, second, second_arena, deadline_s=10)
            assert_received(new, second, second_arena, later, rewritten)  # a stale checksum would reject them
            relayed = await fetch(relay.url, keys, third, third_arena, deadline_s=10)
            assert_received(relayed, third, third_arena, keys, sent)  # served from checksums it never computed
        finally:
            await server.close()
            await relay.close()
        for result, pool in ((got, first), (new, second), (relayed, third)):
            release(result, pool)  # after the servers closed: a UCX holder may unpin after we received
        holder.check_integrity()

    asyncio.run(run())
