"""The transfer layer end to end over real sockets on 127.0.0.1, once per transport.

Every test drives a real server and a real fetch; faults are injected by
hand-written BlockSource subclasses on the holder. After every fetch the
receiver's pool passes check_integrity and holds no pins but the returned ones.
"""

import asyncio
import os
import signal

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from prefixpool.store.arena import ArenaShape, KVArena  # noqa: E402
from prefixpool.store.keys import Namespace, chain_ids  # noqa: E402
from prefixpool.store.node_blocks import NodeBlocks  # noqa: E402
from prefixpool.store.pool import BlockPool  # noqa: E402
from prefixpool.transfer import (  # noqa: E402
    BadPeerUrl,
    Fetcher,
    PeerUnreachable,
    TransferTimeout,
    Unauthorized,
    fetch,
    serve,
)
from prefixpool.transfer.source import BlockSource  # noqa: E402

TRANSPORTS = ["tcp", "ucx"]
SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)  # 1 KiB blocks


def keys_for(count, start=0, model="m"):
    return chain_ids(range(start, start + count), Namespace(model))


def node(num_blocks, **shape):
    dims = {**SHAPE, **shape}
    return NodeBlocks(BlockPool(num_blocks)), KVArena(ArenaShape(num_blocks, **dims))


def hold(pool, arena, keys, seed=0):
    """Commit random bytes under `keys` in the holder's blocks (`pool`: a NodeBlocks; cached, unheld); returns them."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    held = pool.acquire(())
    pool.allocate(held, len(keys))
    for index, (key, block_id) in enumerate(zip(keys, held.block_ids)):
        data = torch.randint(0, 256, (arena.block_bytes,), dtype=torch.uint8, generator=generator)
        arena.write_bytes(block_id, data.numpy().tobytes())
        assert pool.commit(held, index, [key]) == [key]
        blocks.append(data.numpy().tobytes())
    pool.release(held)
    return blocks


def assert_received(result, pool, arena, keys, blocks):
    assert result.keys == keys[: len(result.keys)]
    assert len(result.block_ids) == len(result.keys)
    for key, block_id, data in zip(result.keys, result.block_ids, blocks):
        assert bytes(arena.read_bytes(block_id)) == data
        assert pool.lookup(key) == block_id
        assert pool.pool.ref_count[block_id] == 1
    pool.check_integrity()


def release(result, pool):
    pool.release(result.hold)
    pool.check_integrity()
    assert sum(pool.pool.ref_count) == 0


def url(transport):
    return f"{transport}://127.0.0.1:0"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("count,shape",
                         [(1, {}), (7, {"head_dim": 1}), (33, {"num_layers": 3}), (5, {"block_size": 64})])
def test_bytes_received_equal_bytes_sent(transport, count, shape):
    async def run():
        holder_pool, holder_arena = node(count + 3, **shape)
        keys = keys_for(count)
        blocks = hold(holder_pool, holder_arena, keys, seed=count)
        server = await serve(holder_pool, holder_arena, url(transport))
        pool, arena = node(count + 5, **shape)
        try:
            result = await fetch(server.url, keys, pool, arena, deadline_s=10)
        finally:
            await server.close()
        assert result.num_blocks == count and result.num_bytes == count * arena.block_bytes
        assert_received(result, pool, arena, keys, blocks)
        release(result, pool)
        assert sum(holder_pool.pool.ref_count) == 0
        holder_pool.check_integrity()

    asyncio.run(run())


def assert_clean(pool, pinned=0):
    pool.check_integrity()
    assert sum(pool.pool.ref_count) == pinned


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_fetches_from_several_peers_reuse_connections(transport):
    async def run():
        holders, servers, expected = [], [], []
        for peer in range(3):
            pool, arena = node(16)
            keys = keys_for(10, start=100 * peer)
            expected.append((keys, hold(pool, arena, keys, seed=peer)))
            holders.append(pool)
            servers.append(await serve(pool, arena, url(transport)))
        shared = keys_for(4, start=999)  # two holders hold the same chain, with the same bytes
        for pool, server in zip(holders[:2], servers[:2]):
            hold(pool, server.source.arena, shared, seed=42)
        pool, arena = node(64)
        fetcher = Fetcher()
        try:
            for _ in range(2):
                fetches = [fetcher.fetch(s.url, keys, pool, arena, deadline_s=10)
                           for s, (keys, _) in zip(servers, expected)]
                fetches += [fetcher.fetch(s.url, shared, pool, arena, deadline_s=10) for s in servers[:2]]
                results = await asyncio.gather(*fetches)
                for result, (keys, blocks) in zip(results, expected):
                    assert result.num_blocks == 10
                    assert_received(result, pool, arena, keys, blocks)
                twins = results[3:]
                assert [r.keys for r in twins] == [shared, shared]
                assert twins[0].block_ids == twins[1].block_ids  # one key, one live block
                for result in results:
                    pool.release(result.hold)
                assert_clean(pool)
            assert all(fetcher.num_idle(s.url) >= 1 for s in servers)
        finally:
            await fetcher.close()
            for server in servers:
                await server.close()
        for holder in holders:
            assert_clean(holder)

    asyncio.run(run())


class EvictingSource(BlockSource):
    """Evicts keys[evict_at] just as the request arrives, before anything is pinned."""

    def __init__(self, pool, arena, evict_at):
        super().__init__(pool, arena)
        self.evict_at = evict_at

    async def pin(self, keys):
        assert self.blocks.pool.drop(keys[self.evict_at])
        return await super().pin(keys)


class CorruptingSource(BlockSource):
    """Flips one byte of block `corrupt_at` after its checksum was taken (damage in transit)."""

    def __init__(self, pool, arena, corrupt_at):
        super().__init__(pool, arena)
        self.corrupt_at = corrupt_at

    async def records(self, outgoing):
        index = 0
        async for header, payload in super().records(outgoing):
            if index == self.corrupt_at:
                damaged = bytearray(payload)
                damaged[len(damaged) // 2] ^= 0x40
                payload = memoryview(damaged)
            yield header, payload
            index += 1


class StallingSource(BlockSource):
    """Sends `stall_after` blocks, then stops talking (the connection stays open)."""

    def __init__(self, pool, arena, stall_after):
        super().__init__(pool, arena)
        self.stall_after = stall_after

    async def records(self, outgoing):
        index = 0
        async for record in super().records(outgoing):
            if index == self.stall_after:
                await asyncio.sleep(3600)
            yield record
            index += 1


async def fetch_from(transport, source_type, keys, receiver, *, deadline_s=10, **fault):
    holder_pool, holder_arena = node(len(keys) + 2)
    blocks = hold(holder_pool, holder_arena, keys, seed=3)
    source = source_type(holder_pool, holder_arena, **fault)
    server = await serve(holder_pool, holder_arena, url(transport), source=source)
    try:
        return await fetch(server.url, keys, *receiver, deadline_s=deadline_s), blocks
    finally:
        await server.close()
        assert_clean(holder_pool)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_holder_that_evicted_gives_a_shorter_answer(transport):
    keys = keys_for(9)
    pool, arena = receiver = node(16)
    result, blocks = asyncio.run(fetch_from(transport, EvictingSource, keys, receiver, evict_at=4))
    assert result.keys == keys[:4]
    assert_received(result, pool, arena, keys, blocks)
    assert_clean(pool, pinned=4)
    release(result, pool)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_block_and_the_rest_are_rejected(transport):
    keys = keys_for(9)
    pool, arena = receiver = node(16)
    result, blocks = asyncio.run(fetch_from(transport, CorruptingSource, keys, receiver, corrupt_at=3))
    assert result.keys == keys[:3]
    assert_received(result, pool, arena, keys, blocks)
    assert all(pool.lookup(key) is None for key in keys[3:])
    assert_clean(pool, pinned=3)
    release(result, pool)
    assert pool.pool.num_cached == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stall_after", [0, 3])
def test_stalled_holder_raises_timeout_and_leaves_no_pins(transport, stall_after):
    keys = keys_for(6)
    pool, _ = receiver = node(8)
    with pytest.raises(TransferTimeout) as caught:
        asyncio.run(fetch_from(transport, StallingSource, keys, receiver, deadline_s=0.5, stall_after=stall_after))
    assert caught.value.stored == keys[:stall_after]
    assert caught.value.evicted == []
    assert_clean(pool)
    assert pool.pool.num_cached == stall_after  # what arrived intact stays cached, unpinned


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_token_is_refused(transport):
    async def run():
        holder_pool, holder_arena = node(4)
        keys = keys_for(3)
        blocks = hold(holder_pool, holder_arena, keys)
        server = await serve(holder_pool, holder_arena, url(transport), token="s3cret")
        pool, arena = node(4)
        try:
            with pytest.raises(Unauthorized):
                await fetch(server.url, keys, pool, arena, deadline_s=10, token="guess")
            assert_clean(pool)
            result = await fetch(server.url, keys, pool, arena, deadline_s=10, token="s3cret")
        finally:
            await server.close()
        assert_received(result, pool, arena, keys, blocks)
        release(result, pool)
        assert_clean(holder_pool)

    asyncio.run(run())


def closed_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("peer", ["127.0.0.1:{port}", "no-such-host.invalid:{port}"])
def test_unreachable_peer_raises_fast(transport, peer):
    pool, arena = node(4)
    peer_url = f"{transport}://" + peer.format(port=closed_port())
    with pytest.raises(PeerUnreachable):
        asyncio.run(fetch(peer_url, keys_for(2), pool, arena, deadline_s=30))
    assert_clean(pool)


@pytest.mark.parametrize("peer_url", ["http://127.0.0.1:1", "tcp://127.0.0.1", "tcp://:80", "ucx://[::1:2"])
def test_bad_peer_url_is_refused(peer_url):
    pool, arena = node(4)
    with pytest.raises(BadPeerUrl):
        asyncio.run(fetch(peer_url, keys_for(2), pool, arena, deadline_s=1))


class DyingSource(BlockSource):
    """Sends `die_after` blocks, lets them drain, then the holder process is SIGKILLed."""

    def __init__(self, pool, arena, die_after):
        super().__init__(pool, arena)
        self.die_after = die_after

    async def records(self, outgoing):
        index = 0
        async for record in super().records(outgoing):
            if index == self.die_after:
                await asyncio.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            yield record
            index += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cuda_arenas_send_and_receive_through_host_staging(transport):
    async def run():
        keys = keys_for(6)
        holder_pool = NodeBlocks(BlockPool(8))
        holder_arena = KVArena(ArenaShape(8, **SHAPE), device="cuda")
        blocks = hold(holder_pool, holder_arena, keys, seed=11)
        server = await serve(holder_pool, holder_arena, url(transport))
        pool, arena = NodeBlocks(BlockPool(8)), KVArena(ArenaShape(8, **SHAPE), device="cuda")
        try:
            result = await fetch(server.url, keys, pool, arena, deadline_s=30)
        finally:
            await server.close()
        assert result.keys == keys
        assert_received(result, pool, arena, keys, blocks)
        release(result, pool)

    asyncio.run(run())
