"""The SSD tier: framed files verified on read, async bounded writes, and a restart re-scan."""

import os
import threading

import pytest

from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.record import HEADER_BYTES

NS = Namespace("disk", block_size=1)
BLOCK = 256


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier(tmp_path, BLOCK, max_blocks=8)
    yield tier
    tier.close()


def write(tier, keys):
    for i, key in enumerate(keys):
        tier.put(key, payload(i))
    tier.flush()


def test_written_blocks_read_back_identical_and_are_reported_stored(disk):
    keys = chain(list(range(4)), NS)
    write(disk, keys)
    assert [bytes(disk.read(k)) for k in keys] == [payload(i) for i in range(4)]
    stored, removed = disk.take_changes()
    assert stored == keys and removed == []
    assert disk.take_changes() == ([], [])


def test_file_is_the_wire_record(disk):
    (key,) = chain([1], NS)
    write(disk, [key])
    raw = disk.path(key).read_bytes()
    assert len(raw) == HEADER_BYTES + BLOCK and raw[16:32] == key and raw[HEADER_BYTES:] == payload(0)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "header", "empty"])
def test_a_damaged_file_is_a_miss_and_is_removed(disk, damage):
    keys = chain([1, 2], NS)
    write(disk, keys)
    disk.take_changes()
    path = disk.path(keys[1])
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-1]
    elif damage == "bitflip":
        raw[HEADER_BYTES + 100] ^= 0x10
    elif damage == "header":
        raw[8] ^= 0x01  # the checksum field
    else:
        raw = bytearray()
    path.write_bytes(raw)
    assert disk.read(keys[1]) is None
    assert keys[1] not in disk and not path.exists()
    assert disk.take_changes() == ([], [keys[1]])
    assert bytes(disk.read(keys[0])) == payload(0)


def test_capacity_evicts_the_oldest_files(disk):
    keys = chain(list(range(10)), NS)
    write(disk, keys)
    stored, removed = disk.take_changes()
    assert stored == keys and removed == keys[:2]
    assert len(disk) == 8 and not disk.path(keys[0]).exists()
    assert len(list(disk.directory.glob("*.blk"))) == 8


def test_a_full_queue_drops_without_blocking(tmp_path):
    tier = DiskTier(tmp_path, BLOCK, max_blocks=100, queue_blocks=2)
    gate = threading.Event()
    original = tier._write_file

    def slow_write(key, data):  # fault injection: a stalled disk
        gate.wait()
        original(key, data)

    tier._write_file = slow_write
    keys = chain(list(range(10)), NS)
    for i, key in enumerate(keys):
        assert tier.put(key, payload(i)) is False  # returns at once
    assert tier.num_dropped >= 10 - 3  # at most one in the writer and two queued
    gate.set()
    tier.flush()
    assert len(tier) == 10 - tier.num_dropped
    tier.close()


def test_restart_rescans_valid_files_and_skips_bad_ones(tmp_path):
    keys = chain(list(range(5)), NS)
    first = DiskTier(tmp_path, BLOCK, max_blocks=8)
    write(first, keys)
    first.close()
    (tmp_path / "junk.blk").write_bytes(b"x")
    (tmp_path / f"{keys[0].hex()}.tmp").write_bytes(b"half")
    raw = bytearray(first.path(keys[3]).read_bytes())
    raw[-1] ^= 0xFF
    first.path(keys[3]).write_bytes(raw)
    second = DiskTier(tmp_path, BLOCK, max_blocks=8)
    found = second.scan()
    assert sorted(found) == sorted(keys[:3] + keys[4:])
    assert bytes(second.read(keys[4])) == payload(4)
    assert second.read(keys[3]) is None
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k.hex()}.blk" for k in found)
    second.close()


def test_pending_blocks_are_readable_before_the_write_lands(tmp_path):
    tier = DiskTier(tmp_path, BLOCK, max_blocks=4)
    gate = threading.Event()
    original = tier._write_file
    tier._write_file = lambda key, data: (gate.wait(), original(key, data))
    (key,) = chain([3], NS)
    tier.put(key, payload(3))
    assert key in tier and bytes(tier.read(key)) == payload(3)
    assert tier.take_changes() == ([], [])  # not stored until the file is complete
    gate.set()
    tier.flush()
    assert tier.take_changes() == ([key], [])
    tier.close()
