"""Peer addresses: `tcp://host:port` and `ucx://host:port`, parsed once.

Knows nothing of sockets or pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from prefixpool.transfer.errors import BadPeerUrl

SCHEMES = ("tcp", "ucx")


@dataclass(frozen=True, slots=True)
class PeerAddress:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def parse_url(url: str) -> PeerAddress:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise BadPeerUrl(f"cannot parse peer url {url!r}: {err}") from err
    if parts.scheme not in SCHEMES:
        raise BadPeerUrl(f"peer url {url!r}: scheme must be one of {SCHEMES}")
    if not parts.hostname or port is None:
        raise BadPeerUrl(f"peer url {url!r} needs a host and a port")
    return PeerAddress(parts.scheme, parts.hostname, port)
