"""The framed block record: how one block's bytes travel and rest on disk.

    | version u8 | flags u8 | reserved u16 | payload_bytes u32 | checksum u64 | key 16 B | payload ... |
    '------------------------------ HEADER_BYTES = 32 ------------------------------'

The checksum is xxh3_64 of the payload. The same record is the unit on the
wire (prefixpool/transfer/) and in the disk tier, so a block is verified the same way
wherever it comes from. Knows nothing of sockets, files or pools.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from prefixpool.store.keys import KEY_BYTES, BlockKey

RECORD_VERSION = 1
_HEADER = struct.Struct(f"<BBHIQ{KEY_BYTES}s")
HEADER_BYTES = _HEADER.size


class RecordError(ValueError):
    """A record header or payload that cannot be trusted."""


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: BlockKey
    payload_bytes: int
    checksum: int
    flags: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(RECORD_VERSION, self.flags, 0, self.payload_bytes, self.checksum, self.key)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "RecordHeader":
        if len(raw) != HEADER_BYTES:
            raise RecordError(f"record header is {HEADER_BYTES} bytes, got {len(raw)}")
        version, flags, _, payload_bytes, checksum, key = _HEADER.unpack(raw)
        if version != RECORD_VERSION:
            raise RecordError(f"record version {version}, expected {RECORD_VERSION}")
        return cls(BlockKey(key), payload_bytes, checksum, flags)


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def header_for(key: BlockKey, payload: bytes | bytearray | memoryview) -> RecordHeader:
    return RecordHeader(key, memoryview(payload).nbytes, checksum(payload))


def verify(header: RecordHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise RecordError unless `payload` is exactly what `header` describes."""
    size = memoryview(payload).nbytes
    if size != header.payload_bytes:
        raise RecordError(f"payload is {size} bytes, header says {header.payload_bytes}")
    if checksum(payload) != header.checksum:
        raise RecordError(f"checksum mismatch for block {header.key.hex()}")
