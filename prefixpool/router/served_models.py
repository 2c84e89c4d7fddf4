"""The model names a router answers to: its base model, and each LoRA adapter one of its candidates serves.

    "base"                        -> None       every candidate serves it; keys in the base namespace
    an adapter a candidate serves -> "adapter"  only the nodes that advertise it (NodeRecord.adapters);
                                                keys in the adapter's namespace (Namespace.for_request)
    anything else                 -> ModelNotFound (404), naming the models and adapters that exist here,
                                     and the other models registered in the cluster (each is routed by a
                                     router of its own: its KV, hence its keys, differ from ours)

An adapter's KV differs from its base model's (vLLM hashes the LoRA name into
its block hashes), so its blocks never match the base model's: one index
holds both, apart. Knows nothing of HTTP, etcd or policies.
"""

from __future__ import annotations

from typing import Mapping

from prefixpool.router.errors import ModelNotFound
from prefixpool.router.fleet import POOL_KIND, adapters_of, kind_of


def adapter_for(name: str, base: str, candidates: Mapping[str, object], registered: Mapping[str, object]) -> str | None:
    """The adapter a request's `model` names (None: the base model); ModelNotFound when nothing here serves it.

    `candidates`: the nodes this router may route to; `registered`: every node of the cluster."""
    if name == base:
        return None
    served = adapters_of(candidates)
    if name in served:
        return name
    others = sorted({getattr(w, "model", "") for n, w in registered.items()
                     if n not in candidates and kind_of(w) != POOL_KIND} - {base, ""})
    message = (f"model {name!r} does not exist here: this router serves model {base!r} and LoRA adapters "
               f"{sorted(served)} (the adapters its live nodes were started with)")
    if others:
        message += f"; the cluster also has nodes of models {others}, each routed by a router started with its --model"
    raise ModelNotFound(message, param="model", code="model_not_found")


def listing(base: str, candidates: Mapping[str, object]) -> list[dict]:
    """/v1/models' data: the base model, then each adapter with the base as its parent (as vLLM lists them)."""
    models = [{"id": base, "object": "model", "created": 0, "owned_by": "prefixpool", "root": base, "parent": None}]
    for adapter in adapters_of(candidates):
        models.append({"id": adapter, "object": "model", "created": 0, "owned_by": "prefixpool", "root": adapter,
                       "parent": base})
    return models
