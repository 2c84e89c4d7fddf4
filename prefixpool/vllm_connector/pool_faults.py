"""Fault injection for the pool's transfer server, switched at run time through a file (tests only).

    fault_file empty or absent   -> serve normally
    "corrupt N"                  -> in each fetch, blocks N, 2N, ... leave with one byte flipped
                                    AFTER their checksum was computed (a bad link)
    "stall N"                    -> in each fetch, send N blocks, log "prefixpool fault: stalling",
                                    then send nothing more until the process dies (a peer dying mid-fetch)
    "pause N"                    -> in each fetch, send N blocks, log "prefixpool fault: pausing", then
                                    wait until the file says something else, and go on (a slow peer)

A test writes the file to pick the fault for the next fetch; the holder's own
blocks are never touched. Off by default: without a fault file the plain
BlockSource serves (the null object). Knows nothing of vLLM or etcd.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import AsyncIterator

from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.record import RecordHeader, header_for
from prefixpool.transfer.source import BlockSource, Outgoing

log = logging.getLogger(__name__)
PAUSE_POLL_S = 0.05


class FileFaultSource(BlockSource):
    def __init__(self, blocks: NodeBlocks, arena: KVArena, fault_file: str) -> None:
        super().__init__(blocks, arena)
        self.fault_file = Path(fault_file)

    def _fault(self) -> tuple[str, int]:
        try:
            words = self.fault_file.read_text().split()
        except OSError:
            return "", 0
        return (words[0], int(words[1])) if len(words) == 2 else ("", 0)

    async def records(self, outgoing: Outgoing) -> AsyncIterator[tuple[RecordHeader, memoryview]]:
        fault, every = self._fault()
        for index, (key, block_id) in enumerate(zip(outgoing.keys, outgoing.block_ids), start=1):
            if fault == "stall" and index > every:
                log.warning("prefixpool fault: stalling after %d blocks", every)
                await asyncio.Event().wait()  # until cancelled: the holder dies mid-fetch
            if fault == "pause" and index == every + 1:
                log.warning("prefixpool fault: pausing after %d blocks", every)
                while self._fault()[0] == "pause":
                    await asyncio.sleep(PAUSE_POLL_S)
            payload = self.payload(block_id)
            header = header_for(key, payload)
            if fault == "corrupt" and index % every == 0:
                damaged = bytearray(payload)  # a copy: the holder's own block stays good
                damaged[len(damaged) // 2] ^= 0xFF
                payload = memoryview(damaged)
            yield header, payload


def pool_source(blocks: NodeBlocks, arena: KVArena, fault_file: str) -> BlockSource:
    return FileFaultSource(blocks, arena, fault_file) if fault_file else BlockSource(blocks, arena)
