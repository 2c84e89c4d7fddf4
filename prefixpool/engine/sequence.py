"""One request inside the engine: its tokens, its blocks, how far its KV has got.

    positions  0 ......... num_computed ......... num_stored ......... len(tokens)
               [ forward has run here ][ K,V already in the arena ][ still to compute ]

`num_stored` can run ahead of `num_computed` only when a whole prompt was a
cache hit: its K,V are all in the arena, but the last position must still run
through the model to get logits (it runs query-only and writes nothing).
Blocks [0, num_committed) of its hold answer for their keys in the pool. Knows
nothing of the pool's internals, the model or the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixpool.engine.sampling import Sampler, SamplingParams
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import Hold


@dataclass(frozen=True)
class RequestStats:
    num_prompt_tokens: int
    num_cached_tokens: int    # prompt tokens not recomputed (the OpenAI `cached_tokens`)
    num_computed_tokens: int  # prompt tokens that ran through the model
    num_output_tokens: int
    ttft_s: float | None      # submit to first token, queueing included


@dataclass(eq=False)
class Sequence:
    request_id: int
    tokens: list[int]               # prompt, then every sampled token
    num_prompt_tokens: int
    params: SamplingParams
    sampler: Sampler
    keys: list[BlockKey]            # keys of full blocks so far, prompt first
    submitted_at: float
    keep_logits: bool = False
    hold: Hold = field(default_factory=Hold)  # its blocks in position order, once admitted
    num_computed: int = 0
    num_stored: int = 0
    num_committed: int = 0
    last_stored: BlockKey | None = None  # the last key its commits stored: its chain's tail once it ends
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    first_logits: torch.Tensor | None = None
    aborted: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks for every position whose K,V may be written: prompt + max_tokens - 1."""
        positions = self.num_prompt_tokens + self.params.max_tokens - 1
        return -(-positions // block_size)

    def stats(self) -> RequestStats:
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        return RequestStats(
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_computed_tokens=self.num_prompt_tokens - self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            ttft_s=ttft,
        )
