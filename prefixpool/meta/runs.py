"""Run-granular publication: one etcd key per run of about N chained blocks instead of one per block.

A block is a *run boundary* when its key says so, which every process decides alike from
the key alone (content-defined, like the chunk boundaries of rsync or restic):

    is_boundary(key, N)  <=>  key[-1] & (N - 1) == 0          N a power of two, 1 <= N <= 256

    chain  k0 k1 k2 k3 k4 k5 k6 k7 k8 k9 ...       (N = 4: one key in 4 on average is a boundary)
    bound        *        *  *              *
    runs   [k0 k1 k2][k3 k4 k5 k6][k7][k8 k9 ...
    etcd   /blocks/<k2>/<node>  /blocks/<k6>/<node>  /blocks/<k7>/<node>   (tier, as per block)

Why keyed on the content and not on the position (every N-th block): nothing that
publishes (a pool's eviction, the vLLM sidecar's ledger) knows a block's position in its
chain, and a boundary must mean the same to every node and router. Keys are uniform hashes,
so runs are N blocks long on average (geometric), and etcd sees about 1/N of the operations.

Publication rule (the node): publish a boundary key iff the node holds that block; the
blocks between boundaries are never published. A chained key implies its whole prefix's
content, and pools evict a request's tail first, so holding a run's last block almost
always means holding the run. A node holding only part of a run (its head: the tail was
evicted) publishes nothing for it; it still reuses those blocks itself, one by one, from
its own pool, because local matching never asks etcd.

Matching rule (the router): look up the request's boundary keys only; a node matches
through the last of its consecutively held boundaries, and the blocks up to that boundary
count as matched. The partial run after it (fewer than about N blocks) is never matched
across nodes: the hit rate that costs is measured by `prefixpool replay --run-blocks`.
An overestimate (a node that holds a boundary but lost a block before it) is stale
metadata like any other: the transfer re-checks full keys and serves the longest prefix
it really holds, the rest is recomputed; never a wrong block.

Mixed settings lose hits, never correctness: boundaries for 2N are a subset of those
for N, so a router set to a larger N than its nodes matches coarser; one set smaller
looks up keys nobody published and matches less. Run every process with the same N.
Knows nothing of etcd, pools or the index's layout (it needs only `longest_prefix`).
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence, TypeVar

from prefixpool.store.keys import BlockKey

MAX_RUN_BLOCKS = 256  # one byte of the key decides
T = TypeVar("T")


class LongestPrefix(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]: ...


def check_run_blocks(run_blocks: int) -> int:
    """`run_blocks` if valid (a power of two in [1, 256]), else ValueError."""
    if not 1 <= run_blocks <= MAX_RUN_BLOCKS or run_blocks & (run_blocks - 1):
        raise ValueError(f"run blocks must be a power of two from 1 to {MAX_RUN_BLOCKS}, got {run_blocks}")
    return run_blocks


def is_boundary(key: BlockKey, run_blocks: int) -> bool:
    return not key[-1] & (run_blocks - 1)


def boundaries(keys: Sequence[BlockKey], run_blocks: int) -> list[int]:
    """Positions of the boundary keys in `keys`, in order."""
    mask = run_blocks - 1
    return [i for i, key in enumerate(keys) if not key[-1] & mask]


def published(keys: Iterable[BlockKey], run_blocks: int) -> list[BlockKey]:
    """The keys a node publishes out of `keys` (all of them when run_blocks is 1)."""
    if run_blocks == 1:
        return list(keys)
    mask = run_blocks - 1
    return [key for key in keys if not key[-1] & mask]


def published_entries(entries: Iterable[tuple[BlockKey, T]], run_blocks: int) -> list[tuple[BlockKey, T]]:
    """The (key, tier) entries a node publishes (a full re-publish filters `all_keys` through this)."""
    if run_blocks == 1:
        return list(entries)
    mask = run_blocks - 1
    return [entry for entry in entries if not entry[0][-1] & mask]


def longest_prefix(index: LongestPrefix, keys: Sequence[BlockKey], run_blocks: int) -> dict[str, int]:
    """Per node, blocks from keys[0] on that it holds, at run granularity (nodes with 0 omitted)."""
    if run_blocks == 1:
        return index.longest_prefix(keys)
    ends = boundaries(keys, run_blocks)
    if not ends:
        return {}
    matched = index.longest_prefix([keys[i] for i in ends])
    return {node_id: ends[num - 1] + 1 for node_id, num in matched.items() if num}


def run_lengths(keys: Sequence[BlockKey], run_blocks: int) -> dict[BlockKey, int]:
    """Each boundary key in `keys` -> the blocks its run covers within `keys` (for tier counts)."""
    lengths, start = {}, 0
    for end in boundaries(keys, run_blocks):
        lengths[keys[end]] = end + 1 - start
        start = end + 1
    return lengths
