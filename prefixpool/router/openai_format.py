"""Shaping answers the OpenAI way: completion and chat objects, stream chunks, usage.

Pure functions from what was generated to JSON-ready dicts, and StreamFrames:
a streamed answer's SSE frames, whose envelope is encoded once per request so
a token's frame costs one string encode. With logprobs asked, every token gets
a frame of its own, with its text (possibly empty) and its logprobs object
(openai_logprobs.py), as vLLM streams them. Knows nothing of HTTP, workers or
tokenizers.
"""

from __future__ import annotations

import time

import msgspec

from prefixpool.contract.worker_api import Usage

_encode = msgspec.json.encode


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


def completion(request_id: str, model: str, text: str, finish_reason: str, usage: Usage,
               logprobs: dict | None = None) -> dict:
    return {
        **_envelope(request_id, model, "text_completion"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": usage_dict(usage),
    }


def chat(request_id: str, model: str, text: str, finish_reason: str, usage: Usage,
         logprobs: dict | None = None) -> dict:
    return {
        **_envelope(request_id, model, "chat.completion"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
        "usage": usage_dict(usage),
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {
        **_envelope(request_id, model, "text_completion"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def chat_chunk(request_id: str, model: str, text: str | None, finish_reason: str | None, first: bool = False,
               logprobs: dict | None = None) -> dict:
    delta: dict = {}
    if first:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    return {
        **_envelope(request_id, model, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, chat_kind: bool, usage: Usage) -> dict:
    obj = "chat.completion.chunk" if chat_kind else "text_completion"
    return {**_envelope(request_id, model, obj), "choices": [], "usage": usage_dict(usage)}


def error_chunk(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": status}}


class StreamFrames:
    """`data: {...}\n\n` frames of one streamed answer.

    A text frame is  head + json(text) + tail,  head and tail cut once from the
    encoded chunk around a marker text, so the bytes equal those of the dict
    functions above (a test checks); rarer frames encode their dicts.
    """

    _MARK = "\x00mark\x00"

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        sample = self._dict(self._MARK, None)
        self._head, _, self._tail = self.frame(sample).partition(_encode(self._MARK))

    def _dict(self, text: str | None, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            return chat_chunk(self.request_id, self.model, text, finish_reason, logprobs=logprobs)
        return completion_chunk(self.request_id, self.model, text or "", finish_reason, logprobs)

    @staticmethod
    def frame(payload: dict) -> bytes:
        return b"data: " + _encode(payload) + b"\n\n"

    def text(self, text: str) -> bytes:
        return self._head + _encode(text) + self._tail

    def token(self, text: str, logprobs: dict) -> bytes:
        """One token's frame, with its logprobs: encoded whole (logprobs are asked for rarely)."""
        return self.frame(self._dict(text, None, logprobs))

    def first(self) -> bytes:
        return self.frame(chat_chunk(self.request_id, self.model, None, None, first=True))

    def last(self, text: str, finish_reason: str) -> bytes:
        return self.frame(self._dict(text, finish_reason))

    def usage(self, usage: Usage) -> bytes:
        return self.frame(usage_chunk(self.request_id, self.model, self.chat, usage))
