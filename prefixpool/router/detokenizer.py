"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decodes the whole output each time and emits the new suffix; holds text back
while it ends in an incomplete UTF-8 sequence (shown as U+FFFD), so a
multi-byte character split across tokens is never sent half-made.
TokenTexts names single tokens for logprobs answers as vLLM (0.32) names them:
decode([id]), except where that ends in U+FFFD (part of a multi-byte
character), which is read after the up to 4 tokens sampled before it:

    sampled  0xC3 ("\ufffd" alone)   0xA9 ("\ufffd" alone)
    named    ""                      "é"     (decode([0xC3, 0xA9]) minus the context's own text)
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._sent = 0

    def push(self, token: int) -> str:
        """Add one token; return the text that became final."""
        self.tokens.append(token)
        text = self._decode(self.tokens)
        if text.endswith(REPLACEMENT):
            return ""
        delta, self._sent = text[self._sent:], len(text)
        return delta

    def flush(self) -> str:
        text = self._decode(self.tokens)
        delta, self._sent = text[self._sent:], len(text)
        return delta

    @property
    def text(self) -> str:
        return self._decode(self.tokens)


class TokenTexts:
    """id -> the token's own text, cached: the same alternatives come back token after token."""

    MAX_CONTEXT = 4  # tokens: enough for any UTF-8 sequence

    def __init__(self, decode: Callable[[list[int]], str], max_size: int = 1 << 16) -> None:
        self._decode = decode
        self._text = functools.lru_cache(maxsize=max_size)(lambda token: decode([token]))

    def __call__(self, token: int, context: Sequence[int] = ()) -> str:
        """The token's text after `context` (the tokens sampled before it, oldest first)."""
        text = self._text(token)
        return self._completed(token, context) if text.endswith(REPLACEMENT) else text

    def _completed(self, token: int, context: Sequence[int]) -> str:
        """What this token adds to the shortest context it completes a character with; "" if none."""
        recent = list(context)[-self.MAX_CONTEXT:]
        for num_context in range(1, len(recent) + 1):
            tail = recent[-num_context:]
            whole = self._decode(tail + [token])
            if whole.endswith(REPLACEMENT):
                continue
            clean = len(tail)  # context tokens before the character's other parts
            while clean and self._text(tail[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self._decode(tail[:clean]) if clean else ""
            return whole[len(prefix):] if whole.startswith(prefix) else whole[_common_length(prefix, whole):]
        return ""


def _common_length(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
