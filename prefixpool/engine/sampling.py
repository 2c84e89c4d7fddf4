"""Choosing the next token from logits, and deciding when a request stops.

    temperature < 1e-5      greedy (argmax)
    temperature >= 1e-5     softmax(logits / T), cut to the smallest set of tokens whose
                            probability reaches top_p, drawn with the request's own generator
    stop                    "stop" at EOS or a stop id, "length" at max_tokens
    logprobs (if asked)     log_softmax of the fp32 logits themselves, before temperature and top-p
                            (vLLM's default `raw_logprobs`): the sampled token's and the N most likely
                            tokens', ordered by logit, ties to the lower id, as argmax breaks them, so
                            a greedy token is always the first of its top list

A seeded request draws the same tokens on every run and every worker,
whatever else shares its batch. The parameters are the wire contract's SamplingParams
(router -> worker -> engine, one struct). Knows nothing of models, pools or batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixpool.contract.worker_api import SamplingError, SamplingParams

__all__ = ["Sampler", "SamplingError", "SamplingParams", "TokenLogprobs", "token_logprobs", "top_p_filter"]
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: logits / 1e-40 overflow fp32 to inf, and softmax of those is NaN
LOGPROB_FLOOR = -9999.0  # vLLM's floor in its answers: -inf (and NaN) have no JSON number


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    logprob: float                        # of the sampled token
    top: tuple[tuple[int, float], ...]    # (token id, logprob) of the most likely tokens, most likely first


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

    def logprobs(self, logits: torch.Tensor, token: int) -> TokenLogprobs | None:
        """The sampled token's logprobs, if the request asked; nothing is computed otherwise."""
        if self.params.logprobs is None:
            return None
        return token_logprobs(logits, token, self.params.logprobs)

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


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """Raw logprobs (log_softmax in fp32 of logits [vocab]) of `token` and of the `num_top` most likely tokens."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    top = _most_likely(logits, min(num_top, logits.numel()))
    values = logprobs[top].tolist()
    return TokenLogprobs(_floored(float(logprobs[token])),
                         tuple((i, _floored(v)) for i, v in zip(top.tolist(), values)))


def _most_likely(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits, largest first, ties to the lower id (torch.topk leaves tie order open)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    cut = torch.topk(logits, k).values[-1]
    candidates = torch.nonzero(logits >= cut).flatten()  # ascending ids; more than k when the k-th value ties
    order = torch.sort(logits[candidates], descending=True, stable=True).indices
    return candidates[order[:k]]


def _floored(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the comparison: floored too
