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
