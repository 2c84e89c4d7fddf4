"""The hit-fraction histogram against exact quantiles of the same values."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.hit_distribution import HitHistogram, exact_quantiles, hit_fraction


def test_a_bimodal_cache_shows_in_the_tail_not_the_mean():
    hist = HitHistogram()
    for i in range(100):
        hist.observe(1.0 if i % 10 else 0.0)
    summary = hist.summary()
    assert summary["mean"] == pytest.approx(0.9)
    assert (summary["p50"], summary["p90"], summary["p99"]) == (1.0, 1.0, 1.0)
    assert (summary["p1"], summary["p10"]) == (0.0, 0.0)  # one request in ten got nothing
    assert exact_quantiles([1.0 if i % 10 else 0.0 for i in range(100)], [0.1, 0.11]) == {0.1: 0.0, 0.11: 1.0}


def test_prometheus_text_is_cumulative_and_ends_with_inf():
    hist = HitHistogram(bounds=(0.5, 1.0))
    for value in (0.0, 0.25, 0.75, 1.0):
        hist.observe(value)
    text = hist.prometheus("prefixpool_hit_fraction", "per-request hit fraction")
    assert 'prefixpool_hit_fraction_bucket{le="0.5"} 2' in text
    assert 'prefixpool_hit_fraction_bucket{le="1"} 4' in text
    assert 'prefixpool_hit_fraction_bucket{le="+Inf"} 4' in text
    assert "prefixpool_hit_fraction_sum 2" in text and text.endswith("prefixpool_hit_fraction_count 4\n")


def test_edges_and_errors():
    assert hit_fraction(0, 0) == 0.0 and hit_fraction(16, 32) == 0.5
    assert math.isnan(HitHistogram().quantile(0.5)) and math.isnan(exact_quantiles([])[0.9])
    with pytest.raises(ValueError):
        HitHistogram().observe(1.5)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(0, 1), min_size=1, max_size=200), q=st.sampled_from([0.5, 0.9, 0.99]))
def test_bucket_quantile_bounds_the_exact_one_within_a_bucket(values, q):
    hist = HitHistogram()
    for value in values:
        hist.observe(value)
    exact = exact_quantiles(values, [q])[q]
    estimate = hist.quantile(q)
    assert exact <= estimate < exact + 0.05 + 1e-9
    assert hist.num == len(values) and sum(hist.counts) == len(values)
