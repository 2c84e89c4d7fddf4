"""What one engine step carries: the scheduled spans in, logits out, token events back.

    Batch [span(seq A, positions 40..41), span(seq B, 0..300), ...]
      -> packed model inputs: tokens, positions, the PagedLayout of their blocks, rows to take logits of
      -> StepOutput: logits of the spans that end at their sequence's last token,
                     and the requests whose span failed (prefixpool/engine/isolation.py)
      -> TokenEvent per sampled token (with its logprobs, when its request asked)

A span snapshots its tokens and block table at schedule time, so the forward
pass reads no request state that the caller may change meanwhile. Knows
nothing of the pool, nor of how tokens are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixpool.engine.paged_attention import PagedLayout, Span, build_layout
from prefixpool.engine.sampling import TokenLogprobs
from prefixpool.engine.sequence import RequestStats, Sequence


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: int
    token: int
    finished: bool
    finish_reason: str | None = None   # "stop" | "length" on the final event
    stats: RequestStats | None = None  # on the final event
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True, slots=True)
class ScheduledSpan:
    seq: Sequence
    start: int
    end: int
    store_from: int
    block_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    sample: bool  # the span ends at the sequence's last token: its logits give the next one


@dataclass(frozen=True)
class Batch:
    spans: list[ScheduledSpan]

    def model_inputs(self, device: torch.device,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, PagedLayout, torch.Tensor]:
        """(packed tokens, their positions, their paged layout, rows whose logits are wanted)."""
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[Span] = []
        logit_rows: list[int] = []
        for item in self.spans:
            spans.append(Span(len(tokens), item.start, item.end, item.store_from, item.block_ids))
            tokens.extend(item.tokens)
            positions.extend(range(item.start, item.end))
            if item.sample:
                logit_rows.append(len(tokens) - 1)
        return (torch.tensor(tokens, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), build_layout(spans, block_size, device),
                torch.tensor(logit_rows, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [spans that sample, vocab], fp32 on the CPU
    failed: dict[int, str] = field(default_factory=dict)  # request id -> why its span failed (its row is zeros)
