"""The router <-> worker wire format: one module both sides import.

    POST {worker}/generate  GenerateRequest: msgpack (Content-Type application/msgpack, what routers
                            send, with the prompt as one bin of little-endian int32 ids: the array
                            the router hashed, neither side converts a token at a time)
                            or JSON (anything else: operators, tests, curl; a list of ids)
      <- NDJSON stream: Token, Token, ..., then exactly one Done or Failed

The plan is a hint: the worker matches its own pool first and the peer
re-checks what it still holds, so stale routing costs a recompute, not an
error. Knows nothing of HTTP servers, engines or etcd.
"""

from __future__ import annotations

import msgspec
import numpy as np

from prefixpool.store.keys import TOKEN_DTYPE

AUTH_HEADER = "X-Prefixpool-Token"


class FetchPlan(msgspec.Struct, frozen=True):
    """Fetch blocks [start, end) of the request's chain from `peer`."""

    peer: str
    transfer_url: str
    start: int
    end: int


class SamplingError(ValueError):
    """Sampling parameters outside their valid range."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to choose tokens and when to stop: filled once by the router from the OpenAI body,
    carried to the worker in GenerateRequest, handed to the engine as it is."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:  # decoding runs it too: a bad value is a DecodeError there
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    tokens: list[int] | bytes  # prompt ids: a list, or packed little-endian int32 (bytes)
    sampling: SamplingParams
    cache_salt: str = ""
    fetch: FetchPlan | None = None

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

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not recomputed (the OpenAI `cached_tokens`)."""
        return self.local_hit_tokens + self.fetched_tokens


class Token(msgspec.Struct, frozen=True, tag="token"):
    token: int


class Done(msgspec.Struct, frozen=True, tag="done"):
    finish_reason: str
    usage: Usage


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    message: str
    status: int = 500


Event = Token | Done | Failed


class PinRequest(msgspec.Struct, frozen=True, kw_only=True):
    """POST {worker}/admin/pin (pin) or DELETE (unpin): a prefix by tokens or text, as the tenant salts it."""

    tokens: list[int] = []
    text: str = ""
    cache_salt: str = ""
    ttl_s: float = 300.0
    name: str = ""  # default: the hex key of the prefix's last full block


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


def decode_request(body: bytes, content_type: str) -> GenerateRequest:
    """msgpack or JSON by Content-Type; raises msgspec.DecodeError (ValidationError included) when malformed."""
    return _request_decoders.get(content_type, _json_request_decoder).decode(body)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event) + b"\n"


def decode_event(line: bytes) -> Event:
    return _event_decoder.decode(line)
