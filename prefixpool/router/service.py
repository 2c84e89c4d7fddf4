"""The Router service: prepare a request, choose a worker, stream its answer, retry on failure.

    tokenize(body) the prompt (chat template first) straight into int32 ids
    prepare(body)  tokenize, check model / context / vocabulary, hash the block keys:
                   the only hash of the request (a LoRA adapter's in its own namespace)
    explain(req)   keys -> index.longest_prefix -> policy.choose, with every term
    generate(req)  choose -> POST worker /generate -> events; a worker that fails
                   before streaming anything (unreachable, a 503 while it drains, a 5xx
                   Failed event before the first token) is excluded and the request retried
                   (with the same keys: a retry re-decides, it does not re-hash)

Knows nothing of HTTP servers or etcd: the cluster view (the etcd mirror, or a
plain index in tests and the simulator) and the worker client are given to it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
from dataclasses import dataclass
from itertools import islice
from typing import AsyncIterator, Iterable, Protocol, Sequence

import msgspec
import numpy as np

from prefixpool.router.errors import APIError, InvalidRequest, ServiceUnavailable, Unauthorized
from prefixpool.router.inflight import InflightTracker
from prefixpool.router.metrics import RouterMetrics
from prefixpool.router.openai_schema import ChatBody, CompletionBody, RouteBody, requested_logprobs, requested_tokens
from prefixpool.router.cost_model import CostModel
from prefixpool.router.detokenizer import TokenTexts
from prefixpool.router.policy import NodeLoad, Plan, Policy, RouteRequest, policies, reusable_blocks
from prefixpool.router.conductor import BOTH, ConductorConfig, HandoffCosts, conduct, is_disaggregated
from prefixpool.router.prefill_leg import PrefillLeg
from prefixpool.model.chat_template import ChatTemplateError
from prefixpool.contract.worker_api import Done, Failed, FetchPlan, GenerateRequest, SamplingParams, Token, Usage
from prefixpool.router.fleet import OWN_KIND, admit, kind_of, pools_of, serving, transfer_nodes, with_own_pools
from prefixpool.router.served_models import adapter_for
from prefixpool.router.vllm_pair import VLLM_KIND, is_vllm_pair, pair_stream
from prefixpool.router.worker_client import WorkerClient, WorkerUnreachable
from prefixpool.store.keys import TOKEN_DTYPE, BlockKey, Namespace, chain_from

log = logging.getLogger(__name__)


class WorkerInfo(Protocol):
    node_id: str
    http_url: str
    transfer_url: str
    num_queued: int  # as the worker last reported it: work no router published (direct clients) included
    num_running: int


class ClusterView(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]: ...
    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]: ...
    def workers(self) -> dict[str, WorkerInfo]: ...
    def fleet_share(self, worker: str, exclude: str) -> tuple[int, int]: ...
    def held_blocks(self, node_id: str) -> int: ...
    def fleet_routed(self, keys: Sequence[BlockKey], exclude: str) -> dict[str, int]: ...
    def report_revision(self, node_id: str) -> int: ...
    def num_keys(self) -> int: ...
    def lag_s(self) -> float: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode(self, tokens: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class Prepared:
    request_id: str
    model: str  # as the client named it: the base model or a LoRA adapter (answers carry it back)
    chat: bool
    stream: bool
    include_usage: bool
    ids: np.ndarray  # int32 token ids: hashed here, sent to the worker as these bytes
    keys: list[BlockKey]  # hashed once, in prepare
    sampling: SamplingParams
    cache_salt: str
    adapter: str | None = None  # the LoRA adapter `model` names; None: the base model

    @property
    def tokens(self) -> list[int]:
        """The prompt's ids as a list, made on each call (workers get the packed ids, not this)."""
        return self.ids.tolist()


@dataclass(frozen=True)
class RouterConfig:
    model: str
    namespace: Namespace
    max_context: int
    vocab_size: int
    policy: str = "cost"
    router_id: str = "router"  # names this router's load entry among the fleet's (prefixpool.meta.fleet_load)
    api_key: str = ""
    max_retries: int = 2
    default_max_tokens: int = 64
    conductor: ConductorConfig = ConductorConfig()  # prefill/decode disaggregation (fleets with roles)
    handoff_wait_s: float = 5.0  # a decode node gives up on blocks that stop coming for this long (+ the prediction)


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, view: ClusterView, client: WorkerClient,
                 costs: CostModel, metrics: RouterMetrics | None = None, rng: random.Random | None = None) -> None:
        available = policies()
        if config.policy not in available:
            raise ValueError(f"unknown policy {config.policy!r}; choose from {sorted(available)}")
        self.config = config
        self.model = config.model
        self.tokenizer = tokenizer
        self.view = view
        self.client = client
        self.kind_clients: dict[str, WorkerClient] = {}  # node kind -> its client (e.g. "vllm"); else `client`
        self.costs = costs
        self.metrics = metrics or RouterMetrics()
        self.inflight = InflightTracker()
        self.rng = rng or random.Random(0)
        self._choose: Policy = available[config.policy]
        self.handoffs = HandoffCosts(config.conductor.handoff_setup_s)  # learned per pair kind (the conductor's)
        speculative = getattr(self._choose, "speculative", None)  # pressure's entries: published, and others' read
        if speculative is not None:
            self.inflight.routed = speculative.snapshot
        self._shares_routed = speculative is not None
        self._root = functools.lru_cache(maxsize=4096)(
            lambda salt, adapter: config.namespace.for_request(salt, adapter).root())  # as the vLLM sidecar keys
        self.token_text = TokenTexts(tokenizer.decode)  # each token's own text, for logprobs answers

    # -- requests ------------------------------------------------------------------------------

    def check_api_key(self, authorization: str) -> None:
        if self.config.api_key and authorization != f"Bearer {self.config.api_key}":
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def prepare(self, body: CompletionBody | ChatBody | RouteBody, ids: np.ndarray | None = None) -> Prepared:
        """A checked, hashed request; `ids` are its tokenize(body) when the caller already has them."""
        adapter = None if body.model == self.model else adapter_for(body.model, self.model, self.live_workers(),
                                                                     self.view.workers())
        if ids is None:
            ids = self.tokenize(body)
        max_tokens = requested_tokens(body, self.config.default_max_tokens)
        if len(ids) + max_tokens > self.config.max_context:
            raise InvalidRequest(
                f"this model's maximum context length is {self.config.max_context} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {max_tokens}", param="max_tokens", code="context_length_exceeded")
        if (top := int(ids.max())) >= self.config.vocab_size:
            raise InvalidRequest(f"token id {top} is outside the vocabulary ({self.config.vocab_size})", param="prompt")
        keys = chain_from(self._root(body.cache_salt, adapter), ids, self.config.namespace.block_size)  # reads ids
        options = getattr(body, "stream_options", None)
        return Prepared(  # the id: a uuid4's randomness, without building a UUID
            request_id=f"{'chatcmpl' if isinstance(body, ChatBody) else 'cmpl'}-{os.urandom(16).hex()}",
            model=body.model, adapter=adapter, chat=isinstance(body, ChatBody), stream=getattr(body, "stream", False),
            include_usage=bool(options and options.include_usage), ids=ids, keys=keys, cache_salt=body.cache_salt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=getattr(body, "temperature", 0.0),
                                    top_p=getattr(body, "top_p", 1.0), seed=getattr(body, "seed", None),
                                    ignore_eos=getattr(body, "ignore_eos", False), logprobs=requested_logprobs(body)),
        )

    def tokenize(self, body: CompletionBody | ChatBody | RouteBody) -> np.ndarray:
        """The prompt as little-endian int32 ids: what the block hash reads, made once."""
        messages = getattr(body, "messages", None)
        if messages is not None:
            try:
                text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
            except ChatTemplateError as err:
                raise InvalidRequest(str(err), param="messages") from err
            ids = self.tokenizer.encode_array(text)
        elif isinstance(body.prompt, str):
            ids = self.tokenizer.encode_array(body.prompt)
        elif body.prompt and isinstance(body.prompt[0], str):
            ids = self.tokenizer.encode_array(body.prompt[0])
        else:
            ids = np.array(body.prompt, dtype=TOKEN_DTYPE)  # ids are checked to fit int32 when decoded
        if not len(ids):
            raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
        return ids

    # -- routing -------------------------------------------------------------------------------

    def live_workers(self) -> dict[str, WorkerInfo]:
        return admit(self.view.workers(), self.config.namespace)[0]

    def refused_workers(self) -> dict[str, str]:
        """Registered nodes of another namespace, with the reason they are never chosen."""
        return admit(self.view.workers(), self.config.namespace)[1]

    def decide(self, prepared: Prepared, exclude: frozenset[str] = frozenset(),
               explain: bool = False) -> tuple[Plan, dict[str, int]]:
        live = {n: w for n, w in self.live_workers().items() if n not in exclude}
        workers = serving(live, prepared.adapter)
        if live and not workers:
            raise ServiceUnavailable(f"no live node serves LoRA adapter {prepared.adapter!r} now; retry later",
                                     code="no_worker")
        if not workers:
            refused = self.refused_workers()
            if refused:
                raise ServiceUnavailable("no live worker in this router's namespace; refusing to route across "
                                         "namespaces: " + "; ".join(refused.values()), code="namespace_mismatch")
            raise ServiceUnavailable("no live worker can take this request; retry later", code="no_worker")
        keys = prepared.keys
        pools = pools_of(self.view.workers(), self.config.namespace)
        matches = {n: m for n, m in self.view.longest_prefix(keys).items() if n in workers or n in pools}
        matches = with_own_pools(matches, workers)
        if self._shares_routed:  # what other routers just sent to a node counts as held there, as our own does
            for node_id, num in self.view.fleet_routed(keys, self.config.router_id).items():
                if node_id in workers and num > matches.get(node_id, 0):
                    matches[node_id] = num
        loads = {n: self._load(n, w) for n, w in workers.items()}
        request = RouteRequest(len(prepared.ids), len(keys), self._lower_tiers(keys, matches),
                               transfer_nodes(workers, pools), keys)
        roles = {n: getattr(w, "role", BOTH) for n, w in workers.items()}
        if is_disaggregated(roles):  # prefill and decode nodes: the conductor pairs them, or serves in place
            kinds = {n: kind_of(w) for n, w in workers.items()}
            return conduct(request, matches, roles, loads, self.costs, self.config.conductor, explain=explain,
                           kinds=kinds, handoffs=self.handoffs), matches
        return self._choose(request, matches, loads, self.costs, self.rng, explain=explain), matches

    def _lower_tiers(self, keys: list[BlockKey], matches: dict[str, int]) -> dict[str, dict[str, int]]:
        """Per node, how many blocks of its matched prefix sit in each tier below the device."""
        lower = {node_id: self.view.lower_tiers(node_id, islice(keys, num)) for node_id, num in matches.items()}
        return {node_id: counts for node_id, counts in lower.items() if counts}

    def _load(self, node_id: str, worker: WorkerInfo) -> NodeLoad:
        """Our own live in-flight work plus what every other router last published for this worker.

        The worker's own count, where larger, covers work that no router published (clients
        calling it directly). It counts only when etcd ordered it after our latest end on that
        worker (prefixpool.meta.load_publisher): an older report may still hold our finished requests.
        """
        own = self.inflight.load_of(node_id)
        requests, queued_tokens = self.view.fleet_share(node_id, self.config.router_id)
        requests += own.num_running + own.num_queued
        published = own.published_revision
        if published is not None and self.view.report_revision(node_id) > published:
            requests = max(requests, worker.num_running + worker.num_queued)
        return NodeLoad(queued_prefill_tokens=own.queued_prefill_tokens + queued_tokens, num_running=requests,
                        free_blocks=self._free_blocks(node_id, worker))

    def _free_blocks(self, node_id: str, worker: WorkerInfo) -> int | None:
        """Cache blocks of the node that hold no block the index names (None: the node does not say its size)."""
        num_blocks = getattr(worker, "num_blocks", 0)
        return max(0, num_blocks - self.view.held_blocks(node_id)) if num_blocks else None

    def explain(self, prepared: Prepared) -> dict:
        plan, matches = self.decide(prepared, explain=True)
        loads = {n: self._load(n, w) for n, w in self.live_workers().items()}
        return {"num_prompt_tokens": len(prepared.ids), "num_blocks": len(prepared.keys),
                "policy": self.config.policy, "adapter": prepared.adapter, "matches": matches,
                "lower_tiers": self._lower_tiers(prepared.keys, matches),
                "loads": {n: {"requests": load.num_running, "queued_prefill_tokens": load.queued_prefill_tokens}
                          for n, load in loads.items()},
                "kinds": {n: kind_of(w) for n, w in self.live_workers().items()}, "refused": self.refused_workers(),
                "roles": {n: getattr(w, "role", BOTH) for n, w in self.live_workers().items()},
                "prefill": None, "decode": None,  # a disaggregated fleet's plan names both (PDPlan.explain)
                **plan.explain()}

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prepared: Prepared) -> AsyncIterator[Token | Done | Failed]:
        """Events of the answer; before the first token, failures are retried on other workers."""
        excluded: set[str] = set()
        refused: Failed | None = None  # a worker's 5xx before the first token: shown only if no other worker answers
        emitted: list[int] = []  # tokens already sent to the client: a greedy stream cut mid-way resumes after them
        start = time.perf_counter()
        for attempt in range(self.config.max_retries + 1):
            try:
                plan, matches = self.decide(prepared, frozenset(excluded))
                if not attempt:
                    self.metrics.decide_s.observe(time.perf_counter() - start)
            except ServiceUnavailable:
                if refused is None:
                    raise
                yield refused
                return
            worker = self.live_workers()[plan.worker]
            ticket = self.inflight.begin(plan.worker, plan.prefill_tokens)
            streamed = False
            leg = self._start_prefill(prepared, plan, worker, emitted)
            handed: Usage | None = None  # the decode node's usage after a handoff of our workers
            try:
                client = self.kind_clients.get(kind_of(worker), self.client)
                stream = self._stream(client, worker, plan, self._worker_request(prepared, plan, emitted))
                async with contextlib.aclosing(stream):  # a client gone closes the worker's stream now
                    async for event in stream:
                        if isinstance(event, Failed) and not streamed and event.status >= 500:
                            refused = event
                            raise WorkerUnreachable(f"failed before the first token: {event.message}")
                        ttft_s = None
                        if isinstance(event, Token):
                            if not streamed and not emitted:
                                first_at = time.perf_counter()
                                ttft_s = first_at - start
                            streamed = True
                            emitted.append(event.token)
                        if isinstance(event, Done):
                            event = _resumed_usage(event, len(emitted) - event.usage.completion_tokens)
                            self._observe(prepared, plan, event.usage, max(matches.values(), default=0))
                            if leg is not None:
                                self.metrics.observe_handoff(event.usage.fetched_bytes, event.usage.handoff_s)
                                handed = event.usage
                        yield event
                        if ttft_s is not None:  # once the first token has left: its bookkeeping is not on its path
                            if prepared.stream:  # (its frame was written before this generator went on)
                                self.metrics.relay_s.observe(time.perf_counter() - first_at)
                            self.inflight.started(ticket)
                            self.metrics.ttft.observe(ttft_s)
                return
            except WorkerUnreachable as err:
                log.warning("worker %s failed: %s", plan.worker, err)
                if streamed and not _resumable(prepared, emitted):
                    yield Failed(f"worker {plan.worker} failed mid-stream: {err}", 502)
                    return
                excluded.add(plan.worker)
                self.metrics.retries.inc()
            finally:
                self.inflight.end(ticket)
                if leg is not None:
                    await leg.close()  # a prefill node never keeps a finished request's blocks
                    if handed is not None:
                        self._learn_handoff(plan, handed, leg.ttft_s)
        if refused is not None:
            yield refused
            return
        raise ServiceUnavailable(f"no worker answered after {len(excluded)} attempts", code="workers_failed")

    def _stream(self, client: WorkerClient, worker: WorkerInfo, plan: Plan,
                request: GenerateRequest) -> AsyncIterator[Token | Done | Failed]:
        """The streaming node's events; a vLLM prefill/decode pair first runs the prompt on its prefill server."""
        prefill = getattr(plan, "prefill", None)  # a conductor's PDPlan: the prefill node's Plan (None: in place)
        node = self.live_workers().get(prefill.worker) if prefill is not None else None
        if node is not None and is_vllm_pair(kind_of(node), kind_of(worker)):
            self.metrics.handoffs.inc()  # the bytes and wait are the connectors' (their logs, vLLM's counters)
            return pair_stream(client, node.http_url, worker.http_url, request,
                               functools.partial(self._learn_vllm_handoff, plan))
        return client.generate(worker.http_url, request)

    def _learn_handoff(self, plan: Plan, usage: Usage, prefill_ttft_s: float | None) -> None:
        """Our workers' completed handoff (every planned block received, the prefill node's own time known):
        the decode node's wait beyond the prefill node's queue + compute (measured there) and the priced exposed
        transfer. Measured, not predicted, prefill: a mispriced prompt must not hide (or inflate) the setup."""
        terms = getattr(plan, "terms", None)
        planned = (plan.fetch_end - plan.fetch_start) * self.config.namespace.block_size
        if terms is None or prefill_ttft_s is None or usage.handoff_s <= 0 or usage.fetched_tokens < planned:
            return  # a handoff that failed or stalled (the decode node computed the rest): a fault, not its cost
        self.handoffs.observe(OWN_KIND, usage.handoff_s - prefill_ttft_s - terms.exposed_transfer_s)

    def _learn_vllm_handoff(self, plan: Plan, round_trip_s: float) -> None:
        """A vLLM pair's prefill answered: its round trip beyond the predicted queue + prefill."""
        terms = getattr(plan, "terms", None)
        if terms is not None:
            self.handoffs.observe(VLLM_KIND, round_trip_s - (terms.queue_s + terms.prefill_s))

    def _observe(self, prepared: Prepared, plan: Plan, u: Usage, held_blocks: int) -> None:
        """`held_blocks`: the longest prefix of this prompt any candidate held when it was routed."""
        self.metrics.observe_usage(u.prompt_tokens, u.cached_tokens, u.fetched_tokens, u.fetched_bytes)
        block_size = self.config.namespace.block_size
        planned, cached = plan.hit_blocks(u.prompt_tokens, block_size), u.cached_tokens // block_size
        if cached < planned:  # the index named blocks the worker no longer had (or never took)
            log.info("missed hit: %s planned %d blocks on %s, it reused %d; first missed key %s",
                     prepared.request_id, planned, plan.worker, cached, prepared.keys[cached].hex())
        self.metrics.observe_plan(planned, cached, min(held_blocks, reusable_blocks(u.prompt_tokens, block_size)))

    def _start_prefill(self, prepared: Prepared, plan: Plan, worker: WorkerInfo,
                       emitted: list[int]) -> PrefillLeg | None:
        """Our workers' handoff: the prefill node's request, sent now beside the decode node's (None in place)."""
        prefill = getattr(plan, "prefill", None)
        node = self.live_workers().get(prefill.worker) if prefill is not None else None
        if node is None or kind_of(node) != OWN_KIND or kind_of(worker) != OWN_KIND:
            return None  # in place, the prefill node gone, or a vLLM pair (its connector hands off)
        request = msgspec.structs.replace(self._worker_request(prepared, prefill, emitted),
                                          request_id=prepared.request_id + "-prefill",
                                          sampling=SamplingParams(max_tokens=1))
        ticket = self.inflight.begin(prefill.worker, prefill.prefill_tokens)
        self.metrics.handoffs.inc()
        return PrefillLeg.start(self.client, node.http_url, request, lambda: self.inflight.end(ticket))

    def _worker_request(self, prepared: Prepared, plan: Plan, emitted: list[int]) -> GenerateRequest:
        """The request for one attempt; a resumed one asks for the rest after the tokens already emitted."""
        fetch = None
        if plan.fetch_from is not None:
            peer = self.live_workers().get(plan.fetch_from)
            if peer is not None:
                fetch = FetchPlan(plan.fetch_from, peer.transfer_url, plan.fetch_start, plan.fetch_end,
                                  self._handoff_wait_s(plan))
        sampling = prepared.sampling
        if emitted:
            sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(emitted))
        return GenerateRequest(
            request_id=prepared.request_id, tokens=_packed(prepared.ids, emitted), sampling=sampling,
            cache_salt=prepared.cache_salt, fetch=fetch, adapter=prepared.adapter or "",
        )

    def _handoff_wait_s(self, plan: Plan) -> float:
        """0 for a plain fetch; for a handoff, how long the decode node waits for blocks that stop coming."""
        prefill = getattr(plan, "prefill", None)
        return 0.0 if prefill is None else self.config.handoff_wait_s + 2 * prefill.predicted_ttft_s

    def failure(self, event: Failed) -> APIError:
        """A worker's 4xx (a request no worker can ever serve) stays a 4xx; anything else is a 503."""
        if 400 <= event.status < 500:
            error = InvalidRequest(event.message, code="unservable_request")
            error.status = event.status
            return error
        return ServiceUnavailable(event.message, code="worker_failed")

    def refresh_gauges(self) -> None:
        workers = self.live_workers()
        self.metrics.workers.set(len(workers))
        self.metrics.index_keys.set(self.view.num_keys())
        self.metrics.mirror_lag.set(self.view.lag_s())
        by_role: dict[str, int] = {}
        for node_id, worker in workers.items():
            load = self.inflight.load_of(node_id)
            self.metrics.inflight.labels(node_id).set(load.num_queued + load.num_running)
            self.metrics.queued_tokens.labels(node_id).set(load.queued_prefill_tokens)
            role = getattr(worker, "role", BOTH)
            by_role[role] = by_role.get(role, 0) + load.num_queued + load.num_running
        for role, count in by_role.items():
            self.metrics.role_inflight.labels(role).set(count)


def _packed(ids: np.ndarray, emitted: list[int]) -> bytes:
    """The prompt (and tokens already emitted, on a resume) as the packed int32 ids workers take."""
    return ids.tobytes() + np.array(emitted, dtype=TOKEN_DTYPE).tobytes() if emitted else ids.tobytes()


def _resumable(prepared: Prepared, emitted: list[int]) -> bool:
    """A stream cut mid-way can resume on another worker when its continuation is determined: greedy
    (reuse equals recompute, token for token, on every worker) and tokens still to come."""
    return prepared.sampling.temperature == 0 and len(emitted) < prepared.sampling.max_tokens


def _resumed_usage(done: Done, num_resumed: int) -> Done:
    """Usage as the client asked: tokens emitted before a resume were completion, not prompt."""
    if num_resumed <= 0:
        return done
    usage = msgspec.structs.replace(done.usage, prompt_tokens=done.usage.prompt_tokens - num_resumed,
                                    completion_tokens=done.usage.completion_tokens + num_resumed)
    return msgspec.structs.replace(done, usage=usage)
