"""Throughput of moving KV blocks: raw socket, our TCP, our UCX, Mooncake's engine; loopback or across hosts.

    python scripts/bench_transfer.py [--total-mib 1024] [--arena-mib 256]
    python scripts/bench_transfer.py --hosts --movers "raw socket,prefixpool TCP,prefixpool UCX"   # root

With --hosts the holder and the receiver run in two network namespaces on a
veth bridge (prefixpool/testing/hosts.py), each process entering its namespace with
setns(2) before it makes a socket or a thread; UCX uses the namespace's eth0.

Each row moves about `total-mib` of blocks of one size from a holder process
to a receiver process over 127.0.0.1 (the same 256 MiB arena, sent again and
again), after one untimed warm-up pass. Every mover's data is verified: the
receiver's arena must hash (xxh3-64) to what the holder sent; ours also checks
each block's checksum on the way. "raw socket" moves bare payloads (one digest of
the whole arena, untimed, at the end); "raw + xxh3" does what ours does
per block with no protocol around it: the sender hashes each block and sends the
8-byte checksum before it, the receiver hashes it on arrival and compares. Ours
hashes a block on the holder once (the untimed warm-up pass) and reuses that
checksum on later sends (prefixpool/store/checksums.py); the receiver hashes every block.
"TCP rehashing" is ours with the holder hashing every block on every send, as
before that cache. One run, one table, ratios to the raw
socket (the ceiling here) and to Mooncake's TransferEngine over TCP
(`batch_transfer_sync_write`, every block of a pass in one call).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing
import os
import signal
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_PROTO_ENABLE", "n")
os.environ.setdefault("UCXPY_PROGRESS_MODE", "polling")
os.environ.setdefault("GLOG_minloglevel", "2")
import xxhash  # noqa: E402

from prefixpool.store.arena import KVArena  # noqa: E402
from prefixpool.store.node_blocks import NodeBlocks  # noqa: E402
from prefixpool.store.pool import BlockPool  # noqa: E402
from prefixpool.testing.bench_arenas import BLOCK_SIZES, arena_for, filled_arena, keys_for, raw_view  # noqa: E402
from prefixpool.testing.native_logs import send_native_logs_to  # noqa: E402

MOVERS = ("raw socket", "raw + xxh3", "prefixpool TCP", "TCP rehashing", "prefixpool UCX", "Mooncake TCP")
CHECKSUM = struct.Struct("<Q")


def digest(arena: KVArena) -> int:
    return xxhash.xxh3_64_intdigest(raw_view(arena))


@dataclass(frozen=True)
class Placement:
    """Where the holder and the receiver run: loopback, or two network namespaces (ns None: this one)."""

    holder_address: str = "127.0.0.1"
    holder_ns: str | None = None
    receiver_address: str = "127.0.0.1"
    receiver_ns: str | None = None


LOOPBACK = Placement()
_CLONE_NEWNET = 0x40000000


def enter(ns: str | None) -> None:
    """Move this process (before it has threads or sockets) into network namespace `ns`."""
    if ns is None:
        return
    with open(f"/var/run/netns/{ns}") as handle:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(handle.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")


# --- holders (child processes) ---------------------------------------------


def raw_holder(conn, place: Placement, block_bytes: int, arena_bytes: int, passes: int, verified: bool) -> None:
    enter(place.holder_ns)
    arena = filled_arena(block_bytes, arena_bytes)
    view = raw_view(arena)
    with socket.create_server((place.holder_address, 0)) as listener:
        conn.send((listener.getsockname()[1], digest(arena)))
        sock, _ = listener.accept()
    with sock:
        for _ in range(passes):
            for offset in range(0, arena_bytes, block_bytes):
                block = view[offset : offset + block_bytes]
                if verified:
                    sock.sendall(CHECKSUM.pack(xxhash.xxh3_64_intdigest(block)))
                sock.sendall(block)
        sock.recv(1)


def transfer_holder(conn, place: Placement, scheme: str, block_bytes: int, arena_bytes: int, rehash: bool) -> None:
    enter(place.holder_ns)
    from prefixpool.transfer import serve
    from prefixpool.transfer.source import BlockSource

    class RehashingSource(BlockSource):
        """The holder as it was before prefixpool/store/checksums.py: every send hashes its blocks again."""

        async def pin(self, keys):
            self.blocks.checksums.forget(range(self.blocks.num_blocks))
            return await super().pin(keys)

    async def main() -> None:
        arena = filled_arena(block_bytes, arena_bytes)
        blocks = NodeBlocks(BlockPool(arena.num_blocks))
        hold = blocks.acquire(())
        blocks.allocate(hold, arena.num_blocks)
        blocks.commit(hold, 0, keys_for(arena.num_blocks))
        blocks.release(hold)
        source = RehashingSource(blocks, arena) if rehash else None
        server = await serve(blocks, arena, f"{scheme}://{place.holder_address}:0", source=source)
        conn.send((server.url, digest(arena)))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the pipe, not the pool
        await server.close()

    asyncio.run(main())


def mooncake_target(conn, place: Placement, block_bytes: int, arena_bytes: int) -> None:
    enter(place.holder_ns)
    from mooncake.engine import TransferEngine

    arena = arena_for(block_bytes, arena_bytes)
    engine = TransferEngine()
    assert engine.initialize(place.holder_address, "P2PHANDSHAKE", "tcp", "") == 0
    address = arena.tensor.data_ptr()
    assert engine.register_memory(address, arena_bytes) == 0
    conn.send((f"{place.holder_address}:{engine.get_rpc_port()}", address))
    conn.recv()
    conn.send(digest(arena))


# --- receivers (this process); each returns (seconds for `passes`, verified) ---


def start(target, *args):
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=target, args=(there, *args))
    process.start()
    return process, here


def recv_exactly(sock: socket.socket, buffer: memoryview) -> None:
    got = 0
    while got < buffer.nbytes:
        got += sock.recv_into(buffer[got:], buffer.nbytes - got, socket.MSG_WAITALL)


def run_raw(place: Placement, block_bytes: int, arena_bytes: int, passes: int,
            verified: bool = False) -> tuple[float, bool]:
    process, conn = start(raw_holder, place, block_bytes, arena_bytes, passes + 1, verified)
    port, expected = conn.recv()
    arena = arena_for(block_bytes, arena_bytes)
    view, header, intact = raw_view(arena), memoryview(bytearray(CHECKSUM.size)), True
    with socket.create_connection((place.holder_address, port)) as sock:
        elapsed = 0.0
        for number in range(passes + 1):
            began = time.perf_counter()
            for offset in range(0, arena_bytes, block_bytes):
                block = view[offset : offset + block_bytes]
                if verified:
                    recv_exactly(sock, header)
                recv_exactly(sock, block)
                if verified:
                    intact &= CHECKSUM.unpack(header)[0] == xxhash.xxh3_64_intdigest(block)
            elapsed += (time.perf_counter() - began) if number else 0.0
        sock.sendall(b"x")
    process.join()
    return elapsed, intact and digest(arena) == expected


def run_raw_verified(*args) -> tuple[float, bool]:
    return run_raw(*args, verified=True)


def run_ours(scheme: str, place: Placement, block_bytes: int, arena_bytes: int, passes: int,
             rehash: bool = False) -> tuple[float, bool]:
    from prefixpool.transfer import Fetcher

    process, conn = start(transfer_holder, place, scheme, block_bytes, arena_bytes, rehash)
    url, expected = conn.recv()
    arena = arena_for(block_bytes, arena_bytes)
    keys = keys_for(arena.num_blocks)

    async def main() -> tuple[float, bool]:
        fetcher, elapsed, complete = Fetcher(), 0.0, True
        for number in range(passes + 1):
            blocks = NodeBlocks(BlockPool(arena.num_blocks))  # a fresh receiver each pass, same arena
            began = time.perf_counter()
            result = await fetcher.fetch(url, keys, blocks, arena, deadline_s=120)
            elapsed += (time.perf_counter() - began) if number else 0.0
            complete &= result.num_blocks == len(keys)
        await fetcher.close()
        return elapsed, complete

    elapsed, complete = asyncio.run(main())
    conn.send("done")
    process.join()
    return elapsed, complete and digest(arena) == expected


def run_mooncake(place: Placement, block_bytes: int, arena_bytes: int, passes: int) -> tuple[float, bool]:
    from mooncake.engine import TransferEngine

    process, conn = start(mooncake_target, place, block_bytes, arena_bytes)
    session, remote = conn.recv()
    arena = filled_arena(block_bytes, arena_bytes)
    engine = TransferEngine()
    assert engine.initialize(place.receiver_address, "P2PHANDSHAKE", "tcp", "") == 0
    local = arena.tensor.data_ptr()
    assert engine.register_memory(local, arena_bytes) == 0
    offsets = range(0, arena_bytes, block_bytes)
    sources, targets = [local + o for o in offsets], [remote + o for o in offsets]
    elapsed, ok = 0.0, True
    for number in range(passes + 1):
        began = time.perf_counter()
        ok &= engine.batch_transfer_sync_write(session, sources, targets, [block_bytes] * len(sources)) == 0
        elapsed += (time.perf_counter() - began) if number else 0.0
    conn.send("done")
    verified = ok and conn.recv() == digest(arena)
    process.join()
    return elapsed, verified


def run_tcp(*args) -> tuple[float, bool]:
    return run_ours("tcp", *args)


def run_tcp_rehashing(*args) -> tuple[float, bool]:
    return run_ours("tcp", *args, rehash=True)


def run_ucx(*args) -> tuple[float, bool]:
    return run_ours("ucx", *args)


RUNNERS = {"raw socket": run_raw, "raw + xxh3": run_raw_verified, "prefixpool TCP": run_tcp,
           "TCP rehashing": run_tcp_rehashing, "prefixpool UCX": run_ucx, "Mooncake TCP": run_mooncake}


def receiver(conn, mover: str, place: Placement, *args) -> None:
    enter(place.receiver_ns)
    conn.send(RUNNERS[mover](place, *args))


def measure(mover: str, place: Placement, *args) -> tuple[float, bool]:
    """Run one mover's receiver in a fresh process: no engine threads or UCX state carry over."""
    process, conn = start(receiver, mover, place, *args)
    result = conn.recv()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per row (timed)")
    parser.add_argument("--arena-mib", type=int, default=256, help="arena size on each side")
    parser.add_argument("--movers", default=",".join(MOVERS), help="comma-separated subset of the columns")
    parser.add_argument("--blocks", default=",".join(BLOCK_SIZES), help="comma-separated subset of the rows")
    parser.add_argument("--log-file", default=None, help="where Mooncake's and UCX's logs go (default: a temp file)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per cell, movers interleaved; the table shows medians")
    parser.add_argument("--hosts", action="store_true", help="holder and receiver in two network namespaces (root)")
    args = parser.parse_args()
    send_native_logs_to(args.log_file)
    if not args.hosts:
        return table(args, LOOPBACK, "loopback")
    from prefixpool.testing.hosts import Hosts

    os.environ["UCX_NET_DEVICES"] = "eth0"  # the children inherit it: the namespaces' veth, not lo
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its namespaces
    with Hosts(2) as hosts:
        place = Placement(hosts[0].address, hosts[0].name, hosts[1].address, hosts[1].name)
        table(args, place, f"across two network namespaces on a veth bridge ({hosts[0].address} -> {hosts[1].address})")


BASELINES = ("raw socket", "raw + xxh3", "Mooncake TCP")  # the ratio columns: best of ours to each


def table(args: argparse.Namespace, place: Placement, where: str) -> None:
    movers = [m for m in MOVERS if m in args.movers.split(",")]
    arena_bytes = args.arena_mib << 20
    passes = max(1, args.total_mib // args.arena_mib)
    moved = passes * arena_bytes
    print(f"{where}, {moved >> 20} MiB timed per row ({passes} passes over a {args.arena_mib} MiB arena), GB/s"
          f"{f', median of {args.repeat} interleaved runs' if args.repeat > 1 else ''}")
    print(f"{os.cpu_count()} CPUs, load average at start {load_average()}\n")
    print("| block | " + " | ".join(movers) + "".join(f" | best ours / {b}" for b in BASELINES) + " | verified |")
    print("|---" * (len(movers) + len(BASELINES) + 2) + "|")
    every_run = []
    for label, block_bytes in BLOCK_SIZES.items():
        if label not in args.blocks.split(","):
            continue
        samples, verified = {mover: [] for mover in movers}, True
        for _ in range(args.repeat):  # movers interleaved, so a load spike hits them alike
            for mover in movers:
                elapsed, ok = measure(mover, place, block_bytes, arena_bytes, passes)
                samples[mover].append(moved / elapsed / 1e9)
                verified = verified and ok
        rates = {mover: statistics.median(rates) for mover, rates in samples.items()}
        best = max(rates.get("prefixpool TCP", 0.0), rates.get("prefixpool UCX", 0.0))
        cells = " | ".join(f"{rates[m]:.2f}" for m in movers)
        ratios = " | ".join(f"{best / rates[m]:.2f}x" if m in rates else "-" for m in BASELINES)
        print(f"| {label} | {cells} | {ratios} | {'yes' if verified else 'NO'} |", flush=True)
        every_run.append(f"{label}: " + "; ".join(f"{m} " + " / ".join(f"{r:.2f}" for r in samples[m]) for m in movers))
    print(f"\nload average at end {load_average()}; every run, in order:\n" + "\n".join(every_run))


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
