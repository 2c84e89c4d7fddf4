"""Which registered nodes this router may route to: those that hash blocks under its namespace.

    node record namespace == router's   -> a candidate (our worker or a vLLM node alike)
    node record namespace == ""         -> a candidate (a node that does not say: trusted as before)
    anything else                       -> refused, with the reason, so /v1/route and the 503 say why

A request naming a LoRA adapter goes only to the candidates that advertise it
(their record's `adapters`); the base model's requests go to any candidate.
A vLLM node and one of our workers may serve the same cluster only when they
hash the same model, dtype and block size; otherwise their keys could never
match ours and routing on them would be blind. Also: which nodes can take
part in a block transfer (vLLM nodes read only their own cache). Knows
nothing of HTTP, etcd or policies.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

from prefixpool.store.keys import Namespace

W = TypeVar("W")
OWN_KIND = "prefixpool"
# A vLLM node's KV-connector pool (prefixpool/vllm_connector/config.py spells it too; the vllm wing may not
# import the router): it holds and serves blocks, takes no requests, and is named "<vLLM node>.pool".
POOL_KIND = "vllm-pool"
POOL_SUFFIX = ".pool"


def kind_of(worker: object) -> str:
    return getattr(worker, "kind", OWN_KIND)


def admit(workers: Mapping[str, W], namespace: Namespace) -> tuple[dict[str, W], dict[str, str]]:
    """(candidates, refused node -> reason)."""
    ours = namespace.root().hex()
    candidates: dict[str, W] = {}
    refused: dict[str, str] = {}
    for node_id, worker in workers.items():
        if kind_of(worker) == POOL_KIND:
            continue  # a pool takes no requests (pools_of lists them)
        theirs = getattr(worker, "namespace", "")
        if not theirs or theirs == ours:
            candidates[node_id] = worker
        else:
            refused[node_id] = (
                f"{kind_of(worker)} node {node_id} hashes under namespace {theirs[:12]} (model "
                f"{getattr(worker, 'model', '?')!r}, block size {getattr(worker, 'block_size', '?')}); this router "
                f"hashes under {ours[:12]} (model {namespace.model!r}, block size {namespace.block_size}, "
                f"dtype {namespace.dtype})")
    return candidates, refused


def pools_of(nodes: Mapping[str, W], namespace: Namespace) -> dict[str, W]:
    """The vLLM connector pools that hash under our namespace: block holders a vLLM node can fetch from."""
    ours = namespace.root().hex()
    return {n: w for n, w in nodes.items() if kind_of(w) == POOL_KIND and getattr(w, "namespace", "") in ("", ours)}


def with_own_pools(matches: Mapping[str, int], workers: Mapping[str, object]) -> dict[str, int]:
    """A vLLM node's match counts what its own pool holds too: its connector loads that without a peer."""
    merged = dict(matches)
    for node_id in workers:
        pool = matches.get(node_id + POOL_SUFFIX, 0)
        if pool > merged.get(node_id, 0):
            merged[node_id] = pool
    return merged


def transfer_nodes(workers: Mapping[str, object], pools: Mapping[str, object] = {}) -> frozenset[str] | None:
    """Nodes that can send or receive blocks; None when all of them can (no vLLM node among them).

    Our workers can among themselves; a vLLM node can when it has a connector pool (it fetches into
    it), and the pools themselves can (they serve). A pool's bytes are in vLLM's layout, not our
    engine's, so where pools exist only vLLM nodes take part; a vLLM node without a pool never does.
    """
    if pools:
        return frozenset(pools) | frozenset(n for n in workers if n + POOL_SUFFIX in pools)
    own = frozenset(n for n, w in workers.items() if kind_of(w) == OWN_KIND)
    return None if len(own) == len(workers) else own


def adapters_of(workers: Mapping[str, object]) -> dict[str, list[str]]:
    """LoRA adapter -> the nodes serving it (NodeRecord.adapters: vLLM's --lora-modules names), names sorted."""
    served: dict[str, list[str]] = {}
    for node_id in sorted(workers):
        for adapter in getattr(workers[node_id], "adapters", ()):
            served.setdefault(adapter, []).append(node_id)
    return dict(sorted(served.items()))


def serving(workers: Mapping[str, W], adapter: str | None) -> dict[str, W]:
    """The nodes that can serve a request for `adapter` (None: the base model, which every candidate serves).

    An adapter's KV differs from the base model's and vLLM answers 404 for an adapter it was not
    started with, so a request naming one goes only to nodes that advertise it."""
    if adapter is None:
        return dict(workers)
    return {n: w for n, w in workers.items() if adapter in getattr(w, "adapters", ())}
