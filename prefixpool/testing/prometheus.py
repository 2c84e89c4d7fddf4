"""Counters read off a Prometheus /metrics page, for benchmarks that compare servers' own figures."""

from __future__ import annotations

import urllib.request


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Counters from a Prometheus /metrics page, summed over their labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def buckets(url: str, name: str, label: str) -> dict[float, float]:
    """A histogram's cumulative counts {upper bound: count} for its series whose labels include `label` (e.g.
    'phase="prepare"'); empty where the page has no such series."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    counts: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{") and label in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[float(bound)] = float(line.rsplit(" ", 1)[1])
    return counts


def quantile(cumulative: dict[float, float], q: float) -> float:
    """The q-quantile of a histogram's cumulative counts, linear within a bucket (as Prometheus'
    histogram_quantile); nan without observations."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if cumulative[bound] >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative[bound] - below, 1e-12)
        lower, below = bound, cumulative[bound]
    return lower
