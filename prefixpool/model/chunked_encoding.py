r"""Exact encoding of a long text in chunks, each chunk's ids kept for the next text that repeats it.

Shared prompts repeat as text: a router tokenizes the same system prompt, few-shot block or RAG
document with every request. A byte-level BPE tokenizer cuts text into pieces with one regex and
encodes each piece on its own; where every piece ends and the next begins regardless of what
follows, the text can be encoded chunk by chunk with the same ids as whole.

    cut:    before a single space that follows a character no regex engine counts as whitespace
            ("x|_", "a.|_b", "7|_", "\ufffd|_"), the first one at least MIN_CHUNK_CHARS after the
            previous cut (content-defined: two texts that share a beginning share its chunks,
            whatever comes after)
    encode: ids(text) = ids(chunk 0) + ids(chunk 1) + ..., each chunk's ids from the cache
            or encoded (all the missing ones in one call), then kept (least recently used
            chunk out first)

Why a cut there is exact, for the tokenizers `refusal` accepts (no normalizer but NFC; a
pre-tokenizer that is GPT-2's byte-level regex or a Split on one of KNOWN_SPLITS followed by a
byte-level mapping; a BPE model without dropout; added tokens without spaces and without
lstrip/rstrip/single_word; no truncation or padding; encoded without special tokens, so no
post-processor). Call the character before the cut X and the space S:
- no piece holds both X and S. In each of these regexes a space is matched only as the first
  character of a match (the optional leading `[^\r\n\p{L}\p{N}]?` or ` ?`) or inside a run of
  whitespace only (`\s+`, `\s+(?!\S)`, `\s*[\r\n]+`); every other part (letters, digits,
  contractions, `[^\s\p{L}\p{N}]+`, `[\r\n/]*`) excludes it. A match holding X is not a
  whitespace run (X is not whitespace) and does not start at S, so it ends at X;
- so a match starts at S, and none of the regexes looks behind or anchors: the matches of the
  rest of the text from S are those of the chunk that starts there. Before S, the match that
  ends at X ends there whether S or the chunk's end follows (each part that can end at X is a
  greedy run of a class that holds neither); the only lookahead, `(?!\S)`, follows whitespace,
  which X ends;
- NFC leaves S alone and composes nothing across it (a space is a starter that is never the
  second part of a composition), so it normalizes chunk by chunk as whole; an added token cannot
  straddle the cut (it would hold the space).
"Whitespace" for X is the union of every engine's (Python's `str.isspace`, Unicode's White_Space,
Oniguruma's and Rust's `\s`) and the zero-width characters some of them once counted
(U+180E, U+200B-U+200D, U+2060, U+FEFF). tests/unit/test_chunked_encoding.py checks it on drawn
texts for every known regex, against the tokenizer encoding the whole text.

Anything else (Metaspace/SentencePiece tokenizers, other regexes, WordPiece, Unigram) is refused
and encoded whole, as before. Knows nothing of routers or models.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Callable

import numpy as np

from prefixpool.store.keys import TOKEN_DTYPE

MIN_CHUNK_CHARS = 64
MAX_CACHED_CHUNKS = 8192  # about 100 characters and 100 ids each: a few MB
MAX_CACHED_CHARS = 1024  # a longer chunk (text with few spaces: CJK, long tokens) is encoded, not kept: <= ~40 MB
NOT_SPACE = r"[^\s\u180e\u200b-\u200d\u2060\ufeff]"  # Python's \s (str) holds Unicode's White_Space and \x1c-\x1f
CUT = re.compile(f"(?<={NOT_SPACE}) ")

# Split regexes (tokenizer.json's pre_tokenizer pattern) that match a space only first or among whitespace:
KNOWN_SPLITS = {
    "cl100k (Llama 3)": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "Qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "o200k": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def refusal(spec: dict) -> str | None:
    """Why a tokenizer (its tokenizer.json as a dict) cannot be encoded in chunks; None if it can."""
    if spec.get("truncation") or spec.get("padding"):
        return "truncation or padding is set"
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"normalizer {normalizer.get('type')}"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return f"model {model.get('type')} (dropout {model.get('dropout')})"
    for token in spec.get("added_tokens") or []:
        if " " in token["content"] or token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"added token {token['content']!r} has a space or strips or matches single words"
    return _pre_tokenizer_refusal(spec.get("pre_tokenizer"))


def _pre_tokenizer_refusal(pre: dict | None) -> str | None:
    if pre is None:
        return "no pre-tokenizer"
    if pre.get("type") == "ByteLevel":  # GPT-2's own regex when use_regex
        if pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            return None
        return "ByteLevel without its regex, or adding a prefix space"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return f"pre-tokenizer {pre.get('type')}"
    split, byte_level = steps
    if split.get("type") != "Split" or byte_level.get("type") != "ByteLevel":
        return f"pre-tokenizers {split.get('type')}, {byte_level.get('type')}"
    if byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return "ByteLevel after a Split must neither split again nor add a prefix space"
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return f"Split behaviour {split.get('behavior')} (invert {split.get('invert')})"
    if (split.get("pattern") or {}).get("Regex") not in KNOWN_SPLITS.values():
        return "Split on a regex not known to match a space only first or among whitespace"
    return None


def cuts(text: str, min_chars: int = MIN_CHUNK_CHARS) -> list[int]:
    """Where `text` is cut: each the first "non-whitespace|space" at least min_chars after the last."""
    found, last = [], 0
    while (match := CUT.search(text, last + min_chars)) is not None:
        last = match.start()
        found.append(last)
    return found


class ChunkedEncoder:
    """encode(text) -> int32 ids, equal to encode_batch([text])[0] for a tokenizer `refusal` accepts.

    The chunks not cached are encoded one call each: the tokenizers library runs a batch of two or more on
    its thread pool, whose threads sleep between a router's requests; waking them cost 0.03-0.14 ms at the
    median for two ~55-character chunks after 30 ms idle (scripts/bench_cold_calls.py, benchmarks/tokenize.md;
    the host's own wake-up varies more), and a router's concurrency is across requests anyway."""

    def __init__(self, encode_batch: Callable[[list[str]], list[list[int]]], min_chars: int = MIN_CHUNK_CHARS,
                 max_chunks: int = MAX_CACHED_CHUNKS, max_chars: int = MAX_CACHED_CHARS) -> None:
        self._encode_batch, self.min_chars, self.max_chunks = encode_batch, min_chars, max_chunks
        self.max_chars = max_chars
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.num_hits = self.num_misses = 0  # chunks

    def encode(self, text: str) -> np.ndarray:
        bounds = cuts(text, self.min_chars)
        if not bounds:
            return np.array(self._encode_batch([text])[0], dtype=TOKEN_DTYPE)
        chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
        parts: list[np.ndarray | None] = []
        for chunk in chunks:
            ids = self._cache.get(chunk)
            if ids is not None:
                self._cache.move_to_end(chunk)
            parts.append(ids)
        missing = [i for i, ids in enumerate(parts) if ids is None]
        self.num_hits += len(chunks) - len(missing)
        self.num_misses += len(missing)
        if missing:
            for i in missing:  # one call each: a batch of several wakes the tokenizer's thread pool (above)
                parts[i] = np.array(self._encode_batch([chunks[i]])[0], dtype=TOKEN_DTYPE)
                if len(chunks[i]) <= self.max_chars:
                    self._cache[chunks[i]] = parts[i]
            while len(self._cache) > self.max_chunks:
                self._cache.popitem(last=False)
        return np.concatenate(parts)
