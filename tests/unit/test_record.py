"""Block records: headers round-trip, and any damage is detected."""

import pytest

from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.record import HEADER_BYTES, RecordError, RecordHeader, header_for, verify

KEY = chain_ids([1], Namespace("record-test"))[0]


def test_header_round_trip_and_verify():
    payload = bytes(range(256)) * 4
    header = header_for(KEY, payload)
    raw = header.pack()
    assert len(raw) == HEADER_BYTES
    assert RecordHeader.unpack(raw) == header
    verify(header, payload)


def test_bit_flip_and_truncation_are_detected():
    payload = bytearray(1024)
    header = header_for(KEY, payload)
    payload[500] ^= 1
    with pytest.raises(RecordError, match="checksum"):
        verify(header, payload)
    with pytest.raises(RecordError, match="bytes"):
        verify(header, bytes(1023))


def test_bad_header_is_rejected():
    raw = bytearray(header_for(KEY, b"x").pack())
    raw[0] = 99
    with pytest.raises(RecordError, match="version"):
        RecordHeader.unpack(bytes(raw))
    with pytest.raises(RecordError):
        RecordHeader.unpack(bytes(raw[:10]))
