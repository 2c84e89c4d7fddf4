"""Typed errors of the transfer layer: what a fetch tells its caller went wrong.

Every failure a caller can act on has its own type, all under TransferError,
so a worker can `except TransferError` and recompute. Errors raised after the
receiver's pool changed carry what changed (`stored`, `evicted`) so the caller
can still publish it. Knows nothing of sockets or UCX: transports translate
their own exceptions into these once, at their boundary.
"""

from __future__ import annotations

from prefixpool.store.keys import BlockKey


class TransferError(Exception):
    """A fetch that failed; the caller recomputes what it did not get."""

    def __init__(self, message: str, *, stored: list[BlockKey] | None = None,
                 evicted: list[BlockKey] | None = None) -> None:
        super().__init__(message)
        self.stored: list[BlockKey] = stored or []  # committed in the receiver's pool (unpinned, cached)
        self.evicted: list[BlockKey] = evicted or []  # keys the receiver's allocations evicted: publish them


class BadPeerUrl(TransferError, ValueError):
    """A peer URL this layer cannot parse or has no transport for."""


class PeerUnreachable(TransferError):
    """Unknown host, refused or reset connection before any answer."""


class TransferTimeout(TransferError):
    """The fetch's deadline passed before it finished."""


class ProtocolError(TransferError):
    """The peer said something this side cannot understand (version, framing)."""


class Unauthorized(TransferError):
    """The peer refused our token."""
