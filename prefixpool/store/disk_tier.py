"""The SSD tier: one file per block, each the framed wire record, written on a background thread.

    <directory>/<key hex>.blk = RecordHeader (32 B: version, size, xxh3-64, key) + payload
    put(key, bytes)  -> copies, enqueues, returns at once; a full queue drops the block
    writer thread    -> <key>.tmp, then os.replace: a crash leaves a .tmp, never a torn .blk
    read(key)        -> verified payload, or None: a short, corrupt or foreign file is a miss
    scan()           -> after a restart, re-index every valid file and return its keys

Blocks become "stored" when their file is complete, not when queued; the
writer records what it stored and evicted (oldest first past `max_blocks`),
and `take_changes` hands that to the caller to publish. Knows nothing of
the device pool, the host tier or etcd.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from prefixpool.store.keys import KEY_BYTES, BlockKey
from prefixpool.store.record import HEADER_BYTES, RecordError, RecordHeader, header_for, verify
from prefixpool.store.tier_names import DISK

SUFFIX = ".blk"


class DiskTier:
    name = DISK

    def __init__(self, directory: str | Path, block_bytes: int, max_blocks: int, queue_blocks: int = 64) -> None:
        if max_blocks <= 0 or queue_blocks <= 0:
            raise ValueError("a disk tier needs max_blocks > 0 and queue_blocks > 0 (size 0: do not construct it)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.index: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first
        self.num_dropped = 0
        self.num_failed = 0
        self._pending: dict[BlockKey, bytes] = {}
        self._stored: list[BlockKey] = []
        self._removed: list[BlockKey] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[BlockKey, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._run, name="disk-tier-writer", daemon=True)
        self._writer.start()

    def path(self, key: BlockKey) -> Path:
        return self.directory / f"{key.hex()}{SUFFIX}"

    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self.index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def full(self) -> bool:
        return False  # the writer evicts by itself; nothing has to make room first

    def put(self, key: BlockKey, payload: torch.Tensor | bytes | bytearray | memoryview) -> bool:
        """Queue a copy of the block for writing; never blocks. Always False: stored is reported later."""
        data = _to_bytes(payload)
        if len(data) != self.block_bytes:
            raise ValueError(f"disk tier blocks are {self.block_bytes} bytes, got {len(data)}")
        with self._lock:
            if key in self.index or key in self._pending:
                return False
            self._pending[key] = data
        try:
            self._queue.put_nowait((key, data))
        except queue.Full:
            with self._lock:
                del self._pending[key]
                self.num_dropped += 1
        return False

    def read(self, key: BlockKey) -> memoryview | bytes | None:
        """The block's verified payload; a bad file is deleted, reported removed, and is a miss."""
        with self._lock:
            data = self._pending.get(key)
            if data is not None:
                return data
            if key not in self.index:
                return None
        payload = self._read_file(key)
        with self._lock:
            if payload is None:
                self._forget(key)
            elif key in self.index:
                self.index.move_to_end(key)
        return payload

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            return self._forget(key)

    def scan(self) -> list[BlockKey]:
        """Index every valid block file (oldest first), delete the rest; returns the keys found."""
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            key = _key_of(path)
            if key is None or self._read_file(key) is None:
                path.unlink(missing_ok=True)
                continue
            with self._lock:
                self.index[key] = None
                self._evict_over_capacity()
        with self._lock:
            return list(self.index)

    def take_changes(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """(stored, removed) since the last call: what to publish."""
        with self._lock:
            stored, self._stored = self._stored, []
            removed, self._removed = self._removed, []
        return stored, removed

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data = item
            try:
                self._write_file(key, data)
            except OSError:
                with self._lock:
                    self._pending.pop(key, None)
                    self.num_failed += 1
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write_file(self, key: BlockKey, data: bytes) -> None:
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as file:
            file.write(header_for(key, data).pack())
            file.write(data)
        os.replace(tmp, path)
        with self._lock:
            self._pending.pop(key, None)
            self.index[key] = None
            self._stored.append(key)
            self._evict_over_capacity()

    def _read_file(self, key: BlockKey) -> memoryview | None:
        try:
            with open(self.path(key), "rb", buffering=0) as file:
                raw = bytearray(os.fstat(file.fileno()).st_size)
                if file.readinto(raw) != len(raw) or len(raw) < HEADER_BYTES:
                    return None
            header = RecordHeader.unpack(bytes(raw[:HEADER_BYTES]))
            payload = memoryview(raw)[HEADER_BYTES:]
            if header.key != key or header.payload_bytes != self.block_bytes:
                return None
            verify(header, payload)
        except (OSError, RecordError):
            return None
        return payload

    def _forget(self, key: BlockKey) -> bool:
        """Drop a key and its file; caller holds the lock."""
        if key not in self.index:
            return False
        del self.index[key]
        self.path(key).unlink(missing_ok=True)
        self._removed.append(key)
        return True

    def _evict_over_capacity(self) -> None:
        while len(self.index) > self.max_blocks:
            self._forget(next(iter(self.index)))


def _to_bytes(payload: torch.Tensor | bytes | bytearray | memoryview) -> bytes:
    """An owned copy: the caller may reuse its memory as soon as put returns."""
    if isinstance(payload, torch.Tensor):
        payload = payload.reshape(-1).view(torch.uint8).cpu().numpy()
    return bytes(memoryview(payload).cast("B"))


def _key_of(path: Path) -> BlockKey | None:
    try:
        raw = bytes.fromhex(path.stem)
    except ValueError:
        return None
    return BlockKey(raw) if len(raw) == KEY_BYTES else None
