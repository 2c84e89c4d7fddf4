"""The OpenAI request bodies the router accepts, decoded and validated in one place.

    bytes --decode()--> CompletionBody | ChatBody --(checks against the model)--> served

msgspec does the typing (wrong or missing fields, and numbers outside their
range -> InvalidField, 422); `decode` adds the semantic checks that need no
model (400), token ids outside int32 and chat's `top_logprobs` without
`logprobs: true` included. Logprobs, as vLLM takes them:

    /v1/completions       logprobs: N               N in [0, MAX_LOGPROBS]
    /v1/chat/completions  logprobs: true, top_logprobs: N   (top_logprobs alone: 0 or null)

Context length
and model name are checked by the caller, which knows the model. Knows
nothing of HTTP servers, tokenizers or workers.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

from prefixpool.contract.worker_api import MAX_LOGPROBS
from prefixpool.router.errors import InvalidField, InvalidRequest

MAX_INT32 = 2**31 - 1
TokenId = int  # any int decodes; one outside int32 is a 400 in _check_prompt (as one outside the vocabulary is)
PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Salt = Annotated[str, msgspec.Meta(max_length=256)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]  # vLLM's "-1: all" is not taken


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: PositiveTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    user: str | None = None
    # prefixpool extension (the vLLM name): a tenant's salt enters the block-key namespace.
    cache_salt: Salt = ""
    # vLLM's extension: keep generating past the end-of-sequence token (benchmarks, load tests).
    ignore_eos: bool = False


class CompletionBody(_Sampling, frozen=True, kw_only=True):
    prompt: str | list[TokenId | str]
    echo: Literal[False] = False
    logprobs: NumLogprobs | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveTokens | None = None
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None  # null means 0, as in OpenAI's and vLLM's schema


class RouteBody(msgspec.Struct, frozen=True, kw_only=True):
    """`/v1/route`: a completion or chat body; only what decides the route."""

    model: str
    prompt: str | list[TokenId | str] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: PositiveTokens | None = None
    cache_salt: Salt = ""


Body = TypeVar("Body", CompletionBody, ChatBody, RouteBody)


def decode(raw: bytes, kind: type[Body]) -> Body:
    """Decode and type-check a request body; raise InvalidRequest / InvalidField."""
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as err:
        raise InvalidField(str(err), param=_param_of(str(err)), code="invalid_type") from None
    except msgspec.DecodeError as err:
        raise InvalidRequest(f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    _check_prompt(body)
    if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
        raise InvalidRequest("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
    return body


def _param_of(message: str) -> str | None:
    marker = "at `$."
    if marker not in message:
        return None
    return message.split(marker, 1)[1].rstrip("`").split("[")[0].split(".")[0]


def _check_prompt(body: CompletionBody | ChatBody | RouteBody) -> None:
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) > 1 and str in set(map(type, prompt)):  # C loops, not a genexpr
        raise InvalidRequest("prompt must be a string, a list of token ids, or a list of exactly one string",
                             param="prompt")
    if isinstance(body, RouteBody) and (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of `prompt` or `messages`", param="prompt")
    if prompt is not None and len(prompt) == 0:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if isinstance(prompt, list) and not isinstance(prompt[0], str) and not 0 <= min(prompt) <= max(prompt) <= MAX_INT32:
        bad = min(prompt) if min(prompt) < 0 else max(prompt)
        raise InvalidRequest(f"token id {bad} is outside int32 [0, {MAX_INT32}]", param="prompt",
                             code="invalid_token_id")


def requested_tokens(body: CompletionBody | ChatBody | RouteBody, default: int) -> int:
    return getattr(body, "max_completion_tokens", None) or body.max_tokens or default


def requested_logprobs(body: CompletionBody | ChatBody | RouteBody) -> int | None:
    """Top alternatives asked per token (0: the sampled token's logprob only), or None: no logprobs."""
    if isinstance(body, ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)
