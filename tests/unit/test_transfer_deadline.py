"""The transfer port drops peers that are idle, send half a request, or stop reading, past a deadline.

Real servers on 127.0.0.1 with short deadlines (0.3 s); the peers are raw sockets that misbehave
on purpose. Each test asserts that the server closed the connection (a read sees EOF within a
generous bound, not a timed speed), that the holder's pool passes check_integrity with no pin
left, and that a well-behaved fetch afterwards still gets every block.
"""

import asyncio
import os
import socket

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from prefixpool.store.arena import ArenaShape, KVArena  # noqa: E402
from prefixpool.store.keys import Namespace, chain_ids  # noqa: E402
from prefixpool.store.node_blocks import NodeBlocks  # noqa: E402
from prefixpool.store.pool import BlockPool  # noqa: E402
from prefixpool.transfer import fetch  # noqa: E402
from prefixpool.transfer.protocol import LENGTH_PREFIX, FetchRequest, ServerDeadlines, framed  # noqa: E402
from prefixpool.transfer.source import BlockSource  # noqa: E402
from prefixpool.transfer.tcp import TcpServer  # noqa: E402

SHORT = ServerDeadlines(request_s=0.3, idle_s=0.3, stall_s=0.3)
GENEROUS_S = 30.0  # a bound on a hang, not a speed: the server closes after ~0.3 s
SMALL = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)  # 1 KiB blocks
LARGE = dict(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128)  # 256 KiB blocks


def holder(num_blocks: int, shape: dict) -> tuple[NodeBlocks, KVArena, list]:
    """A node holding `num_blocks` committed blocks of random bytes (cached, unpinned), and their keys."""
    blocks, arena = NodeBlocks(BlockPool(num_blocks)), KVArena(ArenaShape(num_blocks, **shape))
    keys = chain_ids(range(num_blocks), Namespace("m"))
    hold = blocks.acquire(())
    blocks.allocate(hold, num_blocks)
    for index, (key, block_id) in enumerate(zip(keys, hold.block_ids)):
        generator = torch.Generator().manual_seed(index)
        data = torch.randint(0, 256, (arena.block_bytes,), dtype=torch.uint8, generator=generator)
        arena.write_bytes(block_id, data.numpy().tobytes())
        assert blocks.commit(hold, index, [key]) == [key]
    blocks.release(hold)
    return blocks, arena, keys


async def tcp_server(blocks: NodeBlocks, arena: KVArena, deadlines: ServerDeadlines = SHORT) -> TcpServer:
    server = TcpServer(BlockSource(blocks, arena), deadlines=deadlines)
    await server.start("127.0.0.1", 0)
    return server


def num_pinned(blocks: NodeBlocks) -> int:
    return sum(1 for count in blocks.pool.ref_count if count > 0)


async def read_until_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (a reset, when it closed on bytes it did not read,
    counts as closed); a hang fails after GENEROUS_S."""
    received = bytearray()
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), GENEROUS_S):
            received += chunk
    except ConnectionResetError:
        pass
    return bytes(received)


async def assert_a_good_fetch_still_works(server_url: str, blocks: NodeBlocks, keys: list, shape: dict) -> None:
    pool, arena = NodeBlocks(BlockPool(len(keys) + 2)), KVArena(ArenaShape(len(keys) + 2, **shape))
    result = await fetch(server_url, keys, pool, arena, deadline_s=GENEROUS_S)
    assert result.keys == keys
    pool.release(result.hold)
    pool.check_integrity()
    assert sum(pool.pool.ref_count) == 0
    await until(lambda: num_pinned(blocks) == 0, "the holder unpinned what it sent")  # after its last send returns
    blocks.check_integrity()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


PARTIAL_PEERS = {
    "three bytes": b"\x10\x00\x00",
    "nothing at all": b"",
    "a length prefix, then half the body": framed(FetchRequest(keys=[b"k" * 16] * 4))[:30],
}


@pytest.mark.parametrize("sent", PARTIAL_PEERS.values(), ids=PARTIAL_PEERS.keys())
def test_a_peer_that_stops_mid_request_is_closed(sent):
    async def run():
        blocks, arena, keys = holder(4, SMALL)
        server = await tcp_server(blocks, arena)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server.url))
            writer.write(sent)
            await writer.drain()
            assert await read_until_eof(reader) == b"", "closed without an answer"
            writer.close()
            await assert_a_good_fetch_still_works(server.url, blocks, keys, SMALL)
        finally:
            await server.close()

    asyncio.run(run())


def test_an_idle_kept_connection_is_closed_after_idle_s_and_the_client_reconnects():
    async def run():
        blocks, arena, keys = holder(4, SMALL)
        server = await tcp_server(blocks, arena)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server.url))
            writer.write(framed(FetchRequest(keys=[bytes(key) for key in keys[:2]])))  # a good request ...
            await writer.drain()
            answer = await read_until_eof(reader)  # ... answered, then the connection idles past idle_s
            assert len(answer) > 2 * arena.block_bytes
            writer.close()
            await assert_a_good_fetch_still_works(server.url, blocks, keys, SMALL)
        finally:
            await server.close()

    asyncio.run(run())


def test_garbage_and_oversized_frames_are_closed_at_once():
    async def run():
        blocks, arena, keys = holder(4, SMALL)
        server = await tcp_server(blocks, arena, ServerDeadlines(request_s=60, idle_s=60, stall_s=60))
        try:
            for garbage in (LENGTH_PREFIX.pack(2**31) + b"x", LENGTH_PREFIX.pack(5) + b"\xc1\xc1\xc1\xc1\xc1"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server.url))
                writer.write(garbage)
                await writer.drain()
                answer = await read_until_eof(reader)  # long before the 60 s deadlines: not a timeout
                assert answer == b"" or b"bad_request" in answer
                writer.close()
            await assert_a_good_fetch_still_works(server.url, blocks, keys, SMALL)
        finally:
            await server.close()

    asyncio.run(run())


def test_a_peer_that_stops_reading_its_answer_gives_its_pins_back():
    async def run():
        blocks, arena, keys = holder(64, LARGE)  # 16 MiB: more than both sockets' buffers hold
        server = await tcp_server(blocks, arena)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port_of(server.url)))
            await loop.sock_sendall(sock, framed(FetchRequest(keys=[bytes(key) for key in keys])))
            await until(lambda: num_pinned(blocks) == len(keys), "the holder pinned the answer")
            await until(lambda: num_pinned(blocks) == 0, "the stalled answer was cut and unpinned")
            blocks.check_integrity()
            await assert_a_good_fetch_still_works(server.url, blocks, keys, LARGE)
        finally:
            sock.close()
            await server.close()

    asyncio.run(run())


async def until(predicate, what: str) -> None:
    """Poll until `predicate` holds; fails after GENEROUS_S (a hang, not a slow answer)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), GENEROUS_S)
    except TimeoutError:
        pytest.fail(f"not within {GENEROUS_S}s: {what}")


def test_a_ucx_endpoint_that_never_asks_is_aborted():
    ucxx = pytest.importorskip("ucxx")
    from prefixpool.transfer.ucx import UcxServer

    async def run():
        blocks, arena, keys = holder(4, SMALL)
        server = UcxServer(BlockSource(blocks, arena), deadlines=SHORT)
        await server.start("127.0.0.1", 0)
        try:
            endpoint = await ucxx.create_endpoint("127.0.0.1", port_of(server.url))
            await until(lambda: len(server._handlers) == 1, "the server took the endpoint")
            await until(lambda: not server._handlers, "the silent endpoint was aborted")
            endpoint.abort()
            await assert_a_good_fetch_still_works(server.url, blocks, keys, SMALL)
        finally:
            await server.close()

    asyncio.run(run())
