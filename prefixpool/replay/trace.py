"""Mooncake-format request traces: load records and turn their block ids into keys and tokens.

    {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [chained 512-token block ids]}

Identical ids give identical keys (and identical token ids, for live replay),
in any process. Knows nothing of routers or simulations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefixpool.store.keys import BlockKey, Namespace, chain_ids

TRACE_BLOCK_TOKENS = 512
TRACES_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read a JSONL trace; a bare name ('conversation') means the copy in benchmarks/traces/."""
    path = Path(path)
    if not path.exists() and (TRACES_DIR / f"{path.name}_trace.jsonl").exists():
        path = TRACES_DIR / f"{path.name}_trace.jsonl"
    records = []
    with open(path) as lines:
        for number, line in enumerate(lines):
            if limit is not None and number >= limit:
                break
            raw = json.loads(line)
            records.append(TraceRecord(int(raw["timestamp"]), int(raw["input_length"]),
                                       int(raw["output_length"]), tuple(raw["hash_ids"])))
    return records


def keys_of(record: TraceRecord, namespace: Namespace, sub_blocks: int = 1) -> list[BlockKey]:
    """The record's chained keys; `sub_blocks` > 1 splits each 512-token block into that many smaller ones
    (32: 16-token blocks, as a real fleet keys them) and keeps those that start within input_length."""
    if sub_blocks == 1:
        return chain_ids(record.hash_ids, namespace)
    num = min(len(record.hash_ids) * sub_blocks, -(-record.input_length * sub_blocks // TRACE_BLOCK_TOKENS))
    return chain_ids([hash_id * sub_blocks + j for hash_id in record.hash_ids for j in range(sub_blocks)][:num],
                     namespace)


def tokens_of(record: TraceRecord, block_tokens: int, vocab_size: int, input_length: int | None = None) -> list[int]:
    """Deterministic token ids: block i of the record gets tokens seeded by its hash id.

    `block_tokens` may be smaller than 512 to scale a trace down for CPU workers;
    the prompt is then len(hash_ids) * block_tokens tokens, cut to `input_length`.
    """
    parts = [np.random.default_rng(hash_id).integers(1, vocab_size, block_tokens) for hash_id in record.hash_ids]
    tokens = np.concatenate(parts).tolist() if parts else []
    return tokens[: input_length] if input_length is not None else tokens
