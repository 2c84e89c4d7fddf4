"""The gap-repairing event stream against a hand-written publisher that loses batches on purpose.

The publisher speaks vLLM's wire protocol (PUB [topic, seq, payload]; ROUTER
replay: [id, "", start] -> [id, "", topic, seq, payload]..., then END_SEQ) and
can forget batches or restart its sequence: the faults a real vLLM cannot be
made to produce on demand. test_vllm.py checks the repair against a real vLLM.
"""

import asyncio

import msgpack
import zmq
import zmq.asyncio

from prefixpool.vllm_sidecar.event_stream import EventStream, Reset, StreamConfig
from prefixpool.vllm_sidecar.events import END_SEQ, encode_seq


def payload(seq: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [seq], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": 4}
    return msgpack.packb([float(seq), [event]])


class Publisher:
    def __init__(self, context: zmq.asyncio.Context, tmp_path) -> None:
        self.events, self.replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(self.events)
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(self.replay)
        self.buffer: dict[int, bytes] = {}
        self.task = asyncio.create_task(self._serve_replay())

    async def send(self, seq: int, live: bool = True, keep: bool = True) -> None:
        if keep:
            self.buffer[seq] = payload(seq)
        if live:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(seq)])

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([client, b"", b"", encode_seq(END_SEQ), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def collect(stream: EventStream, count: int) -> list:
    items = []
    async with asyncio.timeout(30):
        async for item in stream.batches():
            items.append("RESET" if isinstance(item, Reset) else item[0])
            if len([i for i in items if i != "RESET"]) >= count:
                return items
    return items


def run(tmp_path, scenario, with_replay: bool = True) -> list:
    async def main():
        context = zmq.asyncio.Context()
        publisher = Publisher(context, tmp_path)
        stream = EventStream(StreamConfig(publisher.events, publisher.replay if with_replay else "", "kv"))
        await asyncio.sleep(0.5)  # ZMQ's slow joiner
        try:
            reader = asyncio.create_task(collect(stream, scenario.count))
            await scenario(publisher)
            return await reader
        finally:
            publisher.close()
            stream.close()
            context.term()

    return asyncio.run(main())


def scenario(count: int):
    def wrap(steps):
        steps.count = count
        return steps
    return wrap


def test_batches_lost_in_flight_are_replayed_in_order(tmp_path):
    @scenario(count=5)
    async def steps(pub):
        await pub.send(0)
        await pub.send(1, live=False)  # published, never received
        await pub.send(2, live=False)
        await pub.send(3)
        await pub.send(4)

    assert run(tmp_path, steps) == [0, 1, 2, 3, 4]


def test_a_sidecar_that_joins_late_relearns_from_the_replay_buffer(tmp_path):
    @scenario(count=3)
    async def steps(pub):
        await pub.send(0, live=False)
        await pub.send(1, live=False)
        await pub.send(2)

    assert run(tmp_path, steps) == [0, 1, 2]


def test_history_gone_from_the_buffer_means_clear_and_relearn(tmp_path):
    @scenario(count=3)
    async def steps(pub):
        await pub.send(0)
        await pub.send(1, live=False, keep=False)  # lost, and no longer in the replay buffer
        await pub.send(2, live=False)
        await pub.send(3)

    assert run(tmp_path, steps) == [0, "RESET", 2, 3]


def test_without_a_replay_endpoint_a_gap_is_a_reset(tmp_path):
    @scenario(count=2)
    async def steps(pub):
        await pub.send(0)
        await pub.send(1, live=False)
        await pub.send(2)

    assert run(tmp_path, steps, with_replay=False) == [0, "RESET", 2]


def test_a_restarted_publisher_counting_from_zero_is_a_reset(tmp_path):
    @scenario(count=5)
    async def steps(pub):
        for seq in range(3):
            await pub.send(seq)
        pub.buffer.clear()  # a new vLLM: new sequence, new buffer
        await pub.send(0, live=False)  # its first batch missed (reconnecting), its second arrives
        await pub.send(1)

    assert run(tmp_path, steps) == [0, 1, 2, "RESET", 0, 1]


def test_a_batch_lost_last_is_replayed_once_the_stream_goes_quiet(tmp_path):
    """No later batch reveals the gap: the stream asks the replay endpoint itself when nothing arrives."""
    @scenario(count=3)
    async def steps(pub):
        await pub.send(0)
        await pub.send(1)
        await pub.send(2, live=False)  # the last batch vLLM publishes for a while, lost

    assert run(tmp_path, steps) == [0, 1, 2]


def test_a_late_live_copy_of_a_tail_repaired_batch_is_not_a_restart(tmp_path):
    @scenario(count=4)
    async def steps(pub):
        await pub.send(0)
        await pub.send(1, live=False)
        await asyncio.sleep(3.0)  # past tail_check_s: the stream has replayed 1
        await pub.send(1, keep=False)  # PUB delivers the same batch late
        await pub.send(2)
        await pub.send(3)

    assert run(tmp_path, steps) == [0, 1, 2, 3]
