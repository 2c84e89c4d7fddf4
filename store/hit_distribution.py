"""The distribution of per-request hit fractions: a fixed-bucket histogram and exact quantiles.

    fraction = cached prompt tokens / prompt tokens, one value per request

A mean hides a bimodal cache (half the requests fully cached, half cold);
p50 / p90 / p99 do not. The histogram has Prometheus' shape (cumulative
`le` buckets, sum, count) so the router can export it as is, and estimates
quantiles from its buckets; `exact_quantiles` serves a replay report that
keeps every value. Knows nothing of HTTP, routers or traces.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

DEFAULT_BOUNDS = tuple(i / 20 for i in range(21))  # 0.0, 0.05, ..., 1.0
# For a hit fraction the bad tail is the low end: report p1 and p10 beside p50 / p90 / p99.
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)


def hit_fraction(cached_tokens: int, prompt_tokens: int) -> float:
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0


def exact_quantiles(values: Sequence[float], qs: Sequence[float] = QUANTILES) -> dict[float, float]:
    """Nearest-rank quantiles of every recorded value (NaN for no values)."""
    ordered = sorted(values)
    if not ordered:
        return {q: math.nan for q in qs}
    return {q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in qs}


@dataclass(slots=True)
class HitHistogram:
    bounds: tuple[float, ...] = DEFAULT_BOUNDS
    counts: list[int] = field(default_factory=list)  # counts[i]: values in (bounds[i-1], bounds[i]]
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(self.bounds) and self.bounds[-1] >= 1.0, "bounds must rise to >= 1.0"
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"a hit fraction is in [0, 1], got {fraction}")
        self.counts[bisect.bisect_left(self.bounds, fraction)] += 1
        self.total += fraction
        self.num += 1

    @property
    def mean(self) -> float:
        return self.total / self.num if self.num else math.nan

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-th value (what Prometheus' histogram_quantile bounds)."""
        if not self.num:
            return math.nan
        rank = max(1, math.ceil(q * self.num))
        seen = 0
        for bound, count in zip(self.bounds, self.counts):
            seen += count
            if seen >= rank:
                return bound
        return self.bounds[-1]

    def summary(self) -> dict[str, float]:
        return {"mean": self.mean, **{f"p{round(q * 100)}": self.quantile(q) for q in QUANTILES}}

    def prometheus(self, name: str, help_text: str) -> str:
        """Exposition-format text: HELP, TYPE, cumulative buckets, +Inf, sum and count."""
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        seen = 0
        for bound, count in zip(self.bounds, self.counts):
            seen += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {seen}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.num}', f"{name}_sum {self.total:g}", f"{name}_count {self.num}"]
        return "\n".join(lines) + "\n"
