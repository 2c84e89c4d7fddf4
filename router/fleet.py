"""Which registered nodes this router may route to: those that hash blocks under its namespace.

    node record namespace == router's   -> a candidate (our worker or a vLLM node alike)
    node record namespace == ""         -> a candidate (a node that does not say: trusted as before)
    anything else                       -> refused, with the reason, so /v1/route and the 503 say why

A vLLM node and one of our workers may serve the same cluster only when they
hash the same model, dtype and block size; otherwise their keys could never
match ours and routing on them would be blind. Also: which nodes can take
part in a block transfer (vLLM nodes read only their own cache). Knows
nothing of HTTP, etcd or policies.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

from store.keys import Namespace

W = TypeVar("W")
OWN_KIND = "prefixpool"


def kind_of(worker: object) -> str:
    return getattr(worker, "kind", OWN_KIND)


def admit(workers: Mapping[str, W], namespace: Namespace) -> tuple[dict[str, W], dict[str, str]]:
    """(candidates, refused node -> reason)."""
    ours = namespace.root().hex()
    candidates: dict[str, W] = {}
    refused: dict[str, str] = {}
    for node_id, worker in workers.items():
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


def transfer_nodes(workers: Mapping[str, object]) -> frozenset[str] | None:
    """Nodes that can send or receive blocks; None when all of them can (no vLLM node among them)."""
    own = frozenset(n for n, w in workers.items() if kind_of(w) == OWN_KIND)
    return None if len(own) == len(workers) else own
