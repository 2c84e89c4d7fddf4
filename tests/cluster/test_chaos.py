"""Chaos, quick cases: one live cluster (etcd, 3 workers, router) and faults under steady load.

Oracle: a request answered under any fault equals the same prompt's cold output
(fresh cache_salt, greedy). After each fault: failures are clean 503/4xx, the
cluster serves again within a bound, every pool passes check_integrity and no
block stays pinned at rest; at the end no process is left. The long runs are
scripts/chaos.py.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prefixpool.testing.chaos_faults import (
    cluster_for,
    generate_directly,
    pids_alive,
    pinned_flood,
    quiet_pools,
    restart_corrupting,
    restart_etcd,
    sigkill_worker,
    sigstop_worker,
    under_load,
    wait_ready,
    warm_directly,
)
from prefixpool.testing.chaos_client import ApiClient, Oracle, Tally, steady_load, workload

pytestmark = pytest.mark.timeout(240)
PROMPTS = workload(9)
STARTED_PIDS: list[int] = []


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_for(3).start()
    STARTED_PIDS.extend([cluster.etcd.pid, cluster.router.pid, *(c.pid for c in cluster.workers.values())])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def oracle(cluster) -> Oracle:
    async def build() -> Oracle:
        client = ApiClient(cluster.router_url)
        try:
            await wait_ready(client, 3)
            return await Oracle.build(client, PROMPTS)
        finally:
            await client.close()
    return asyncio.run(build())


def run_phase(cluster, oracle: Oracle, fault=None, max_requests: int = 150) -> Tally:
    """Load (with `fault` injected while it runs), then the verdict and the pools at rest."""
    async def phase() -> Tally:
        client = ApiClient(cluster.router_url)
        try:
            if fault is None:
                outcomes = await steady_load(client, PROMPTS, asyncio.Event(), 3, 30)
            else:
                outcomes, _ = await under_load(client, PROMPTS, lambda: fault(client), max_requests)
            await quiet_pools(cluster)
            return Tally.of(outcomes, oracle)
        finally:
            await client.close()
    tally = asyncio.run(phase())
    STARTED_PIDS.extend(c.pid for c in cluster.workers.values())
    assert tally.wrong == [], f"wrong outputs: {tally.wrong[:3]}"
    assert tally.dirty == [], f"unclean failures: {tally.dirty[:3]}"
    assert tally.served > 0
    return tally


def test_steady_load_is_correct_and_reuses_the_cache(cluster, oracle):
    tally = run_phase(cluster, oracle)
    assert tally.served == tally.requests == 30
    assert tally.cached_tokens > 0  # the shared prefixes were reused


def test_sigkill_a_worker(cluster, oracle):
    run_phase(cluster, oracle, lambda client: sigkill_worker(cluster, client, "worker-1"))


def test_sigstop_past_the_lease_then_sigcont(cluster, oracle):
    run_phase(cluster, oracle, lambda client: sigstop_worker(cluster, client, "worker-2", PROMPTS))


@pytest.mark.parametrize("keep_data", [True, False], ids=["keep", "wipe"])
def test_restart_etcd(cluster, oracle, keep_data):
    run_phase(cluster, oracle, lambda client: restart_etcd(cluster, client, keep_data, PROMPTS))


def test_corrupt_blocks_in_transit_cost_a_recompute(cluster, oracle):
    """worker-0 alone holds a tenant's prefixes and damages every block it serves: peers must recompute."""
    run_phase(cluster, oracle, lambda client: restart_corrupting(cluster, client, "worker-0"), max_requests=60)

    async def tenant_load() -> list:
        await warm_directly(cluster, "worker-0", PROMPTS, salt="tenant-c")
        client = ApiClient(cluster.router_url)
        try:
            return await steady_load(client, PROMPTS, asyncio.Event(), 4, 36, salt="tenant-c")
        finally:
            await client.close()
    tally = Tally.of(asyncio.run(tenant_load()), oracle)
    assert tally.wrong == [] and tally.dirty == [] and tally.served == 36

    async def told_to_fetch() -> tuple:
        """The router may keep every request on worker-0 (it holds them all): a fetch from it, made sure of."""
        salt, prompt = f"fetch-{uuid.uuid4().hex}", PROMPTS[1]
        await warm_directly(cluster, "worker-0", [prompt], salt=salt)
        fetched = await generate_directly(cluster, "worker-1", prompt, salt, "told", 8, fetch_from="worker-0")
        cold = await generate_directly(cluster, "worker-2", prompt, f"cold-{uuid.uuid4().hex}", "cold", 8)
        return fetched, cold
    (tokens, usage), (cold_tokens, cold_usage) = asyncio.run(told_to_fetch())
    assert tokens == cold_tokens and usage.fetched_tokens == 0 and usage.local_hit_tokens == 0
    assert usage.computed_tokens == cold_usage.computed_tokens == usage.prompt_tokens  # every damaged block redone
    report = asyncio.run(quiet_pools(cluster))
    assert report["worker-0"]["corrupted_blocks_sent"] > 0, "no fetch was served by the corrupting worker"
    assert all(r["corrupted_blocks_sent"] == 0 for n, r in report.items() if n != "worker-0")


def test_pool_full_of_pinned_blocks(cluster, oracle):
    async def flood():
        client = ApiClient(cluster.router_url)
        try:
            outcomes = await pinned_flood(client, 10)
            flood_oracle = await Oracle.build(client, [o.prompt for o in outcomes if o.answered], max_tokens=24)
            await quiet_pools(cluster)
            return outcomes, flood_oracle
        finally:
            await client.close()
    outcomes, flood_oracle = asyncio.run(flood())
    tally = Tally.of([o for o in outcomes if o.answered], flood_oracle)
    assert tally.wrong == [] and tally.served >= 10
    impossible = outcomes[-1]
    assert impossible.status == 400 and impossible.clean_failure, impossible


def test_no_process_is_left(cluster):
    cluster.stop()
    assert pids_alive(sorted(set(STARTED_PIDS))) == []
