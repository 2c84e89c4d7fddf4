"""A disaggregated request on two vLLM servers: the prompt on the prefill server, the answer from the decode server.

    conductor's plan: prefill node P, decode node D (both vLLM nodes with the KV connector)
        VllmClient.prefill(P, request)    max_tokens 1; P's connector saves the prompt's full blocks into P's
                                          pool as vLLM computes them and answers {pool, blocks} (kv_transfer_params)
        VllmClient.generate(D, request, those params)
                                          D's connector loads the blocks from P's pool (in the background,
                                          checksummed), computes the partial last block, decodes, streams

The prefill is a hint, never a dependency: P unreachable, failing, or not
answering params leaves D computing the prompt itself (vLLM's own answer, only
slower); a block that does not arrive is recomputed by D (kv_load_failure_policy
recompute). The router sees D's stream as any node's, so a D that dies mid-stream
resumes elsewhere as today. Knows nothing of policies or etcd.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Callable, Protocol

from prefixpool.contract.worker_api import Event, GenerateRequest

log = logging.getLogger(__name__)
VLLM_KIND = "vllm"  # NodeRecord.kind of a vLLM node (prefixpool/vllm_sidecar/node.py)


class PairClient(Protocol):  # prefixpool.router.vllm_client.VllmClient
    async def prefill(self, vllm_url: str, request: GenerateRequest) -> dict | None: ...
    def generate(self, vllm_url: str, request: GenerateRequest,
                 kv_transfer_params: dict | None = None) -> AsyncIterator[Event]: ...


def is_vllm_pair(prefill_kind: str | None, decode_kind: str) -> bool:
    """Whether a disaggregated plan runs on two vLLM servers (the connector moves their KV)."""
    return prefill_kind == VLLM_KIND and decode_kind == VLLM_KIND


async def pair_stream(client: PairClient, prefill_url: str, decode_url: str, request: GenerateRequest,
                      on_prefilled: Callable[[float], None] | None = None) -> AsyncIterator[Event]:
    """D's events for `request`, after P computed its prompt (see the module doc). `on_prefilled` gets the
    prefill request's round trip in seconds when P answered where its blocks are (the router learns from it)."""
    start = time.perf_counter()
    params = await client.prefill(prefill_url, request)
    round_trip = time.perf_counter() - start
    log.info("prefill on %s for %s: %.3fs, handoff %s", prefill_url, request.request_id, round_trip, params)
    if params is not None and on_prefilled is not None:
        on_prefilled(round_trip)
    async with contextlib.aclosing(client.generate(decode_url, request, params)) as stream:
        async for event in stream:
            yield event
