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

Publication rule (the node): publish a boundary key iff the node holds that block, and
the *tail* of each chain it stores: the last key of what one store adds (a request's last
full block), so that a peer can match the partial run at the end of a shared prefix (the
next turn of a conversation shares the whole previous chain). The blocks between are never
published. A chained key implies its whole prefix's content, and pools evict a request's
tail first, so holding a run's last block almost always means holding the run. A node
holding only part of a run (its head: the tail was evicted) publishes nothing for it; it
still reuses those blocks itself, one by one, from its own pool, because local matching
never asks etcd. A key is deleted iff it was published: boundaries always, a tail when etcd
holds it (the publisher knows: `known`); a tail moved to another tier is re-put there.
A store of several chains in one publish names their tails (`tails`): the worker engine's
per-step publish names the last key stored by each request that ended in the step (once per
request, when its chain stops growing: prefixpool/engine/scheduler.py). The vLLM sidecar publishes each KV
event naming no tail, and a chain's last key as one once no event has continued it for tail_delay_s (vLLM
says no "request ended": prefixpool/vllm_sidecar/tails.py). Else its last key is the one tail: the connector's
pool publishes each save.

    chain  k0 k1 k2 k3 k4 k5 k6 k7 k8 k9            stored by one request: k0..k9
    bound        *        *  *                       tail k9
    etcd   k2 k6 k7 k9                               at most one key per stored chain more

Matching rule (the router): look up the request's boundary keys; a node matches through the
last of its consecutively held boundaries, then on to the farthest key it holds in the
partial run after it, up to its next missing boundary (only tails are published there):

    request  k0 .. k7 k8 k9 k10 k11 ...   boundaries k2 k6 k7 held, k12 not: partial run k8..k11,
                                          k9 held (a tail): the node matches 10 blocks

One batched lookup (`last_held`) covers the partial runs of every node's frontier at once.
A partial run whose node holds no tail in it (its chain went on, or another node's chain
ends there) is never matched across nodes: the hit rate that costs is measured by
`prefixpool replay --run-blocks`. An overestimate (a node that holds a boundary or a tail
but lost a block before it) is stale metadata like any other: the transfer re-checks full
keys and serves the longest prefix it really holds, the rest is recomputed; never a wrong
block. A wrong or stale tail is the same: at worst a fetch that comes back short.

Mixed settings lose hits, never correctness: boundaries for 2N are a subset of those
for N, so a router set to a larger N than its nodes matches coarser; one set smaller
looks up keys nobody published and matches less. Run every process with the same N.
Knows nothing of etcd, pools or the index's layout (it needs `longest_prefix` and `last_held`).
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from prefixpool.store.keys import KEY_BYTES, BlockKey

MAX_RUN_BLOCKS = 256  # one byte of the key decides
T = TypeVar("T")


class LongestPrefix(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]: ...
    def last_held(self, keys: Sequence[BlockKey], spans: Sequence[tuple[int, int]]) -> list[dict[str, int]]: ...


def check_run_blocks(run_blocks: int) -> int:
    """`run_blocks` if valid (a power of two in [1, 256]), else ValueError."""
    if not 1 <= run_blocks <= MAX_RUN_BLOCKS or run_blocks & (run_blocks - 1):
        raise ValueError(f"run blocks must be a power of two from 1 to {MAX_RUN_BLOCKS}, got {run_blocks}")
    return run_blocks


def is_boundary(key: BlockKey, run_blocks: int) -> bool:
    return not key[-1] & (run_blocks - 1)


def boundaries(keys: Sequence[BlockKey], run_blocks: int) -> list[int]:
    """Positions of the boundary keys in `keys`, in order."""
    if not keys:
        return []
    last_bytes = np.frombuffer(b"".join(keys), np.uint8)[KEY_BYTES - 1 :: KEY_BYTES]
    return np.flatnonzero(last_bytes & (run_blocks - 1) == 0).tolist()


def nothing_known(key: BlockKey) -> bool:
    """No tail published yet (the default of `published`)."""
    return False


def published(keys: Iterable[BlockKey], run_blocks: int, tails: Collection[BlockKey] = (),
              known: Callable[[BlockKey], bool] = nothing_known) -> list[BlockKey]:
    """The keys a node publishes out of `keys` (stored, moved or removed): all of them when run_blocks is 1;
    else the run boundaries, the stored chains' `tails`, and the keys `known` says etcd holds (tails published
    before, now moved to another tier or gone)."""
    if run_blocks == 1:
        return list(keys)
    mask = run_blocks - 1
    return [key for key in keys if not key[-1] & mask or key in tails or known(key)]


def published_entries(entries: Iterable[tuple[BlockKey, T]], run_blocks: int,
                      known: Callable[[BlockKey], bool] = nothing_known) -> list[tuple[BlockKey, T]]:
    """The (key, tier) entries a node publishes (a full re-publish filters `all_keys` through this): the
    boundaries, and the tails `known` says it had published."""
    if run_blocks == 1:
        return list(entries)
    mask = run_blocks - 1
    return [entry for entry in entries if not entry[0][-1] & mask or known(entry[0])]


def longest_prefix(index: LongestPrefix, keys: Sequence[BlockKey], run_blocks: int) -> dict[str, int]:
    """Per node, blocks from keys[0] on that it holds, at run granularity (nodes with 0 omitted): through its
    last consecutively held boundary, then on to the farthest key it holds (a tail) before its next missing one."""
    if run_blocks == 1:
        return index.longest_prefix(keys)
    ends = boundaries(keys, run_blocks)
    held = index.longest_prefix([keys[i] for i in ends]) if ends else {}
    matches = {node_id: ends[num - 1] + 1 for node_id, num in held.items() if num}
    frontiers = sorted({0, *held.values()})  # boundaries held; each frontier's partial run: one span, one lookup
    spans = [(ends[num - 1] + 1 if num else 0, ends[num] if num < len(ends) else len(keys)) for num in frontiers]
    for num, reached in zip(frontiers, index.last_held(keys, spans)):
        for node_id, end in reached.items():
            if held.get(node_id, 0) == num:
                matches[node_id] = end
    return matches


def run_lengths(keys: Sequence[BlockKey], run_blocks: int) -> dict[BlockKey, int]:
    """Each boundary key in `keys` -> the blocks its run covers within `keys` (for tier counts)."""
    lengths, start = {}, 0
    for end in boundaries(keys, run_blocks):
        lengths[keys[end]] = end + 1 - start
        start = end + 1
    return lengths
