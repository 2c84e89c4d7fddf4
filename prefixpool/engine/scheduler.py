"""The engine: admits requests onto cached blocks, batches their steps, samples, frees.

    submit ─▶ waiting (FIFO) ──admit: acquire the cached prefix, allocate the rest──▶ running
              (a request submitted `deferred` keeps its place but is passed over until `resume`:
               its blocks are still arriving from a peer while it queues)
    step = schedule()  block ops: admission; picks each running request's next span
           forward()   tensor work only (may run in a thread while the caller uses the blocks);
                       a span that makes it fail fails alone (prefixpool/engine/isolation.py)
           finish()    block ops: commit newly full blocks, sample, release finished requests;
                       a request whose span or sampling failed is released and listed by take_failed
           (fail(batch) instead of finish when forward raised anyway: the batch's requests are dropped)

One step carries every decoding request's next token plus prefill chunks,
within `chunk_size` tokens (decodes always go; chunked prefill fills the
rest), so a long prompt never stalls the others' decode. Prefill starts after
the cached prefix and attends to the cached K,V. A prompt whose every block
is cached still runs its last token through the model, query-only, for the
logits; that token counts as computed, not cached.

Admission reserves blocks for prompt + max_tokens - 1 positions up front, so a
running request never runs out mid-way and nothing is preempted; a request
that does not fit now waits at the head of the queue, one that can never fit
is refused at submit. Each admitted request holds its blocks through one
`Hold` of the node's blocks (prefixpool/store/node_blocks.py, which demotes what an
allocation evicts when the node has lower tiers). Under minimum residency an
allocation can fail although enough blocks are free: the request waits for the
next step, never for ever, since residency ends. Knows nothing of HTTP, etcd,
tiers or transfers: it reports the keys it stored and evicted through
`take_pool_events`, with chain *tails* for run-granular publication (prefixpool/meta/runs.py).

A request's tail is named once, when its chain stops growing: when it is released (finished,
aborted, failed, or dropped with its batch), the last key its commits stored, if it stored any,
becomes a tail. Never at an intermediate prefill chunk or at each generated block that fills:
that would cost an etcd put and a later delete per chunk and per generated block, the load
run-granular publication exists to avoid. Not at the end of prefill either: the chain at the
request's end is what the next turn of a conversation shares (previous prompt + answer + new
message), and it covers the prompt; another request with the same prompt but a different
continuation still matches through the prompt's last run boundary, losing only the partial run
after it across nodes (this node reuses it from its own pool), for one tail per request and not two.
A released request's blocks were held until then, so its tail is resident; one evicted again
before `take_pool_events` is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, NamedTuple, Sequence as Seq

import torch

from prefixpool.engine.batch import Batch, ScheduledSpan, StepOutput, TokenEvent
from prefixpool.engine.isolation import failure_reason, forward_isolated
from prefixpool.engine.kernels import kernels_for
from prefixpool.engine.model import Transformer
from prefixpool.model.config import arena_shape_for
from prefixpool.engine.torch_dtype import dtype_name
from prefixpool.engine.sampling import Sampler, SamplingParams
from prefixpool.engine.sequence import RequestStats, Sequence
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey, Namespace, chain_from, pack_tokens
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import PoolExhausted

log = logging.getLogger(__name__)


class RequestTooLarge(ValueError):
    """The request can never run here: too long for the model or the whole pool."""


class PoolEvents(NamedTuple):
    stored: list[BlockKey]
    evicted: list[BlockKey]
    tails: list[BlockKey]  # of stored: the last key each request released since stored, in release order


class InvalidTokens(ValueError):
    """Prompt ids outside the model's vocabulary: embedding them would fail the whole batch (on CUDA, the device)."""


class Engine:
    def __init__(self, model: Transformer, blocks: NodeBlocks, arena: KVArena, namespace: Namespace, *,
                 max_batch_size: int = 8, chunk_size: int = 512, batch_invariant: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        _check_fit(model, blocks, arena, namespace)
        if chunk_size < max_batch_size:
            raise ValueError(f"chunk_size {chunk_size} < max_batch_size {max_batch_size}: decodes would starve prefill")
        self.model, self.blocks, self.arena, self.namespace = model, blocks, arena, namespace
        self.block_size = namespace.block_size
        self.max_batch_size, self.chunk_size, self.clock = max_batch_size, chunk_size, clock
        self.kernels = kernels_for(batch_invariant, model.device)  # bit-equal per token whatever the batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._sequences: dict[int, Sequence] = {}
        self._in_flight: set[int] = set()
        self._next_id = 0
        self._pool_events: dict[BlockKey, bool] = {}   # key -> stored (True) or evicted, latest wins
        self._tails: dict[BlockKey, None] = {}  # released requests' last keys stored (ordered set)
        self._refused: list[tuple[int, str]] = []
        self._failed: list[tuple[int, str]] = []
        self._deferred: set[int] = set()  # waiting, but not admissible yet (deferred)

    # -- requests --------------------------------------------------------------------------
    def submit(self, tokens: Seq[int], params: SamplingParams, keys: Seq[BlockKey] | None = None, *,
               keep_logits: bool = False, deferred: bool = False) -> int:
        tokens = list(tokens)
        if not tokens:
            raise RequestTooLarge("a request needs at least one prompt token")
        config = self.model.config
        if min(tokens) < 0 or max(tokens) >= config.vocab_size:
            raise InvalidTokens(f"token ids must be in [0, {config.vocab_size}): got {min(tokens)}..{max(tokens)}")
        if len(tokens) + params.max_tokens > config.max_position:
            raise RequestTooLarge(f"{len(tokens)} prompt + {params.max_tokens} new tokens exceed "
                                  f"the model's {config.max_position} positions")
        seq = Sequence(self._next_id, tokens, len(tokens), params, Sampler(params, config.eos_token_id),
                       self._prompt_keys(tokens, keys), self.clock(), keep_logits)
        if seq.num_blocks_needed(self.block_size) > self.blocks.num_blocks:
            raise RequestTooLarge(f"request needs {seq.num_blocks_needed(self.block_size)} blocks, "
                                  f"the pool has {self.blocks.num_blocks}")
        self._next_id += 1
        self._sequences[seq.request_id] = seq
        self.waiting.append(seq)
        if deferred:
            self._deferred.add(seq.request_id)
        return seq.request_id

    def resume(self, request_id: int) -> None:
        """A deferred request may be admitted from now on, in its place in the queue."""
        self._deferred.discard(request_id)

    def abort(self, request_id: int) -> bool:
        """Drop a request; its blocks are freed now, or after the step that is using them."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._deferred.discard(request_id)
            del self._sequences[request_id]
        elif request_id in self._in_flight:
            seq.aborted = True
        else:
            self._release(seq)
        return True

    def stats(self, request_id: int) -> RequestStats:
        return self._sequences[request_id].stats()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def take_pool_events(self) -> PoolEvents:
        """(stored, evicted, tails) keys since the last call, for publishing; stored and evicted are disjoint.

        A key stored and evicted in the same interval counts as evicted (deleting an
        unpublished key is harmless); evicted and stored again counts as stored. `tails`: the
        last key stored by each request released in the interval that is not evicted since (see
        the module doc); one stored in an earlier interval is listed in `stored` again, last.
        """
        events, self._pool_events = self._pool_events, {}
        tails, self._tails = [k for k in self._tails if events.get(k, True)], {}
        return PoolEvents([*(k for k, stored in events.items() if stored), *(k for k in tails if k not in events)],
                          [k for k, stored in events.items() if not stored],
                          tails)

    def take_refused(self) -> list[tuple[int, str]]:
        """(request id, reason) of requests dropped because blocks held outside any request (pins) left no room."""
        refused, self._refused = self._refused, []
        return refused

    def take_failed(self) -> list[tuple[int, str]]:
        """(request id, reason) of requests finish() dropped because their forward span or sampling failed."""
        failed, self._failed = self._failed, []
        return failed

    def _record(self, key: BlockKey, stored: bool) -> None:
        self._pool_events.pop(key, None)
        self._pool_events[key] = stored

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        batch = self.schedule()
        return self.finish(batch, self.forward(batch))

    def schedule(self) -> Batch:
        budget = self.chunk_size
        spans: list[ScheduledSpan] = []
        for seq in self.running:
            if not seq.in_prefill:
                spans.append(self._span(seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                spans.append(self._span(seq, budget))
                budget -= spans[-1].end - spans[-1].start
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = next((s for s in self.waiting if s.request_id not in self._deferred), None)
            if seq is None:
                break
            if not self._admit(seq):
                if self.running or not self._held_elsewhere(seq):
                    break
                self.waiting.remove(seq)
                self._refuse(seq)
                continue
            self.waiting.remove(seq)
            self.running.append(seq)
            spans.append(self._span(seq, budget))
            budget -= spans[-1].end - spans[-1].start
        self._in_flight = {span.seq.request_id for span in spans}
        return Batch(spans)

    def forward(self, batch: Batch) -> StepOutput:
        """Tensor work only: no pool calls, no request state changes. A failing span fails alone."""
        if not batch.spans:
            return StepOutput(torch.empty(0, self.model.config.vocab_size))
        return forward_isolated(self._run, batch, self.model.config.vocab_size)

    def _run(self, batch: Batch) -> torch.Tensor:
        tokens, positions, layout, logit_rows = batch.model_inputs(self.model.device, self.block_size)
        return self.model(tokens, positions, layout, self.arena.tensor, logit_rows, self.kernels).cpu()

    def finish(self, batch: Batch, output: StepOutput) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        row = 0
        for item in batch.spans:
            seq = item.seq
            logits = output.logits[row] if item.sample else None
            row += item.sample
            if seq.aborted:
                self._release(seq)
                continue
            if seq.request_id in output.failed:
                self._fail(seq, output.failed[seq.request_id])
                continue
            seq.num_computed = item.end
            seq.num_stored = max(seq.num_stored, item.end)
            self._commit_full_blocks(seq)
            if logits is not None and (event := self._emit(seq, logits)) is not None:
                events.append(event)
        self._in_flight = set()
        return events

    def fail(self, batch: Batch) -> list[int]:
        """forward() raised: drop the batch's requests, free their blocks, return their ids to report."""
        for item in batch.spans:
            self._release(item.seq)
        self._in_flight = set()
        return [item.seq.request_id for item in batch.spans]

    # -- conveniences for tests and scripts ---------------------------------------------------
    def generate(self, tokens: Seq[int], params: SamplingParams,
                 keys: Seq[BlockKey] | None = None) -> tuple[list[int], RequestStats]:
        return self.generate_batch([tokens], params, [keys])[0]

    def generate_batch(self, prompts: Seq[Seq[int]], params: SamplingParams,
                       keys: Seq[Seq[BlockKey] | None] | None = None) -> list[tuple[list[int], RequestStats]]:
        """Submit all prompts, step until the engine is idle, return each output and its stats."""
        keys = keys or [None] * len(prompts)
        seqs = [self._sequences[self.submit(p, params, k)] for p, k in zip(prompts, keys)]
        while self.has_work():
            self.step()
        return [(seq.tokens[seq.num_prompt_tokens:], seq.stats()) for seq in seqs]

    def prefill_logits(self, tokens: Seq[int], keys: Seq[BlockKey] | None = None) -> tuple[torch.Tensor, RequestStats]:
        """The fp32 logits of the prompt's last position, and the request's stats."""
        seq = self._sequences[self.submit(tokens, SamplingParams(max_tokens=1), keys, keep_logits=True)]
        while seq.request_id in self._sequences:
            self.step()
        return seq.first_logits, seq.stats()

    # -- internals ---------------------------------------------------------------------------
    def _prompt_keys(self, tokens: list[int], keys: Seq[BlockKey] | None) -> list[BlockKey]:
        """Keys of the prompt's full blocks: as given, extended from the last given key if short."""
        num_full = len(tokens) // self.block_size
        given = list(keys or [])
        if len(given) > num_full:
            raise ValueError(f"{len(given)} keys given for a prompt of {num_full} full blocks")
        parent = given[-1] if given else self.namespace.root()
        rest = pack_tokens(tokens[len(given) * self.block_size: num_full * self.block_size])
        return given + chain_from(parent, rest, self.block_size)

    def _admit(self, seq: Sequence) -> bool:
        num_blocks = seq.num_blocks_needed(self.block_size)
        if not self.blocks.fits(seq.keys, num_blocks):
            return False
        hold = self.blocks.acquire(seq.keys)
        num_cached = len(hold.block_ids)
        try:
            evicted = self.blocks.allocate(hold, num_blocks - num_cached)
        except PoolExhausted:  # free blocks are still within their minimum residency: retry next step
            self.blocks.release(hold)
            return False
        for key in evicted:
            self._record(key, stored=False)
        seq.hold = hold
        seq.num_committed = num_cached
        seq.num_stored = num_cached * self.block_size
        seq.num_computed = seq.num_cached_tokens = min(seq.num_stored, seq.num_prompt_tokens - 1)
        return True

    def _held_elsewhere(self, seq: Sequence) -> bool:
        """Nothing runs, yet the head does not fit even counting resident blocks: pins hold the rest."""
        return not self.blocks.fits(seq.keys, seq.num_blocks_needed(self.block_size))

    def _refuse(self, seq: Sequence) -> None:
        held = self.blocks.num_blocks - self.blocks.num_free
        self._refused.append((seq.request_id, f"pool exhausted: {held} of {self.blocks.num_blocks} blocks are "
                                              f"pinned or held; retry later"))
        del self._sequences[seq.request_id]

    def _span(self, seq: Sequence, budget: int) -> ScheduledSpan:
        start = seq.num_computed
        end = min(len(seq.tokens), start + budget)
        num_blocks = -(-end // self.block_size)
        return ScheduledSpan(seq, start, end, seq.num_stored, tuple(seq.hold.block_ids[:num_blocks]),
                             tuple(seq.tokens[start:end]), end == len(seq.tokens))

    def _commit_full_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_stored // self.block_size
        if num_full <= seq.num_committed:
            return
        if num_full > len(seq.keys):  # blocks of generated tokens: keyed as they fill
            parent = seq.keys[-1] if seq.keys else self.namespace.root()
            block = seq.tokens[len(seq.keys) * self.block_size:num_full * self.block_size]
            seq.keys.extend(chain_from(parent, pack_tokens(block), self.block_size))
        stored = self.blocks.commit(seq.hold, seq.num_committed, seq.keys[seq.num_committed:num_full])
        for key in stored:
            self._record(key, stored=True)
        if stored:
            seq.last_stored = stored[-1]
        seq.num_committed = num_full

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> TokenEvent | None:
        """The request's next token; None if sampling failed (the request is failed alone)."""
        try:
            token = seq.sampler.sample(logits)
            logprobs = seq.sampler.logprobs(logits, token)
        except RuntimeError as err:  # e.g. NaN logits: torch.multinomial refuses them
            log.exception("sampling failed for request %d", seq.request_id)
            self._fail(seq, failure_reason(err))
            return None
        if seq.keep_logits and seq.first_logits is None:
            seq.first_logits = logits.clone()
        seq.tokens.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = self.clock()
        reason = seq.sampler.finish_reason(token, seq.num_output_tokens)
        if reason is None:
            return TokenEvent(seq.request_id, token, False, logprobs=logprobs)
        self._release(seq)
        return TokenEvent(seq.request_id, token, True, reason, seq.stats(), logprobs)

    def _fail(self, seq: Sequence, why: str) -> None:
        self._release(seq)
        self._failed.append((seq.request_id, why))

    def _release(self, seq: Sequence) -> None:
        """Every end of an admitted request goes here: its chain stops growing, its last key stored is a tail."""
        if seq.last_stored is not None:
            self._tails[seq.last_stored] = None
        self.blocks.release(seq.hold)
        self.running.remove(seq)
        del self._sequences[seq.request_id]


def _check_fit(model: Transformer, blocks: NodeBlocks, arena: KVArena, namespace: Namespace) -> None:
    expected = arena_shape_for(model.config, arena.num_blocks, namespace.block_size)
    if arena.shape != expected:
        raise ValueError(f"arena shape {arena.shape} does not fit the model: expected {expected}")
    if blocks.num_blocks != arena.num_blocks:
        raise ValueError(f"pool has {blocks.num_blocks} blocks, arena {arena.num_blocks}")
    if arena.dtype != model.dtype or namespace.dtype != dtype_name(arena.dtype):
        raise ValueError(f"dtypes differ: model {model.dtype}, arena {arena.dtype}, namespace {namespace.dtype!r}")
    if arena.device.type != model.device.type:
        raise ValueError(f"arena on {arena.device}, model on {model.device}")
