"""serve(): expose one node's blocks to peers over TCP or UCX.

    server = await serve(blocks, arena, "tcp://127.0.0.1:0", token="s3cret")
    server.url          # the bound address, real port filled in
    await server.close()

The server holds blocks while it sends them and releases them afterwards, all
on the event loop thread it was started on. `source` is the seam for a
different holder behaviour (tests inject faults there). Knows nothing of
fetching, etcd or the router.
"""

from __future__ import annotations

from typing import Protocol

from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.transfer.address import parse_url
from prefixpool.transfer.source import BlockSource
from prefixpool.transfer.tcp import TcpServer


class Server(Protocol):
    @property
    def url(self) -> str: ...

    async def start(self, host: str, port: int) -> None: ...

    async def close(self) -> None: ...


def _ucx_server(source: BlockSource, token: str) -> Server:
    from prefixpool.transfer.ucx import UcxServer  # imported on first use: ucxx is optional and slow to load

    return UcxServer(source, token)


SERVERS = {"tcp": TcpServer, "ucx": _ucx_server}


async def serve(
    blocks: NodeBlocks, arena: KVArena, url: str = "tcp://127.0.0.1:0", token: str = "", *,
    source: BlockSource | None = None
) -> Server:
    address = parse_url(url)
    server = SERVERS[address.scheme](source or BlockSource(blocks, arena), token)
    await server.start(address.host, address.port)
    return server
