"""The router's client for vLLM nodes: the worker client's events, from vLLM's own OpenAI API.

    GenerateRequest (token ids the router hashed) ─▶ POST {vllm}/v1/completions
        model = its LoRA adapter if it names one (vLLM serves adapters by name), else the base model
        prompt = those token ids, stream, include_usage, return_token_ids
        (logprobs N asked: logprobs N, return_tokens_as_token_ids)
    SSE chunks ─▶ Token per generated id ─▶ Done(usage: vLLM's cached_tokens as local hits)
        (with its logprob and top N from vLLM's completion logprobs, named "token_id:<id>":
         vLLM lists the sampled token first, then the N most likely, so N + 1 entries mean
         the sampled one is not among them; the router names the ids as it does its own workers')
    vLLM 4xx  ─▶ Failed(vLLM's message, same status): the client gets vLLM's error, as an OpenAI error
    vLLM 5xx, connection lost before a token ─▶ WorkerUnreachable (the router retries elsewhere)

    prefill(url, request) ─▶ the prompt alone, max_tokens 1, not streamed, kv_transfer_params
        {"do_remote_decode": true} (vLLM's key): a prefill server's connector saves the prompt's blocks
        into its pool and answers where they are (its kv_transfer_params); generate(decode url, request,
        those params) then loads them there instead of computing them. A prefill that fails answers None:
        the decode server computes the prompt itself (slower, never wrong).

Sending token ids rather than text makes vLLM compute exactly the blocks the
router routed on: the keys it predicted are the keys vLLM's events report (and
saves vLLM its tokenizing: 0.7 ms of TTFT at 544 tokens, benchmarks/gateway.md).
Requests go through the lean HTTP/1.1 client (prefixpool/net/http1_client.py), kept-alive per server.
The fetch part of a plan is ignored (vLLM reads only its own cache). Knows
nothing of routing or etcd.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Sequence

import msgspec

from prefixpool.contract.worker_api import Done, Event, Failed, GenerateRequest, Token, Usage
from prefixpool.net.http1_client import Http1Client, Response
from prefixpool.router.worker_client import WorkerUnreachable

log = logging.getLogger(__name__)
HANDOFF_ASK = "do_remote_decode"  # vLLM's kv_transfer_params key (prefixpool/vllm_connector/handoff.py reads it)
COMPLETIONS = b"/v1/completions"
DRAIN_S = 0.5  # at most this long for the rest of a stream after its last event (keep-alive, not the answer)


class VllmClient:
    def __init__(self, model: str, connect_timeout_s: float = 3.0, read_timeout_s: float = 300.0) -> None:
        self.model = model
        self._http = Http1Client(connect_timeout_s, read_timeout_s)

    async def close(self) -> None:
        await self._http.close()

    def _post(self, vllm_url: str, body: dict):
        """POST `body` to vLLM's /v1/completions, encoded by msgspec (the prompt's ids list 0.2 ms faster than
        the json module, measured by py-spy under bench_gateway --added), through the lean client
        (prefixpool/net/http1_client.py)."""
        return self._http.post(vllm_url, COMPLETIONS, msgspec.json.encode(body))

    def body(self, request: GenerateRequest) -> dict:
        sampling = request.sampling
        body = {"model": request.adapter or self.model, "prompt": request.token_list(),
                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "ignore_eos": sampling.ignore_eos,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        if sampling.logprobs is not None:
            body["logprobs"] = sampling.logprobs
            body["return_tokens_as_token_ids"] = True
        return body

    async def prefill(self, vllm_url: str, request: GenerateRequest) -> dict | None:
        """Compute the prompt on a prefill server; the kv_transfer_params its connector answered, or None."""
        body = {**self.body(request), "max_tokens": 1, "stream": False, "kv_transfer_params": {HANDOFF_ASK: True}}
        for key in ("stream_options", "return_token_ids", "logprobs", "return_tokens_as_token_ids"):
            body.pop(key, None)
        try:
            async with self._post(vllm_url, body) as response:
                if response.status != 200:
                    text = (await response.text())[:200]
                    log.warning("prefill on %s answered %d: %s; the decode server computes the prompt", vllm_url,
                                response.status, text)
                    return None
                params = msgspec.json.decode(await response.read()).get("kv_transfer_params")
        except (OSError, ValueError, AttributeError) as err:  # OSError: unreachable, reset, timed out
            log.warning("prefill on %s failed: %r; the decode server computes the prompt", vllm_url, err)
            return None
        return params if isinstance(params, dict) else None

    async def generate(self, vllm_url: str, request: GenerateRequest,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[Event]:
        """`kv_transfer_params`: a prefill server's answer (prefill()), for the decode server's connector."""
        start = time.perf_counter()
        body = self.body(request)
        if kv_transfer_params:
            body["kv_transfer_params"] = kv_transfer_params
        try:
            async with self._post(vllm_url, body) as response:
                if response.status != 200:
                    yield _failure(response.status, await response.text())
                    return
                state = _StreamState(start, request.sampling.logprobs)
                async for raw in response.lines():
                    for event in state.feed(raw):
                        if not isinstance(event, Token):
                            await _read_to_end(response)
                            yield event
                            return
                        yield event
        except OSError as err:  # refused, reset, closed early, timed out, not HTTP (net/http1_client.py)
            raise WorkerUnreachable(f"{vllm_url}: {err!r}") from err
        raise WorkerUnreachable(f"{vllm_url}: the stream ended without usage")


async def _read_to_end(response: Response) -> None:
    """Read what follows the last event (vLLM's `data: [DONE]`, sent right after the usage chunk), so the
    connection goes back to the pool: a body left unread closes it, and every request paid a new connection
    to vLLM (measured: a TCP connect per request on the TTFT path). Bounded: a server that keeps the stream
    open past it costs that one connection, never the answer."""
    await response.drain(DRAIN_S)


def _failure(status: int, text: str) -> Failed:
    """vLLM's error body, either {"error": {...}} or the older {"object": "error", "message": ...}."""
    if status >= 500:
        raise WorkerUnreachable(f"vLLM answered {status}: {text[:200]}")
    try:
        body = json.loads(text)
        message = (body.get("error") or body).get("message") or text
    except (ValueError, AttributeError):
        message = text
    return Failed(str(message)[:2000], status)


class _Choice(msgspec.Struct):
    token_ids: Any = None
    logprobs: Any = None
    finish_reason: Any = None


class _Chunk(msgspec.Struct):
    """What the router reads of a chunk of vLLM's stream; the rest is skipped, not built (the prompt's ids that
    the first chunk echoes back: 3.5 KB at 544 tokens, on the path of the first token)."""

    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_CHUNK = msgspec.json.Decoder(_Chunk)


class _StreamState:
    """What the SSE stream has said so far: tokens, the finish reason, and then usage."""

    def __init__(self, start: float, num_logprobs: int | None = None) -> None:
        self.start = start
        self.num_logprobs = num_logprobs
        self.ttft_s = 0.0
        self.finish_reason = "length"

    def feed(self, raw: bytes) -> list[Event]:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return []
        chunk = _CHUNK.decode(line[6:])
        if chunk.error is not None:
            error = chunk.error
            return [Failed(str(error.get("message", error)), int(error.get("code") or 500))]
        events: list[Event] = []
        for choice in chunk.choices or ():
            ids = choice.token_ids or []
            if ids and not self.ttft_s:
                self.ttft_s = time.perf_counter() - self.start
            events += self._tokens(ids, choice.logprobs)
            self.finish_reason = choice.finish_reason or self.finish_reason
        if chunk.usage:
            events.append(Done(self.finish_reason, self._usage(chunk.usage)))
        return events

    def _tokens(self, ids: list[int], logprobs: dict | None) -> list[Event]:
        if self.num_logprobs is None or not ids:
            return [Token(t) for t in ids]
        try:
            return [_token(t, lp, top, self.num_logprobs) for t, lp, top in
                    zip(ids, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)]
        except (TypeError, KeyError, ValueError) as err:  # no logprobs, or not one entry per token id
            return [Failed(f"vLLM's logprobs do not match its tokens: {err!r}", 502)]

    def _usage(self, usage: dict) -> Usage:
        prompt = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Usage(prompt_tokens=prompt, completion_tokens=usage.get("completion_tokens", 0),
                     local_hit_tokens=cached, fetched_tokens=0, computed_tokens=prompt - cached,
                     fetched_bytes=0, ttft_s=self.ttft_s)


def _token(token: int, logprob: float | None, top: dict[str, float] | None, num_logprobs: int) -> Token:
    """A Token from one position of vLLM's completion logprobs (ids named "token_id:<id>")."""
    if logprob is None or top is None:
        return Token(token)
    pairs = [(_token_id(name), value) for name, value in top.items()]
    if len(pairs) > num_logprobs:  # the sampled token (first) is not among the N most likely
        pairs = pairs[1:]
    return Token(token, logprob, _most_likely_first(pairs))


def _token_id(name: str) -> int:
    prefix, _, digits = name.partition(":")
    if prefix != "token_id" or not digits.isdigit():
        raise ValueError(f"vLLM named a token {name!r}, not token_id:<id>")
    return int(digits)


def _most_likely_first(pairs: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """vLLM lists the sampled token first; our workers list by logprob, ties to the lower id."""
    return tuple(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))
