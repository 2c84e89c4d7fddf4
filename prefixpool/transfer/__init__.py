"""Moving KV blocks between nodes: one framed protocol over TCP and UCX.

    server = await serve(blocks, arena, "tcp://127.0.0.1:0", token)   # holder
    result = await fetch(server.url, keys, blocks, arena, deadline_s=2.0, token=token)

Imports only `store`.
"""

from prefixpool.transfer.errors import (
    BadPeerUrl,
    PeerUnreachable,
    ProtocolError,
    TransferError,
    TransferTimeout,
    Unauthorized,
)
from prefixpool.transfer.fetcher import Fetcher, fetch
from prefixpool.transfer.server import serve
from prefixpool.transfer.sink import FetchResult

__all__ = [
    "BadPeerUrl",
    "FetchResult",
    "Fetcher",
    "PeerUnreachable",
    "ProtocolError",
    "TransferError",
    "TransferTimeout",
    "Unauthorized",
    "fetch",
    "serve",
]
