"""A flat open-addressing hash table over 64-bit block-key fingerprints, in numpy: slot -> bitmap columns.

    fingerprint(key) = key bytes 8..12 << 32 | top half of ((low 8 bytes * odd constant) ^ high 8 bytes)
                       (mod 2**64; 0 is "empty": a 0 becomes 1)

The fingerprint keeps bytes 8..12 whole (key_words), the word an index shard is picked by
(prefixpool.meta.shards): one table can hold every shard's blocks and forget one shard's alone.
Its low half mixes the other 12 bytes in, so hand-made keys differing anywhere still differ.

    fp       (buckets, 8) uint64      | f f f f . . . . | f f f f f f f f | f f . . . . . . | ...
    fill     (buckets,)   uint8         4                 8 (full)          2
    columns  {name: (buckets * 8 + 1,) uint64}   a bitmap per slot and column (the index: a tier's holders),
                                                 and a last word, always 0, that ABSENT (-1) reads

A fingerprint lives in its home bucket (fingerprint * golden ratio, top bits) or, when that one is
full, in the first later bucket that was not (linear probing over buckets of 8 slots, filled from
the left). A lookup of a whole prompt's keys is a few vectorised passes: gather each key's bucket,
compare 8 slots at once, carry on to the next bucket only for keys whose bucket was full.

Slots are never emptied in place: a fingerprint whose bits all clear stays (a tombstone, found and
reused when its key comes back) until the next rebuild, which happens when used slots pass
MAX_LOAD and rehashes the live ones into a table sized for TARGET_LOAD. 16 bytes a slot with one
column: 21-43 bytes per live fingerprint between rebuilds.

Knows nothing of nodes, tiers or etcd; what a fingerprint collision means is prefixpool.meta.index's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from prefixpool.store.keys import KEY_BYTES, BlockKey

BUCKET = 8
MAX_LOAD = 0.75
TARGET_LOAD = 0.5
MIN_BUCKETS = 2  # small: the tests rebuild often; a table doubles as it fills
FOLD = np.uint64(0xC2B2AE3D27D4EB4F)  # odd: every bit of the low half reaches the product's top half
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of fp * GOLDEN pick the bucket
FEW = 64  # keys left in a lookup below which Python walks on, not numpy (17 keys after 5 ms idle: 31 us, 53 at 16)
ONE = np.uint64(1)
WORD_BITS = np.uint64(32)  # a fingerprint's top half is a word of its key
ABSENT = -1  # find()'s slot for a fingerprint the table lacks (numpy arrays have no None)


def fingerprints(keys: Sequence[BlockKey]) -> np.ndarray:
    """uint64 per key, in order (never 0)."""
    halves = np.frombuffer(b"".join(keys), dtype="<u8")
    if halves.size != 2 * len(keys):
        raise ValueError(f"block keys are {KEY_BYTES} bytes")
    low, high = halves[0::2], halves[1::2]
    fps = low * FOLD  # in place from here: this runs once per routing decision
    fps ^= high
    fps >>= WORD_BITS
    fps |= high << WORD_BITS
    return np.maximum(fps, ONE, out=fps)


def key_words(fps: np.ndarray) -> np.ndarray:
    """Bytes 8..12 of each fingerprint's key, little-endian (what shards.shard_of reads of the key)."""
    return fps >> WORD_BITS


class BlockTable:
    def __init__(self, num_buckets: int = MIN_BUCKETS) -> None:
        assert num_buckets >= MIN_BUCKETS and num_buckets & (num_buckets - 1) == 0, num_buckets
        self.fp = np.zeros((num_buckets, BUCKET), np.uint64)
        self.fill = np.zeros(num_buckets, np.uint8)
        self.columns: dict[str, np.ndarray] = {}
        self.num_used = 0  # slots with a fingerprint, live or tombstone
        self.num_live = 0  # slots with a bit in some column
        self._mask = num_buckets - 1
        self._shift = np.uint64(64 - (num_buckets.bit_length() - 1))

    @property
    def capacity(self) -> int:
        return self.fp.size

    @property
    def nbytes(self) -> int:
        return self.fp.nbytes + self.fill.nbytes + sum(column.nbytes for column in self.columns.values())

    def column(self, name: str) -> np.ndarray:
        """The named bitmap column, made (all zero) on first use."""
        if name not in self.columns:
            self.columns[name] = np.zeros(self.capacity + 1, np.uint64)  # + a zero where ABSENT (-1) points
        return self.columns[name]

    def find(self, fps: np.ndarray) -> np.ndarray:
        """int64 slot per fingerprint, ABSENT where the table lacks it. Vectorised rounds, one bucket per
        key each, while many keys are left; the few whose buckets ran full walk on in Python."""
        if fps.size <= FEW:
            return np.array([self._walk(fp, home) for fp, home in zip(fps.tolist(), self._home(fps).tolist())],
                            np.int64)
        slots = np.full(fps.size, ABSENT, np.int64)
        lanes, buckets = np.arange(fps.size), self._home(fps)
        while lanes.size > FEW:
            found, more = self._find_in(fps[lanes], buckets)
            slots[lanes] = found
            lanes, buckets = lanes[more], (buckets[more] + 1) & self._mask
        for lane, bucket in zip(lanes.tolist(), buckets.tolist()):
            slots[lane] = self._walk(int(fps[lane]), bucket)
        return slots

    def _find_in(self, fps: np.ndarray, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot or ABSENT, "look in the next bucket too") per fingerprint, looking in `buckets` only."""
        match = (self.fp.take(buckets, axis=0) == fps[:, None]).view(np.uint64)[:, 0]  # 8 bools, one word
        hit = match != 0  # at most one byte set, at 8 * position: the set bits below it count it
        slots = np.where(hit, buckets * BUCKET + (np.bitwise_count(match - hit) >> 3), ABSENT)
        return slots, ~hit & (self.fill.take(buckets) == BUCKET)

    def _walk(self, fp: int, bucket: int) -> int:
        """find() for one fingerprint from `bucket` on, in Python (cheaper than a numpy round for a few)."""
        while True:
            row = self.fp[bucket].tolist()
            if fp in row:
                return bucket * BUCKET + row.index(fp)
            if self.fill[bucket] < BUCKET:
                return ABSENT
            bucket = (bucket + 1) & self._mask

    def bits(self, fps: np.ndarray) -> np.ndarray:
        """uint64 per fingerprint: its bits in every column OR'd together, 0 where absent."""
        slots = self.find(fps)
        out = np.zeros(fps.size, np.uint64)
        for column in self.columns.values():
            out |= column.take(slots)  # ABSENT takes the zero after the last slot
        return out

    def insert(self, fps: np.ndarray) -> np.ndarray:
        """Slots of distinct `fps`, placing the ones not in the table (their bits all zero)."""
        slots = self.find(fps)
        new = slots == ABSENT
        num_new = int(np.count_nonzero(new))
        if num_new and self.num_used + num_new > MAX_LOAD * self.capacity:
            self._rebuild(fps.size)  # room for all: tombstones among them come back absent
            slots = self.find(fps)  # tombstones among `fps` are gone now: absent too
            new = slots == ABSENT
        if new.any():
            slots[new] = self._place(fps[new])
        return slots

    def set_bits(self, slots: np.ndarray, name: str, mask: np.uint64) -> int:
        """Set `mask` at distinct `slots` of column `name`; how many lacked it."""
        column = self.column(name)
        self.num_live += int(np.count_nonzero(~self._held(slots)))
        had = int(np.count_nonzero(column[slots] & mask))
        column[slots] |= mask
        return slots.size - had

    def clear_bits(self, slots: np.ndarray, name: str, mask: np.uint64) -> int:
        """Clear `mask` at distinct `slots` of column `name`; how many had it."""
        column = self.columns[name]
        had = slots[(column[slots] & mask) != 0]
        column[had] &= ~mask
        self.num_live -= int(np.count_nonzero(~self._held(had)))
        return int(had.size)

    def clear_column(self, name: str, mask: np.uint64) -> None:
        """Clear `mask` everywhere in column `name` (a pass over the table)."""
        self.columns[name] &= ~mask
        self.num_live = int(np.count_nonzero(self.live()))

    def slots_where(self, picked: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Slots holding a fingerprint that `picked` selects (bool per fingerprint), live or tombstone."""
        flat = self.fp.reshape(-1)
        return np.flatnonzero((flat != 0) & picked(flat))

    def _held(self, slots: np.ndarray) -> np.ndarray:
        held = np.zeros(slots.size, bool)
        for column in self.columns.values():
            held |= column[slots] != 0
        return held

    def live(self) -> np.ndarray:
        """Bool per slot: some column has a bit there."""
        held = np.zeros(self.capacity, bool)
        for column in self.columns.values():
            held |= column[:-1] != 0
        return held

    def _home(self, fps: np.ndarray) -> np.ndarray:
        return ((fps * GOLDEN) >> self._shift).view(np.int64)

    def _place(self, fps: np.ndarray) -> np.ndarray:
        """Write distinct absent `fps` into free slots; their slots. Keys sharing a bucket take its free
        slots in turn; the ones it cannot take move to the next bucket in the next round."""
        slots = np.empty(fps.size, np.int64)
        lanes, buckets = np.arange(fps.size), self._home(fps)
        flat = self.fp.reshape(-1)
        while lanes.size:
            order = np.argsort(buckets, kind="stable")
            lanes, buckets = lanes[order], buckets[order]
            first = np.empty(buckets.size, bool)
            first[0], first[1:] = True, buckets[1:] != buckets[:-1]
            steps = np.arange(buckets.size)
            rank = steps - np.maximum.accumulate(np.where(first, steps, 0))
            filled = self.fill[buckets].astype(np.int64)
            fits = rank < BUCKET - filled
            placed = buckets[fits] * BUCKET + filled[fits] + rank[fits]
            flat[placed] = fps[lanes[fits]]
            slots[lanes[fits]] = placed
            self.fill[buckets[fits]] = filled[fits] + rank[fits] + 1  # repeated buckets: the last, highest rank wins
            lanes, buckets = lanes[~fits], (buckets[~fits] + 1) & self._mask
        self.num_used += fps.size
        return slots

    def _rebuild(self, num_new: int) -> None:
        """Rehash the live fingerprints (tombstones dropped, empty columns too) into a table with room for
        `num_new` more at TARGET_LOAD."""
        keep = np.flatnonzero(self.live())
        fps = self.fp.reshape(-1)[keep]
        columns = {name: column[keep] for name, column in self.columns.items() if column.any()}
        num_buckets = MIN_BUCKETS
        while keep.size + num_new > TARGET_LOAD * num_buckets * BUCKET:
            num_buckets *= 2
        self.__init__(num_buckets)
        slots = self._place(fps)
        for name, values in columns.items():
            self.column(name)[slots] = values
        self.num_live = fps.size

    def check_integrity(self) -> None:
        flat = self.fp.reshape(-1)
        used = self.fp != 0
        assert (used.sum(axis=1) == self.fill).all(), "fill counts"
        assert ((np.arange(BUCKET) < self.fill[:, None]) == used).all(), "a bucket's fingerprints are not left-packed"
        assert self.num_used == int(used.sum()), (self.num_used, int(used.sum()))
        assert self.num_used <= MAX_LOAD * self.capacity, "over the load a rebuild keeps"
        present = np.flatnonzero(flat)
        assert np.unique(flat[present]).size == present.size, "a fingerprint in two slots"
        assert (self.find(flat[present]) == present).all(), "a fingerprint its lookup does not reach"
        assert self.num_live == int(np.count_nonzero(self.live())), "live count"
        for name, column in self.columns.items():
            assert column.size == self.capacity + 1 and not column[-1], f"{name}: no zero word for ABSENT"
            assert not column[:-1][flat == 0].any(), f"bits on an empty slot in {name}"
