"""Quantiles of a Prometheus histogram, as the benchmarks read them off a live /metrics page."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from prefixpool.testing.prometheus import buckets, quantile

BOUNDS = (0.001, 0.002, 0.005, 0.01)


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does():
    cumulative = {0.001: 5.0, 0.002: 10.0, math.inf: 10.0}
    assert quantile(cumulative, 0.5) == 0.001
    assert quantile(cumulative, 0.75) == 0.0015
    assert quantile(cumulative, 0.25) == 0.0005
    assert quantile({0.001: 0.0, 0.002: 4.0, math.inf: 8.0}, 0.9) == 0.002  # past the last bound: the bound
    assert math.isnan(quantile({}, 0.5)) and math.isnan(quantile({0.001: 0.0, math.inf: 0.0}, 0.5))


def test_buckets_read_off_a_metrics_page_give_the_samples_quantiles_to_a_bucket():
    registry = CollectorRegistry()
    histogram = Histogram("x_seconds", "x", ["phase"], buckets=BOUNDS, registry=registry)
    rng = np.random.default_rng(0)
    samples = rng.uniform(0.0015, 0.0045, size=400)
    for value in samples:
        histogram.labels("a").observe(float(value))
    histogram.labels("b").observe(0.009)
    page = generate_latest(registry)

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        counts = buckets(url, "x_seconds", 'phase="a"')
        assert buckets(url, "x_seconds", 'phase="none"') == {}
    finally:
        server.shutdown()
        server.server_close()
    assert counts[math.inf] == 400 and counts[0.001] == 0
    for q in (0.5, 0.9):
        truth = float(np.quantile(samples, q))
        bucket = next(b for b in (*BOUNDS, math.inf) if truth <= b)
        lower = max([0.0, *(b for b in BOUNDS if b < bucket)])
        assert lower <= quantile(counts, q) <= bucket, (q, truth, quantile(counts, q))
