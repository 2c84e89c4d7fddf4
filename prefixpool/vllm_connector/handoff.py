"""The prefill-to-decode handoff between two vLLM servers, carried in vLLM's per-request `kv_transfer_params`.

    router ─▶ prefill server (kv_producer): the prompt, max_tokens 1, stream off,
              kv_transfer_params {"do_remote_decode": true}
        its connector saves every full prompt block into its pool as vLLM computes it (chunk by chunk),
        and request_finished answers Handoff(pool "<node>.pool", num_blocks saved).params(),
        which vLLM returns as the completion's `kv_transfer_params`
    router ─▶ decode server (kv_consumer): the whole request, kv_transfer_params = that answer
        its connector plans keys[:num_blocks] from that pool at once, without waiting for etcd to name
        them, fetches them in the background (checksummed, under a deadline) and decodes

The partial last block (and always the prompt's last token) is computed by the
decode server: only full blocks have keys, and fewer than a block of tokens
costs less to compute than a round trip. The handoff is a hint like every
plan: the prefill pool sends the longest prefix it still holds, and the decode
server recomputes whatever did not arrive (a dead prefill server, a failed
transfer), so an answer is never wrong, only slower. Knows nothing of vLLM's classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

ASK = "do_remote_decode"  # vLLM's own key: this request's KV is wanted by another server
POOL = "prefixpool_pool"
NUM_BLOCKS = "prefixpool_num_blocks"


@dataclass(frozen=True)
class Handoff:
    pool: str  # the pool node that holds the prompt's blocks ("<prefill node>.pool")
    num_blocks: int  # full prompt blocks saved there, from the first

    def params(self) -> dict[str, Any]:
        return {POOL: self.pool, NUM_BLOCKS: self.num_blocks}


def asks_for_handoff(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's kv_transfer_params ask the prefill server to hand its KV on."""
    return isinstance(params, Mapping) and params.get(ASK) is True


def handoff_of(params: Mapping[str, Any] | None) -> Handoff | None:
    """The handoff a decode request carries; None for none or anything malformed (the request computes)."""
    if not isinstance(params, Mapping):
        return None
    pool, num_blocks = params.get(POOL), params.get(NUM_BLOCKS)
    if not isinstance(pool, str) or not pool or type(num_blocks) is not int or num_blocks <= 0:
        return None
    return Handoff(pool, num_blocks)


def prefill_params() -> dict[str, Any]:
    """What the router sends a prefill server with the prompt."""
    return {ASK: True}
