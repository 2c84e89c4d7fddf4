"""Admin pinning through the router: POST / DELETE /v1/admin/pin, forwarded to workers.

    {"text" | "tokens", "cache_salt", "ttl_s", "scope": "all" | "holders", "name"}
      -> tokens (the router's tokenizer) -> PinRequest to each target worker
      -> {"name", "num_blocks", "workers": {node: {"num_held", ...} | {"error"}}}

scope "all" (the default) pins on every live worker: one that holds the
prefix keeps it, one that computes it later keeps it from then on. scope
"holders" pins only where the index says the prefix's first block lives
(all workers when none holds it yet). Knows nothing of HTTP servers or etcd.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec

from prefixpool.router.errors import InvalidField, InvalidRequest, ServiceUnavailable
from prefixpool.contract.worker_api import PinRequest
from prefixpool.router.worker_client import WorkerUnreachable
from prefixpool.store.keys import chain

TTL = Annotated[float, msgspec.Meta(gt=0, le=30 * 24 * 3600)]


class AdminPinBody(msgspec.Struct, frozen=True, kw_only=True):
    text: str = ""
    tokens: list[int] = []  # checked against the vocabulary in forward_pin: a 400, as in completions
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] = ""
    ttl_s: TTL = 300.0
    scope: Literal["all", "holders"] = "all"
    name: Annotated[str, msgspec.Meta(max_length=256)] = ""


def decode_pin(raw: bytes) -> AdminPinBody:
    try:
        body = msgspec.json.decode(raw, type=AdminPinBody)
    except msgspec.ValidationError as err:
        raise InvalidField(str(err), code="invalid_type") from None
    except msgspec.DecodeError as err:
        raise InvalidRequest(f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not body.text and not body.tokens and not body.name:
        raise InvalidRequest("give the prefix as text or tokens", param="text")
    return body


async def forward_pin(router, body: AdminPinBody, unpin: bool) -> dict:
    """Send the pin (or unpin) to the target workers at once; per-worker replies or errors."""
    tokens = body.tokens or (router.tokenizer.encode(body.text) if body.text else [])
    vocab_size = router.config.vocab_size
    if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
        raise InvalidRequest(f"token ids must be in the vocabulary [0, {vocab_size})", param="tokens")
    keys = chain(tokens, router.config.namespace.with_salt(body.cache_salt))
    if tokens and not keys:
        raise InvalidRequest(f"the prefix has {len(tokens)} tokens: less than one block", param="text")
    workers = router.live_workers()
    if not workers:
        raise ServiceUnavailable("no live worker to pin on", code="no_worker")
    targets = dict(workers)
    if body.scope == "holders" and keys:
        holders = {n for n, m in router.view.longest_prefix(keys).items() if m > 0}
        targets = {n: w for n, w in workers.items() if n in holders} or targets
    request = PinRequest(tokens=tokens, cache_salt=body.cache_salt, ttl_s=body.ttl_s, name=body.name)
    replies = await asyncio.gather(*(_one(router.client, w.http_url, request, unpin) for w in targets.values()))
    return {"name": body.name or (keys[-1].hex() if keys else ""), "num_blocks": len(keys),
            "workers": dict(zip(targets, replies))}


async def _one(client, url: str, request: PinRequest, unpin: bool) -> dict:
    try:
        return msgspec.structs.asdict(await client.pin(url, request, unpin))
    except WorkerUnreachable as err:
        return {"error": str(err)}
