"""The Router service: prepare a request, choose a worker, stream its answer, retry on failure.

    prepare(body)  tokenize (chat template first), check model / context / salt
    explain(req)   keys -> index.longest_prefix -> policy.choose, with every term
    generate(req)  choose -> POST worker /generate -> events; a worker that fails
                   before streaming anything (unreachable, a 503 while it drains, a 5xx
                   Failed event before the first token) is excluded and the request retried

Knows nothing of HTTP servers or etcd: the cluster view (the etcd mirror, or a
plain index in tests and the simulator) and the worker client are given to it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence

from router.errors import APIError, InvalidRequest, ModelNotFound, ServiceUnavailable, Unauthorized
from router.inflight import InflightTracker
from router.metrics import RouterMetrics
from router.openai_schema import ChatBody, CompletionBody, RouteBody, requested_tokens
from router.cost_model import CostModel
from store.tier_names import DEVICE
from router.policy import NodeLoad, Plan, RouteRequest, policies
from router.contract.chat_template import ChatTemplateError
from router.contract.worker_api import Done, Failed, FetchPlan, GenerateRequest, SamplingParams, Token
from router.worker_client import WorkerClient, WorkerUnreachable
from store.keys import BlockKey, Namespace, chain

log = logging.getLogger(__name__)


class WorkerInfo(Protocol):
    node_id: str
    http_url: str
    transfer_url: str
    num_queued: int  # as the worker last reported it (other routers' work included)
    num_running: int
    load_time: float  # when it sampled them (time.time())


class ClusterView(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]: ...
    def tier_of(self, node_id: str, key: BlockKey) -> str | None: ...
    def workers(self) -> dict[str, WorkerInfo]: ...
    def num_keys(self) -> int: ...
    def lag_s(self) -> float: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class Prepared:
    request_id: str
    model: str
    chat: bool
    stream: bool
    include_usage: bool
    tokens: list[int]
    sampling: SamplingParams
    cache_salt: str


@dataclass(frozen=True)
class RouterConfig:
    model: str
    namespace: Namespace
    max_context: int
    vocab_size: int
    policy: str = "cost"
    api_key: str = ""
    max_retries: int = 2
    default_max_tokens: int = 64


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
        self.costs = costs
        self.metrics = metrics or RouterMetrics()
        self.inflight = InflightTracker()
        self.rng = rng or random.Random(0)
        self._choose: Callable[..., Plan] = available[config.policy]

    # -- requests ------------------------------------------------------------------------------

    def check_api_key(self, authorization: str) -> None:
        if self.config.api_key and authorization != f"Bearer {self.config.api_key}":
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def prepare(self, body: CompletionBody | ChatBody | RouteBody) -> Prepared:
        if body.model != self.model:
            raise ModelNotFound(f"model {body.model!r} does not exist; this router serves {self.model!r}",
                                param="model", code="model_not_found")
        tokens = self._tokens_of(body)
        max_tokens = requested_tokens(body, self.config.default_max_tokens)
        if len(tokens) + max_tokens > self.config.max_context:
            raise InvalidRequest(
                f"this model's maximum context length is {self.config.max_context} tokens; the prompt has "
                f"{len(tokens)} and max_tokens asks for {max_tokens}", param="max_tokens", code="context_length_exceeded")
        if max(tokens) >= self.config.vocab_size:
            raise InvalidRequest(f"token id {max(tokens)} is outside the vocabulary ({self.config.vocab_size})", param="prompt")
        options = getattr(body, "stream_options", None)
        return Prepared(
            request_id=f"{'chatcmpl' if isinstance(body, ChatBody) else 'cmpl'}-{uuid.uuid4().hex}",
            model=self.model, chat=isinstance(body, ChatBody), stream=getattr(body, "stream", False),
            include_usage=bool(options and options.include_usage), tokens=tokens, cache_salt=body.cache_salt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=getattr(body, "temperature", 0.0),
                                    top_p=getattr(body, "top_p", 1.0), seed=getattr(body, "seed", None),
                                    ignore_eos=getattr(body, "ignore_eos", False)),
        )

    def _tokens_of(self, body: CompletionBody | ChatBody | RouteBody) -> list[int]:
        messages = getattr(body, "messages", None)
        if messages is not None:
            try:
                text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
            except ChatTemplateError as err:
                raise InvalidRequest(str(err), param="messages") from err
            tokens = self.tokenizer.encode(text)
        elif isinstance(body.prompt, str):
            tokens = self.tokenizer.encode(body.prompt)
        elif body.prompt and isinstance(body.prompt[0], str):
            tokens = self.tokenizer.encode(body.prompt[0])
        else:
            tokens = list(body.prompt)
        if not tokens:
            raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
        return tokens

    # -- routing -------------------------------------------------------------------------------

    def keys_of(self, prepared: Prepared) -> list[BlockKey]:
        return chain(prepared.tokens, self.config.namespace.with_salt(prepared.cache_salt))

    def live_workers(self) -> dict[str, WorkerInfo]:
        return self.view.workers()

    def decide(self, prepared: Prepared, exclude: frozenset[str] = frozenset()) -> tuple[Plan, dict[str, int]]:
        workers = {n: w for n, w in self.live_workers().items() if n not in exclude}
        if not workers:
            raise ServiceUnavailable("no live worker can take this request; retry later", code="no_worker")
        keys = self.keys_of(prepared)
        matches = {n: m for n, m in self.view.longest_prefix(keys).items() if n in workers}
        loads = {n: self._load(n, w) for n, w in workers.items()}
        request = RouteRequest(len(prepared.tokens), len(keys), self._lower_tiers(keys, matches))
        return self._choose(request, matches, loads, self.costs, self.rng), matches

    def _lower_tiers(self, keys: list[BlockKey], matches: dict[str, int]) -> dict[str, dict[str, int]]:
        """Per node, how many blocks of its matched prefix sit in each tier below the device."""
        lower: dict[str, dict[str, int]] = {}
        for node_id, num in matches.items():
            for key in keys[:num]:
                tier = self.view.tier_of(node_id, key)
                if tier is not None and tier != DEVICE:
                    counts = lower.setdefault(node_id, {})
                    counts[tier] = counts.get(tier, 0) + 1
        return lower

    def _load(self, node_id: str, worker: WorkerInfo) -> NodeLoad:
        """Our own in-flight work, or the worker's report where that is larger (other routers' work).

        A report sampled before our latest start or end on that worker is stale: ignore it.
        """
        inflight = self.inflight.load_of(node_id)
        fresh = worker.load_time > inflight.changed_at
        reported = worker.num_running + worker.num_queued if fresh else 0
        return NodeLoad(queued_prefill_tokens=inflight.queued_prefill_tokens,
                        num_running=max(inflight.num_running + inflight.num_queued, reported))

    def explain(self, prepared: Prepared) -> dict:
        plan, matches = self.decide(prepared)
        keys = self.keys_of(prepared)
        return {"num_prompt_tokens": len(prepared.tokens), "num_blocks": len(keys),
                "policy": self.config.policy, "matches": matches, "lower_tiers": self._lower_tiers(keys, matches),
                **plan.explain()}

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prepared: Prepared) -> AsyncIterator[Token | Done | Failed]:
        """Events of the answer; before the first token, failures are retried on other workers."""
        excluded: set[str] = set()
        refused: Failed | None = None  # a worker's 5xx before the first token: shown only if no other worker answers
        start = time.perf_counter()
        for _ in range(self.config.max_retries + 1):
            try:
                plan, _ = self.decide(prepared, frozenset(excluded))
            except ServiceUnavailable:
                if refused is None:
                    raise
                yield refused
                return
            worker = self.live_workers()[plan.worker]
            ticket = self.inflight.begin(plan.worker, plan.prefill_tokens)
            streamed = False
            try:
                stream = self.client.generate(worker.http_url, self._worker_request(prepared, plan))
                async with contextlib.aclosing(stream):  # a client gone closes the worker's stream now
                    async for event in stream:
                        if isinstance(event, Failed) and not streamed and event.status >= 500:
                            refused = event
                            raise WorkerUnreachable(f"failed before the first token: {event.message}")
                        if isinstance(event, Token) and not streamed:
                            streamed = True
                            self.inflight.started(ticket)
                            self.metrics.ttft.observe(time.perf_counter() - start)
                        if isinstance(event, Done):
                            u = event.usage
                            self.metrics.observe_usage(u.prompt_tokens, u.cached_tokens, u.fetched_tokens, u.fetched_bytes)
                        yield event
                return
            except WorkerUnreachable as err:
                log.warning("worker %s failed: %s", plan.worker, err)
                if streamed:
                    yield Failed(f"worker {plan.worker} failed mid-stream: {err}", 502)
                    return
                excluded.add(plan.worker)
                self.metrics.retries.inc()
            finally:
                self.inflight.end(ticket)
        if refused is not None:
            yield refused
            return
        raise ServiceUnavailable(f"no worker answered after {len(excluded)} attempts", code="workers_failed")

    def _worker_request(self, prepared: Prepared, plan: Plan) -> GenerateRequest:
        fetch = None
        if plan.fetch_from is not None:
            peer = self.live_workers().get(plan.fetch_from)
            if peer is not None:
                fetch = FetchPlan(plan.fetch_from, peer.transfer_url, plan.fetch_start, plan.fetch_end)
        return GenerateRequest(
            request_id=prepared.request_id, tokens=prepared.tokens, sampling=prepared.sampling,
            cache_salt=prepared.cache_salt, fetch=fetch,
        )

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
        for node_id in workers:
            load = self.inflight.load_of(node_id)
            self.metrics.inflight.labels(node_id).set(load.num_queued + load.num_running)
            self.metrics.queued_tokens.labels(node_id).set(load.queued_prefill_tokens)
