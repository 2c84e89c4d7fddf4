"""Shaping answers the OpenAI way: completion and chat objects, stream chunks, usage.

Pure functions from what was generated to JSON-ready dicts. Knows nothing
of HTTP, workers or tokenizers.
"""

from __future__ import annotations

import time

from router.contract.worker_api import Usage


def usage_dict(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        # prefixpool's own detail: where the cached tokens came from.
        "prefixpool": {
            "local_hit_tokens": usage.local_hit_tokens,
            "fetched_tokens": usage.fetched_tokens,
            "computed_tokens": usage.computed_tokens,
            "fetched_bytes": usage.fetched_bytes,
            "worker_ttft_s": usage.ttft_s,
        },
    }


def _envelope(request_id: str, model: str, obj: str) -> dict:
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model}


def completion(request_id: str, model: str, text: str, finish_reason: str, usage: Usage) -> dict:
    return {
        **_envelope(request_id, model, "text_completion"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_dict(usage),
    }


def chat(request_id: str, model: str, text: str, finish_reason: str, usage: Usage) -> dict:
    return {
        **_envelope(request_id, model, "chat.completion"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": usage_dict(usage),
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict:
    return {
        **_envelope(request_id, model, "text_completion"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }


def chat_chunk(request_id: str, model: str, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
    delta: dict = {}
    if first:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    return {
        **_envelope(request_id, model, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, chat_kind: bool, usage: Usage) -> dict:
    obj = "chat.completion.chunk" if chat_kind else "text_completion"
    return {**_envelope(request_id, model, obj), "choices": [], "usage": usage_dict(usage)}


def error_chunk(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": status}}
