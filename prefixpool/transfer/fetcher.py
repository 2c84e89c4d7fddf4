"""fetch(): move the longest prefix a peer still holds into this node's pool, under a deadline.

    result = await fetcher.fetch("tcp://10.0.0.2:7001", keys, blocks, arena, deadline_s=2.0)
    ... use result.block_ids (committed, held by result.hold) ...
    blocks.release(result.hold)

What a caller can rely on:
  - the answer is a prefix of `keys`, possibly empty: a holder that evicted
    blocks, a receiver pool that filled up, a checksum mismatch or a holder
    that died mid-stream all give a shorter answer, never an error;
  - unknown peer, refused connection, deadline, wrong token, protocol
    mismatch raise a TransferError subclass; the node then holds nothing
    from this fetch, and the error lists what was stored and evicted;
  - every block operation runs on the calling event loop's thread.
Knows nothing of etcd or the router.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, Sequence

from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.transfer.address import PeerAddress, parse_url
from prefixpool.transfer.errors import TransferError, TransferTimeout
from prefixpool.transfer.protocol import MAX_KEYS, FetchRequest
from prefixpool.transfer.sink import BlockSink, FetchResult
from prefixpool.transfer.tcp import TcpClient


class TransportClient(Protocol):
    async def fetch(self, address: PeerAddress, request: FetchRequest, sink: BlockSink) -> None: ...

    def num_idle(self, address: PeerAddress) -> int: ...

    async def close(self) -> None: ...


def _ucx_client() -> TransportClient:
    from prefixpool.transfer.ucx import UcxClient  # imported on first use: ucxx is optional and slow to load

    return UcxClient()


CLIENTS = {"tcp": TcpClient, "ucx": _ucx_client}


class Fetcher:
    """Fetches from many peers, reusing connections per peer; one per process or test."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self._clients: dict[str, TransportClient] = {}

    def _client(self, scheme: str) -> TransportClient:
        if scheme not in self._clients:
            self._clients[scheme] = CLIENTS[scheme]()
        return self._clients[scheme]

    async def fetch(
        self, peer_url: str, keys: Sequence[BlockKey], blocks: NodeBlocks, arena: KVArena, *, deadline_s: float
    ) -> FetchResult:
        address = parse_url(peer_url)
        wanted = list(keys[: min(MAX_KEYS, blocks.num_free)])
        sink = BlockSink(blocks, arena, wanted)
        if not wanted:
            return sink.finish()
        try:
            async with asyncio.timeout(deadline_s):
                await self._client(address.scheme).fetch(address, FetchRequest(wanted, self.token), sink)
        except TimeoutError as err:
            stored, evicted = sink.abort()
            raise TransferTimeout(f"fetch from {peer_url} passed its {deadline_s}s deadline",
                                  stored=stored, evicted=evicted) from err
        except TransferError as err:
            err.stored, err.evicted = sink.abort()
            raise
        except BaseException:
            sink.abort()
            raise
        return sink.finish()

    def num_idle(self, peer_url: str) -> int:
        """Idle connections kept for `peer_url` (reused by the next fetch)."""
        address = parse_url(peer_url)
        client = self._clients.get(address.scheme)
        return 0 if client is None else client.num_idle(address)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


async def fetch(
    peer_url: str, keys: Sequence[BlockKey], blocks: NodeBlocks, arena: KVArena, *, deadline_s: float, token: str = ""
) -> FetchResult:
    """One fetch on a fresh connection; long-lived callers keep a Fetcher instead."""
    fetcher = Fetcher(token)
    try:
        return await fetcher.fetch(peer_url, keys, blocks, arena, deadline_s=deadline_s)
    finally:
        await fetcher.close()
