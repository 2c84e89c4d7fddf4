"""The one fault injector (tests and chaos runs only): a block source that damages, stalls or pauses what it serves.

    Faults()                      off: the plain BlockSource serves (the null object)
    Faults(corrupt_every=N)       "corrupt N" for the node's whole life (the worker's --corrupt-transfer-every)
    Faults(fault_file=path)       whatever the file says, read at the start of every fetch served (the vLLM
                                  pool's fault_file: a test rewrites it to pick the next fetch's fault)

    "" or no file    serve normally
    "corrupt N"      blocks N, 2N, ... of each fetch leave with one byte flipped AFTER their checksum
                     was taken (a bad link): the receiver's checksum must catch it
    "stall N"        send N blocks, log "prefixpool fault: stalling", then nothing more until the
                     process dies (a peer dying mid-fetch)
    "pause N"        send N blocks, log "prefixpool fault: pausing", wait until the file says something
                     else, then go on (a slow peer)

Only the bytes on the wire are wrong: the holder's own blocks are never touched.
`num_corrupted(source)` counts the blocks a source sent damaged (the worker's /debug/pool
reports it). Knows nothing of sockets, etcd, vLLM or the router.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.record import RecordHeader
from prefixpool.transfer.source import BlockSource, Outgoing

log = logging.getLogger(__name__)
PAUSE_POLL_S = 0.05
KINDS = ("corrupt", "stall", "pause")


@dataclass(frozen=True)
class Fault:
    kind: str | None = None  # one of KINDS; None serves normally
    every: int = 0


def read_fault(path: Path) -> Fault:
    """The fault a file names ("kind N", N >= 1); no fault for an absent, empty or unreadable file."""
    try:
        words = path.read_text().split()
    except OSError:
        return Fault()
    if len(words) != 2 or words[0] not in KINDS or not words[1].isdigit() or int(words[1]) < 1:
        return Fault()
    return Fault(words[0], int(words[1]))


class FaultySource(BlockSource):
    """Serves like BlockSource, with `fault()` (asked once per fetch) applied to what leaves."""

    def __init__(self, blocks: NodeBlocks, arena: KVArena, fault: Callable[[], Fault]) -> None:
        super().__init__(blocks, arena)
        self.fault = fault
        self.num_corrupted = 0

    async def records(self, outgoing: Outgoing) -> AsyncIterator[tuple[RecordHeader, memoryview]]:
        fault = self.fault()
        index = 0
        async for header, payload in super().records(outgoing):
            index += 1
            if index == fault.every + 1 and fault.kind in ("stall", "pause"):
                await self._hold_back(fault)
            if fault.kind == "corrupt" and index % fault.every == 0:
                payload = self._damaged(payload)
            yield header, payload

    async def _hold_back(self, fault: Fault) -> None:
        if fault.kind == "stall":
            log.warning("prefixpool fault: stalling after %d blocks", fault.every)
            await asyncio.Event().wait()  # until cancelled: the holder dies mid-fetch
        else:
            log.warning("prefixpool fault: pausing after %d blocks", fault.every)
            while self.fault().kind == "pause":
                await asyncio.sleep(PAUSE_POLL_S)

    def _damaged(self, payload: memoryview) -> memoryview:
        self.num_corrupted += 1
        damaged = bytearray(payload)  # a copy: the holder's own block stays good
        damaged[len(damaged) // 2] ^= 0xFF
        return memoryview(damaged)


@dataclass(frozen=True)
class Faults:
    corrupt_every: int = 0  # 0 is off
    fault_file: str = ""  # "" is off; read per fetch served (wins over corrupt_every)

    def source(self, blocks: NodeBlocks, arena: KVArena) -> BlockSource:
        """The source a transfer server should use: plain unless a fault is asked for."""
        if self.fault_file:
            path = Path(self.fault_file)
            return FaultySource(blocks, arena, lambda: read_fault(path))
        if self.corrupt_every:
            if self.corrupt_every < 1:
                raise ValueError(f"corrupt every N blocks needs N >= 1, got {self.corrupt_every}")
            fixed = Fault("corrupt", self.corrupt_every)
            return FaultySource(blocks, arena, lambda: fixed)
        return BlockSource(blocks, arena)


def num_corrupted(source: BlockSource) -> int:
    """Blocks this source sent damaged (0 for a plain source)."""
    return getattr(source, "num_corrupted", 0)
