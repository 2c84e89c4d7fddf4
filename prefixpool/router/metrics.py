"""The router's Prometheus metrics, one registry per router (no process globals).

Under `--processes N` (PROMETHEUS_MULTIPROC_DIR set before prometheus_client
is imported) every process writes its values to shared files and `render`
reads all of them: counters and histograms add up, per-worker gauges are the
sum over live processes, cluster-wide gauges the maximum. Knows nothing of
HTTP handlers; they call the `observe_*` methods.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
OVERHEAD_BUCKETS = (2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3,
                    5e-3, 0.01, 0.025, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixpool_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("prefixpool_ttft_seconds", "Time to first token seen by the router",
                              buckets=TTFT_BUCKETS, registry=r)
        self.overhead = Histogram(
            "prefixpool_router_overhead_seconds", "The router's own time on a request's path, by phase: 'prepare' "
            "from its head read until tokenized and hashed, 'decide' choosing its worker (the first try), 'relay' "
            "from the worker's first token reaching the router until its frame is written (streams)", ["phase"],
            buckets=OVERHEAD_BUCKETS, registry=r)
        self.prepare_s, self.decide_s, self.relay_s = (self.overhead.labels(p) for p in ("prepare", "decide", "relay"))
        self.prompt_tokens = Counter("prefixpool_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("prefixpool_cached_tokens", "Prompt tokens not recomputed (local hit or fetched)",
                                     registry=r)
        self.fetched_tokens = Counter("prefixpool_fetched_tokens", "Prompt tokens whose KV was fetched from a peer",
                                      registry=r)
        self.fetched_bytes = Counter("prefixpool_fetched_bytes", "KV bytes moved between workers", registry=r)
        self.hit_fraction = Histogram("prefixpool_hit_fraction", "Per-request fraction of prompt tokens not recomputed",
                                      buckets=FRACTION_BUCKETS, registry=r)
        self.planned_blocks = Counter("prefixpool_planned_hit_blocks", "Prompt blocks the route counted on reusing",
                                      registry=r)
        self.missed_blocks = Counter("prefixpool_missed_hit_blocks", "Planned blocks the worker recomputed "
                                     "(evicted after the index saw them, or a failed fetch)", registry=r)
        self.missed_plans = Counter("prefixpool_missed_plans", "Requests that reused fewer blocks than planned",
                                    registry=r)
        self.unplanned_blocks = Counter("prefixpool_unplanned_hit_blocks", "Blocks reused beyond the plan "
                                        "(stored before the index learned them)", registry=r)
        self.forgone_blocks = Counter("prefixpool_forgone_hit_blocks", "Blocks some node held for the prompt that "
                                      "the route did not count on (sent elsewhere for load)", registry=r)
        self.retries = Counter("prefixpool_retries", "Requests retried on another worker", registry=r)
        self.handoffs = Counter("prefixpool_pd_handoffs", "Disaggregated requests: prefilled on a prefill node, "
                                "decoded on a decode node", registry=r)
        self.handoff_bytes = Counter("prefixpool_pd_handoff_bytes", "KV bytes moved from prefill to decode nodes",
                                     registry=r)
        self.handoff_seconds = Histogram("prefixpool_pd_handoff_seconds", "A decode node's wait from the request's "
                                         "arrival until the prefill node's blocks were in", buckets=TTFT_BUCKETS,
                                         registry=r)
        self.role_inflight = Gauge("prefixpool_role_inflight", "Requests in flight per node role (prefill, decode, "
                                   "both)", ["role"], registry=r, multiprocess_mode="livesum")
        self.inflight = Gauge("prefixpool_worker_inflight", "Requests in flight per worker", ["worker"], registry=r,
                              multiprocess_mode="livesum")
        self.queued_tokens = Gauge("prefixpool_worker_queued_prefill_tokens", "Prefill tokens queued per worker",
                                   ["worker"], registry=r, multiprocess_mode="livesum")
        self.workers = Gauge("prefixpool_workers", "Workers registered in etcd", registry=r,
                             multiprocess_mode="livemax")
        self.index_keys = Gauge("prefixpool_index_keys", "Block keys in the router's index mirror", registry=r,
                                multiprocess_mode="livemax")
        self.mirror_lag = Gauge("prefixpool_mirror_lag_seconds", "Seconds since the mirror last applied an etcd event",
                                registry=r, multiprocess_mode="livemax")

    def observe_usage(self, prompt_tokens: int, cached_tokens: int, fetched_tokens: int, fetched_bytes: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.fetched_tokens.inc(fetched_tokens)
        self.fetched_bytes.inc(fetched_bytes)
        if prompt_tokens:
            self.hit_fraction.observe(cached_tokens / prompt_tokens)

    def observe_plan(self, planned_blocks: int, cached_blocks: int, held_blocks: int) -> None:
        """The route's expected reuse against the worker's report (what the index promised and did not
        hold), and against the fleet's (`held_blocks`: the longest prefix any node held, reusable)."""
        self.planned_blocks.inc(planned_blocks)
        self.forgone_blocks.inc(max(0, held_blocks - planned_blocks))
        if cached_blocks < planned_blocks:
            self.missed_blocks.inc(planned_blocks - cached_blocks)
            self.missed_plans.inc()
        else:
            self.unplanned_blocks.inc(cached_blocks - planned_blocks)

    def observe_handoff(self, num_bytes: int, seconds: float) -> None:
        """A decode node's Usage of a disaggregated request: what it received, and how long it waited."""
        self.handoff_bytes.inc(num_bytes)
        self.handoff_seconds.observe(seconds)

    def render(self) -> bytes:
        shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not shared_dir:
            return generate_latest(self.registry)
        everyone = CollectorRegistry()
        multiprocess.MultiProcessCollector(everyone, path=shared_dir)
        return generate_latest(everyone)
