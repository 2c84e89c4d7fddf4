"""Exact reads and framed messages on a non-blocking socket, through the event loop.

`recv_exactly` fills a caller's buffer (an arena block, a header) with
`loop.sock_recv_into`, so payload bytes go from the kernel straight into their
destination. Knows nothing of pools or of what the messages mean.
"""

from __future__ import annotations

import asyncio
import socket

from transfer.protocol import LENGTH_PREFIX, message_length


class PeerClosed(ConnectionError):
    """The peer closed the stream before a message was complete."""


async def recv_exactly(sock: socket.socket, buffer: memoryview | bytearray) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(buffer).cast("B")
    while view:
        received = await loop.sock_recv_into(sock, view)
        if received == 0:
            raise PeerClosed("peer closed the connection mid-message")
        view = view[received:]


async def recv_message(sock: socket.socket, *, eof_ok: bool = False) -> bytearray | None:
    """One length-prefixed message; None on a clean close between messages when eof_ok."""
    prefix = bytearray(LENGTH_PREFIX.size)
    loop = asyncio.get_running_loop()
    first = await loop.sock_recv_into(sock, prefix)
    if first == 0:
        if eof_ok:
            return None
        raise PeerClosed("peer closed the connection before answering")
    await recv_exactly(sock, memoryview(prefix)[first:])
    body = bytearray(message_length(prefix))
    await recv_exactly(sock, body)
    return body


async def send_all(sock: socket.socket, *buffers: bytes | memoryview) -> None:
    loop = asyncio.get_running_loop()
    for buffer in buffers:
        await loop.sock_sendall(sock, buffer)
