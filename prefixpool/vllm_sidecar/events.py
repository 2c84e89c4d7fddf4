"""vLLM's KV cache events as they arrive over ZMQ: the decoding side of its wire format.

    multipart message: [topic, seq (8 bytes, big-endian), payload]
    payload (msgpack):  [ts, [event, ...], data_parallel_rank?]
    event (msgpack map, tagged by "type"):
        BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_name, extra_keys, ...
        BlockRemoved      block_hashes, ...
        AllBlocksCleared

The structs mirror `vllm/distributed/kv_events.py` (vLLM 0.32) field for field
where we read them; fields we do not read are ignored, so newer vLLMs that add
fields still decode. A payload that does not decode raises EventDecodeError.
Knows nothing of sockets, etcd or prefixpool's block keys.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = -1  # the replay endpoint's end-of-replay marker
BlockHash = int | bytes  # vLLM's ExternalBlockHash


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # per block: (LoRA name if any, (mm_id, offset) pairs, cache_salt, prompt-embedding digests)
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise EventDecodeError(f"not a vLLM KV event batch: {err}") from err


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def cache_salt_of(event: BlockStored) -> str:
    """The cache_salt vLLM hashed into the event's first block ("" if none).

    vLLM puts the salt only into the extra keys of a request's first block, as
    the one plain string there that is not the LoRA name.
    """
    if not event.extra_keys or event.extra_keys[0] is None:
        return ""
    values = list(event.extra_keys[0])
    if event.lora_name is not None and values and values[0] == event.lora_name:
        values = values[1:]
    return next((v for v in values if isinstance(v, str)), "")


def has_media(event: BlockStored) -> bool:
    """Blocks whose vLLM hash includes multimodal or embedding inputs: token ids alone do not name them."""
    return any(isinstance(v, (tuple, list, bytes)) for keys in (event.extra_keys or []) if keys for v in keys)
