"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decodes the whole output each time and emits the new suffix; holds text back
while it ends in an incomplete UTF-8 sequence (shown as U+FFFD), so a
multi-byte character split across tokens is never sent half-made.
"""

from __future__ import annotations

from typing import Callable

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
