"""Choosing the next token from logits, and deciding when a request stops.

    temperature < 1e-5      greedy (argmax)
    temperature >= 1e-5     softmax(logits / T), cut to the smallest set of tokens whose
                            probability reaches top_p, drawn with the request's own generator
    stop                    "stop" at EOS or a stop id, "length" at max_tokens

A seeded request draws the same tokens on every run and every worker,
whatever else shares its batch. The parameters are the wire contract's SamplingParams
(router -> worker -> engine, one struct). Knows nothing of models, pools or batches.
"""

from __future__ import annotations

import torch

from prefixpool.contract.worker_api import SamplingError, SamplingParams

__all__ = ["Sampler", "SamplingError", "SamplingParams", "top_p_filter"]
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: logits / 1e-40 overflow fp32 to inf, and softmax of those is NaN


class Sampler:
    """One request's sampler: its parameters, its random generator, its stop rule."""

    def __init__(self, params: SamplingParams, eos_token_id: int | None) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        stop = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop.add(eos_token_id)
        self.stop_ids = frozenset(stop)

    def sample(self, logits: torch.Tensor) -> int:
        """One token from fp32 CPU logits [vocab]."""
        if self.params.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            probs = top_p_filter(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def finish_reason(self, token: int, num_output_tokens: int) -> str | None:
        if token in self.stop_ids:
            return "stop"
        if num_output_tokens >= self.params.max_tokens:
            return "length"
        return None


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus; the most likely token always stays."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
