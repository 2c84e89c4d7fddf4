"""A gap-free stream of one vLLM server's KV event batches, from its ZMQ PUB socket.

    SUB  [topic, seq, payload] ──▶ seq == expected          -> yield the batch
                                   seq >  expected (a gap)  -> ask the replay endpoint (DEALER) for
                                                               [expected, seq); what it still buffers
                                                               is yielded in order
                                   replay short or absent,
                                   or seq went backwards    -> yield RESET (the caller clears and
                                   (vLLM restarted)            relearns; a restart's own history is
                                                               then replayed from 0 like a gap)
    nothing for tail_check_s   ──▶ ask the replay endpoint for [expected, ...): a batch lost last
                                   shows no gap until the next arrives, which may be never

The first batch seen also counts as a gap from 0, so a sidecar that starts or
restarts after vLLM relearns what vLLM's replay buffer still holds. `drop`
is a fault hook: a batch for which it answers True is treated as never
received. Knows nothing of block keys or etcd.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from prefixpool.vllm_sidecar.events import END_SEQ, EventBatch, EventDecodeError, decode_batch, decode_seq, encode_seq

log = logging.getLogger(__name__)


class Reset:
    """History was lost: everything learned so far may be stale."""


RESET = Reset()


def never(seq: int) -> bool:
    return False


@dataclass(frozen=True)
class StreamConfig:
    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    replay_timeout_s: float = 5.0
    tail_check_s: float = 2.0  # 0: never look for a lost last batch


class EventStream:
    def __init__(self, config: StreamConfig, drop: Callable[[int], bool] = never) -> None:
        self.config, self.drop = config, drop
        self.expected: int | None = None
        self.num_batches = self.num_gaps = self.num_replayed = self.num_resets = self.num_tail_repairs = 0
        self._tail: dict[int, bytes] = {}  # batches a tail check yielded: PUB may still deliver them late
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        self._sub.connect(config.endpoint)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()

    async def batches(self) -> AsyncIterator[tuple[int, EventBatch] | Reset]:
        while True:
            if self._tail_checks() and not await self._sub.poll(self.config.tail_check_s * 1000, zmq.POLLIN):
                async for item in self._check_tail():
                    yield item
                continue
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a %d-frame message on the KV event socket", len(frames))
                continue
            seq = decode_seq(frames[1])
            if self.drop(seq):
                continue
            async for item in self._accept(seq, frames[2]):
                yield item

    def _tail_checks(self) -> bool:
        return bool(self.config.replay_endpoint) and self.config.tail_check_s > 0 and self.expected is not None

    async def _check_tail(self) -> AsyncIterator[tuple[int, EventBatch] | Reset]:
        """The stream is quiet: yield whatever vLLM published after the last batch we saw."""
        for seq, payload in await self._replay(self.expected, quiet=True):
            if seq != self.expected:  # older than we asked, or not contiguous: a new publisher
                return  # the next live batch tells which
            self.num_tail_repairs += 1
            self._tail[seq] = payload
            self.expected = seq + 1
            yield self._decode(seq, payload)

    async def _accept(self, seq: int, payload: bytes) -> AsyncIterator[tuple[int, EventBatch] | Reset]:
        if self._tail.get(seq) == payload:
            return  # a tail check yielded it already; PUB was only late
        self._tail.clear()
        if self.expected is not None and seq < self.expected:
            # PUB delivers in order and replays only fill what came before a live batch, so a
            # sequence number going back means a new publisher: vLLM restarted, counting from 0.
            self.num_resets += 1
            self.expected = None
            yield RESET
        start = 0 if self.expected is None else self.expected
        if seq > start:
            self.num_gaps += 1
            async for item in self._repair(start, seq):
                yield item
        self.expected = seq + 1
        yield self._decode(seq, payload)

    async def _repair(self, start: int, end: int) -> AsyncIterator[tuple[int, EventBatch] | Reset]:
        """Batches [start, end) from the replay buffer; RESET first if any of them is gone."""
        replayed = dict(await self._replay(start)) if self.config.replay_endpoint else {}
        missing = [s for s in range(start, end) if s not in replayed]
        if missing:
            log.warning("KV events %d..%d: %d lost for good; clearing and relearning", start, end - 1, len(missing))
            self.num_resets += 1
            yield RESET
            start = missing[-1] + 1
        for seq in range(start, end):
            self.num_replayed += 1
            yield self._decode(seq, replayed[seq])

    async def _replay(self, start: int, quiet: bool = False) -> list[tuple[int, bytes]]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.config.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            async with asyncio.timeout(self.config.replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        return got
                    seq = decode_seq(frames[2])
                    if seq == END_SEQ:
                        return got
                    got.append((seq, frames[3]))
        except TimeoutError:
            (log.debug if quiet else log.warning)("replay endpoint %s did not answer in %.1fs",
                                                  self.config.replay_endpoint, self.config.replay_timeout_s)
            return got
        finally:
            dealer.close(linger=0)

    def _decode(self, seq: int, payload: bytes) -> tuple[int, EventBatch] | Reset:
        """A batch that does not decode is a lost batch: its blocks are unknown, so RESET."""
        try:
            batch = decode_batch(payload)
        except EventDecodeError as err:
            log.warning("KV event batch %d: %s; clearing and relearning", seq, err)
            self.num_resets += 1
            return RESET
        self.num_batches += 1
        return seq, batch
