"""The router <-> worker wire format: one module both sides import.

    POST {worker}/generate  GenerateRequest: msgpack (Content-Type application/msgpack, what routers
                            send, with the prompt as one bin of little-endian int32 ids: the array
                            the router hashed, neither side converts a token at a time)
                            or JSON (anything else: operators, tests, curl; a list of ids)
      <- NDJSON stream: Token, Token, ..., then exactly one Done or Failed

A request whose SamplingParams ask `logprobs: N` (0 <= N <= MAX_LOGPROBS) gets,
on each Token, the sampled token's logprob and the N most likely (id, logprob)
pairs, most likely first; other requests' Tokens carry neither (nor its bytes):

    {"type": "token", "token": 42}
    {"type": "token", "token": 42, "logprob": -0.31, "top": [[42, -0.31], [7, -1.9]]}

The plan is a hint: the worker matches its own pool first and the peer
re-checks what it still holds, so stale routing costs a recompute, not an
error. A worker decodes with its RequestLimits, so a request it could not
serve (ids outside its vocabulary, past its context or its pool, a fetch plan
outside the prompt's full blocks) is refused whole, before anything streams:

    decode_request(body, type, limits)
      shapes and ranges that need no model   msgspec constraints  -> msgspec.ValidationError
      what the worker's model and pool allow check_request       -> RequestRefused

Knows nothing of HTTP servers, engines or etcd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
import numpy as np

from prefixpool.store.keys import TOKEN_DTYPE

AUTH_HEADER = "X-Prefixpool-Token"
MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]  # checked against the model's vocabulary later
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
BlockIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
MAX_TTL_S = 30 * 24 * 3600.0
MAX_LOGPROBS = 20  # top alternatives per token: vLLM's default --max-logprobs
TRANSFER_SCHEMES = ("tcp", "ucx")


class RequestRefused(ValueError):
    """A well-formed request this worker cannot serve (its vocabulary, context or pool): a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one worker can serve: its model's vocabulary and positions, its pool."""

    vocab_size: int
    max_model_len: int  # prompt + max_tokens positions
    block_size: int
    num_blocks: int  # a request holds at most the whole pool


class FetchPlan(msgspec.Struct, frozen=True):
    """Fetch blocks [start, end) of the request's chain from `peer`.

    With `wait_s` > 0 the peer is a prefill node still computing them (a disaggregated request): the
    worker fetches each block as the peer commits it, and gives up on the rest (computing it itself)
    once no new block came for `wait_s` seconds."""

    peer: Name
    transfer_url: Annotated[str, msgspec.Meta(max_length=512)]
    start: BlockIndex
    end: BlockIndex
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0


class SamplingError(ValueError):
    """Sampling parameters outside their valid range."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to choose tokens and when to stop: filled once by the router from the OpenAI body,
    carried to the worker in GenerateRequest, handed to the engine as it is."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Seed | None = None
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the N most likely tokens'

    def __post_init__(self) -> None:  # decoding runs it too: a bad value is a DecodeError there
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails every comparison
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: Name
    tokens: list[TokenId] | bytes  # prompt ids: a list, or packed little-endian int32 (bytes)
    sampling: SamplingParams
    cache_salt: Name = ""
    fetch: FetchPlan | None = None
    adapter: Name = ""  # a LoRA adapter to answer with (vLLM nodes: the request's `model`); "": the base model

    def __post_init__(self) -> None:  # decoding runs it too: a ragged packing is a DecodeError there
        if isinstance(self.tokens, bytes) and len(self.tokens) % TOKEN_DTYPE.itemsize:
            raise ValueError(f"packed tokens are {TOKEN_DTYPE.itemsize}-byte ids, got {len(self.tokens)} bytes")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_DTYPE.itemsize if isinstance(self.tokens, bytes) else len(self.tokens)

    def token_list(self) -> list[int]:
        """The prompt ids as a list, whichever form they came in."""
        if isinstance(self.tokens, bytes):
            return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE).tolist()
        return self.tokens


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    local_hit_tokens: int
    fetched_tokens: int
    computed_tokens: int
    fetched_bytes: int
    ttft_s: float
    handoff_s: float = 0.0  # a disaggregated request: from its arrival until the prefill node's blocks were in

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not recomputed (the OpenAI `cached_tokens`)."""
        return self.local_hit_tokens + self.fetched_tokens


class Token(msgspec.Struct, frozen=True, tag="token", omit_defaults=True):
    """One sampled token; with logprobs when the request asked (raw: the model's log-softmax, before
    temperature and top-p, as vLLM's default `raw_logprobs`; floored at -9999 as vLLM's answers are)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, most likely first


class Done(msgspec.Struct, frozen=True, tag="done"):
    finish_reason: str
    usage: Usage


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    message: str
    status: int = 500


Event = Token | Done | Failed


class PinRequest(msgspec.Struct, frozen=True, kw_only=True):
    """POST {worker}/admin/pin (pin) or DELETE (unpin): a prefix by tokens or text, as the tenant salts it."""

    tokens: list[TokenId] = []
    text: Annotated[str, msgspec.Meta(max_length=1 << 20)] = ""
    cache_salt: Name = ""
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)] = 300.0
    name: Name = ""  # default: the hex key of the prefix's last full block


class PinReply(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    num_blocks: int  # full blocks of the prefix
    num_held: int  # of those, pinned in device blocks now (the rest pin when computed)
    unpinned: bool = False


class WorkerLoad(msgspec.Struct, frozen=True):
    num_queued: int
    num_running: int
    num_free_blocks: int
    prefill_tokens_per_s: float


MSGPACK = "application/msgpack"
_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)
_request_encoder = msgspec.msgpack.Encoder()
_request_decoders = {MSGPACK: msgspec.msgpack.Decoder(GenerateRequest)}
_json_request_decoder = msgspec.json.Decoder(GenerateRequest)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def encode_request(request: GenerateRequest) -> bytes:
    """The router's form of a generate request: msgpack (Content-Type MSGPACK)."""
    return _request_encoder.encode(request)


def decode_request(body: bytes, content_type: str, limits: RequestLimits | None = None) -> GenerateRequest:
    """msgpack or JSON by Content-Type; raises msgspec.DecodeError (ValidationError included) when malformed,
    and RequestRefused when `limits` are given and the request is outside them."""
    request = _request_decoders.get(content_type, _json_request_decoder).decode(body)
    if limits is not None:
        check_request(request, limits)
    return request


def check_request(request: GenerateRequest, limits: RequestLimits) -> None:
    """Everything a worker needs to know before admitting a request; raises RequestRefused."""
    num_tokens = request.num_tokens
    if not num_tokens:
        raise RequestRefused("tokens must be non-empty", "tokens")
    check_token_ids(_ids(request.tokens), limits, "tokens")
    check_token_ids(request.sampling.stop_token_ids, limits, "stop_token_ids")
    max_tokens = request.sampling.max_tokens
    if num_tokens + max_tokens > limits.max_model_len:
        raise RequestRefused(f"{num_tokens} prompt + {max_tokens} new tokens exceed the model's "
                             f"{limits.max_model_len} positions", "max_tokens")
    num_blocks = -(-(num_tokens + max_tokens - 1) // limits.block_size)
    if num_blocks > limits.num_blocks:
        raise RequestRefused(f"request needs {num_blocks} blocks, the pool has {limits.num_blocks}", "max_tokens")
    if request.fetch is not None:
        _check_fetch(request.fetch, num_tokens // limits.block_size)
    if request.adapter:  # the router sends adapters only to nodes that advertise them; ours advertise none
        raise RequestRefused(f"this worker serves no LoRA adapters, not {request.adapter!r}", "adapter")


def check_token_ids(ids: np.ndarray | list[int] | tuple[int, ...], limits: RequestLimits, param: str) -> None:
    """Every id in [0, vocab_size) of the worker's model; raises RequestRefused."""
    if len(ids) == 0:
        return
    low, high = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if low < 0 or high >= limits.vocab_size:
        bad = low if low < 0 else high
        raise RequestRefused(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param)


def _ids(tokens: list[int] | bytes) -> np.ndarray | list[int]:
    return np.frombuffer(tokens, dtype=TOKEN_DTYPE) if isinstance(tokens, bytes) else tokens


def _check_fetch(plan: FetchPlan, num_full_blocks: int) -> None:
    if not plan.start <= plan.end <= num_full_blocks:
        raise RequestRefused(f"fetch plan [{plan.start}, {plan.end}) is outside the prompt's "
                             f"{num_full_blocks} full blocks", "fetch")
    if not plan.peer:
        raise RequestRefused("fetch plan names no peer", "fetch")
    try:
        parts = urlsplit(plan.transfer_url)
        port = parts.port
    except ValueError as err:
        raise RequestRefused(f"fetch plan transfer_url {plan.transfer_url!r}: {err}", "fetch") from None
    if parts.scheme not in TRANSFER_SCHEMES or not parts.hostname or not port:
        raise RequestRefused(f"fetch plan transfer_url {plan.transfer_url!r} is not scheme://host:port "
                             f"with a scheme of {TRANSFER_SCHEMES}", "fetch")


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event) + b"\n"


def decode_event(line: bytes) -> Event:
    return _event_decoder.decode(line)
