"""prefixpool.transfer.stream.Scatter over a real socket pair: order, partial buffers, the per-receive byte cap."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import termios
import threading
import time

import pytest

from prefixpool.transfer.stream import SCATTER_BYTES, Scatter


def buffers(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(size)) for size in sizes]


async def receive_into(reader: socket.socket, targets: list[memoryview]) -> list[int]:
    """Scatter from `reader` until every target is full; the bytes each receive completed."""
    scatter, per_receive, done = Scatter(reader, iter(targets)), [], 0
    try:
        while done < len(targets):
            completed = await scatter.receive()
            done += len(completed)
            per_receive.append(sum(view.nbytes for view in completed))
    finally:
        scatter.close()
    return per_receive


async def scatter_all(sizes: list[int], payload: bytes, trailer: bytes) -> tuple[list[memoryview], list[int], bytes]:
    """Send payload + trailer, scatter the payload into buffers of `sizes`; returns the buffers, the
    bytes each receive completed, and what was left in the socket afterwards."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    targets = buffers(sizes)
    sent = asyncio.get_running_loop().run_in_executor(None, writer.sendall, payload + trailer)
    per_receive = await receive_into(reader, targets)
    await sent
    writer.close()
    rest = b""
    reader.setblocking(True)
    while chunk := reader.recv(65536):
        rest += chunk
    reader.close()
    return targets, per_receive, rest


@pytest.mark.parametrize("sizes", [[32, 256 << 10] * 24, [32, 2 << 20] * 4, [7, 1, 3 << 20, 5]])
def test_buffers_fill_in_order_and_the_bytes_after_the_last_stay_in_the_socket(sizes):
    payload, trailer = os.urandom(sum(sizes)), b"next message"
    targets, _, rest = asyncio.run(scatter_all(sizes, payload, trailer))
    assert b"".join(bytes(view) for view in targets) == payload
    assert rest == trailer


def test_one_receive_stops_at_about_scatter_bytes_though_more_has_arrived():
    """The checksum of a block reads bytes the copy just wrote (in cache): one receive takes about
    SCATTER_BYTES, not all the kernel holds."""
    sizes = [32, 256 << 10] * 12  # 3 MiB of records, all in the kernel before the first receive
    payload = os.urandom(sum(sizes))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        reader.connect(listener.getsockname())
        writer, _ = listener.accept()
    sending = threading.Thread(target=writer.sendall, args=(payload,))
    sending.start()
    waiting, queued = time.monotonic() + 30, 0
    while queued < len(payload) and time.monotonic() < waiting:
        time.sleep(0.01)
        queued = int.from_bytes(fcntl.ioctl(reader, termios.FIONREAD, b"\0" * 4), "little")
    assert queued == len(payload), f"only {queued} of {len(payload)} bytes queued"
    reader.setblocking(False)
    targets = buffers(sizes)
    taken = asyncio.run(receive_into(reader, targets))
    sending.join()
    writer.close()
    reader.close()
    assert b"".join(bytes(view) for view in targets) == payload
    assert taken[0] <= SCATTER_BYTES + max(sizes)
    assert taken[0] < sum(sizes)  # the first receive left the rest in the kernel
