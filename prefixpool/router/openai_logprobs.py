"""Per-token logprobs in the OpenAI shapes, made from the workers' Token events.

    Token(id, logprob, top=((id, logprob), ...))   each id named by TokenTexts, after the tokens
                                                   sampled before it (detokenizer.py), as vLLM names them
    /v1/completions   {"tokens": [text], "token_logprobs": [logprob],
                       "top_logprobs": [{text: logprob, ...}], "text_offset": [offset]}
                      a top dict holds the sampled token first, then the N most likely (so up to
                      N + 1 entries, as OpenAI and vLLM answer); tokens of the same text share one
                      entry: first in its place, with the last one's logprob, as vLLM's dict has it;
                      offsets add up the token texts from 0, carried from one stream chunk to the
                      next, as vLLM counts them
    /v1/chat/completions
                      {"content": [{"token": text, "logprob": logprob, "bytes": [...],
                                    "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}
                      the top list holds the N most likely, most likely first; bytes are the
                      text's UTF-8, as vLLM gives them

vLLM's chat top list starts with the sampled token (then the most likely
ones): the same list whenever the sampled token is among the N most likely
(always, greedy); here it is the N most likely, as OpenAI defines it. A token
whose logprob did not come back (null) reads as vLLM shows one: null in a
completion, -9999 and no alternatives in a chat. Knows nothing of HTTP,
workers or tokenizers.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from prefixpool.contract.worker_api import Token

NO_LOGPROB = -9999.0  # vLLM's value for a chat token without one
MAX_CONTEXT = 4  # sampled tokens kept to name the next ones (TokenTexts reads at most 4)

TokenText = Callable[[int, Sequence[int]], str]  # (id, ids sampled before it) -> its text


class LogprobsShape:
    """The logprobs object of one answer, a whole answer or one stream chunk at a time."""

    def __init__(self, token_text: TokenText, chat: bool) -> None:
        self.token_text = token_text
        self.chat = chat
        self._offset = 0  # completions: where the next token's text starts
        self._context: deque[int] = deque(maxlen=MAX_CONTEXT)  # the last tokens sampled

    def of(self, tokens: Sequence[Token]) -> dict:
        entries = []
        for token in tokens:
            entries.append(self._chat_entry(token) if self.chat else self._completion_entry(token))
            self._context.append(token.token)
        return {"content": entries} if self.chat else _columns(entries)

    def _text(self, token_id: int) -> str:
        return self.token_text(token_id, self._context)

    def _completion_entry(self, token: Token) -> tuple[str, float | None, dict[str, float] | None, int]:
        text = self._text(token.token)
        offset, self._offset = self._offset, self._offset + len(text)
        if token.logprob is None:
            return text, None, None, offset
        top = {text: token.logprob}
        for token_id, logprob in token.top:  # a text seen already takes this (less likely) value, as in vLLM
            top[self._text(token_id)] = logprob
        return text, token.logprob, top, offset

    def _chat_entry(self, token: Token) -> dict:
        entry = self._named(token.token, NO_LOGPROB if token.logprob is None else token.logprob)
        entry["top_logprobs"] = [self._named(token_id, logprob) for token_id, logprob in token.top]
        return entry

    def _named(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def _columns(entries: list[tuple[str, float | None, dict[str, float] | None, int]]) -> dict:
    tokens, logprobs, tops, offsets = zip(*entries) if entries else ((), (), (), ())
    return {"tokens": list(tokens), "token_logprobs": list(logprobs), "top_logprobs": list(tops),
            "text_offset": list(offsets)}
