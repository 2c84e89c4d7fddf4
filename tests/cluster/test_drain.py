"""Graceful drains: rolling restarts lose nothing, and a drain past its deadline ends streams cleanly.

The gate itself (prefixpool/contract/drain.py) first, in one event loop; then one
live cluster (etcd, 3 workers, two routers behind a BalancedClient that uses
both) under steady streaming load: every worker, then every router, restarted
by SIGTERM in turn, each while it has work in flight. Oracle: every answer
equals the prompt's cold output; every request is answered in full. Last, a
worker whose drain deadline is 0 cuts the stream it holds with an error event
that reaches the client before `[DONE]`, and exits 0. And `prefixpool up`
drains on SIGTERM: a stream running then completes, and no process is left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from prefixpool.deploy.processes import die_with_parent
from prefixpool.contract.drain import Drain, DrainDeadline, Draining
from prefixpool.testing.chaos_client import BalancedClient, Oracle, Tally, steady_load, workload
from prefixpool.testing.chaos_faults import (cluster_for, pids_alive, quiet_pools, spawn_worker, wait_ready,
                                             warm_directly)
from prefixpool.testing.chaos_rolling import rolling_restart_routers, rolling_restart_workers, worker_streams

pytestmark = pytest.mark.timeout(300)
PROMPTS = workload(9)
MAX_TOKENS = 32  # streams long enough that a SIGTERM finds some in flight
STARTED_PIDS: list[int] = []


# -- the gate ----------------------------------------------------------------------------------------

def test_gate_refuses_new_work_and_lets_admitted_work_finish():
    async def run() -> None:
        gate = Drain()
        finished = asyncio.Event()

        async def admitted_stream() -> None:
            async with gate.admitted(), gate.until_deadline():
                await asyncio.sleep(0.05)
            finished.set()

        task = asyncio.create_task(admitted_stream())
        await asyncio.sleep(0)  # admitted before the drain begins
        assert gate.num_admitted == 1
        gate.begin(deadline_s=60)
        with pytest.raises(Draining):
            async with gate.admitted():
                pass
        report = await gate.wait()
        await task
        assert finished.is_set() and report.idle and report.num_admitted == 1 and report.num_cut == 0
    asyncio.run(run())


def test_gate_cuts_what_outlives_the_deadline():
    async def run() -> None:
        gate = Drain()
        outcome: list[str] = []

        async def endless_stream() -> None:
            async with gate.admitted():
                try:
                    async with gate.until_deadline():
                        await asyncio.Event().wait()  # never ends by itself
                except DrainDeadline:
                    outcome.append("cut")  # the handler's chance to write its error event

        task = asyncio.create_task(endless_stream())
        await asyncio.sleep(0)
        gate.begin(deadline_s=0.01)
        report = await gate.wait()
        await task
        assert outcome == ["cut"] and report.num_cut == 1 and report.idle
    asyncio.run(run())


# -- a live cluster ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_for(3).start()
    try:
        cluster.start_router("router-b")
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
    STARTED_PIDS.extend(c.pid for c in [*cluster.routers.values(), *cluster.workers.values()])
    assert pids_alive(sorted(set(STARTED_PIDS))) == []


def balanced(cluster) -> BalancedClient:
    return BalancedClient([c.url for c in cluster.routers.values()])


@pytest.fixture(scope="module")
def oracle(cluster) -> Oracle:
    async def build() -> Oracle:
        client = balanced(cluster)
        try:
            await wait_ready(client, 3)
            return await Oracle.build(client, PROMPTS, max_tokens=MAX_TOKENS)
        finally:
            await client.close()
    return asyncio.run(build())


def restart_under_load(cluster, oracle: Oracle, restart) -> tuple[Tally, list]:
    """Streaming load through both routers while `restart` runs; then the verdict and the pools at rest."""
    async def phase():
        client = balanced(cluster)
        stop = asyncio.Event()
        try:
            load = asyncio.create_task(steady_load(client, PROMPTS, stop, 3, 5000, stream_every=1,
                                                   max_tokens=MAX_TOKENS, pause_s=0.05))
            await asyncio.sleep(0.5)
            restarting = asyncio.create_task(restart(cluster, client))
            try:
                await asyncio.wait([restarting, load], return_when=asyncio.FIRST_COMPLETED)
                # a load that ended first (out of requests, or raised) leaves nothing to drain: say so
                assert restarting.done(), f"the load ended before the restarts did: {load!r}"
                records = restarting.result()
                await asyncio.sleep(1.0)  # requests after the last restart, too
            finally:
                stop.set()
                if not restarting.done():
                    restarting.cancel()
                    await asyncio.gather(restarting, return_exceptions=True)
            outcomes = await load
            await quiet_pools(cluster)
            return Tally.of(outcomes, oracle), records
        finally:
            STARTED_PIDS.extend(c.pid for c in [*cluster.routers.values(), *cluster.workers.values()])
            await client.close()
    return asyncio.run(phase())


def assert_lost_nothing(tally: Tally, records: list) -> None:
    assert tally.wrong == [], f"wrong outputs: {tally.wrong[:3]}"
    assert tally.dirty == [], f"unclean failures: {tally.dirty[:3]}"
    assert tally.served == tally.requests > 0, f"{tally.requests - tally.served} requests not answered in full"
    for record in records:
        assert record.exit_code == 0, record
        assert record.busy_at_sigterm > 0, record  # the drain had something to finish


def test_rolling_restart_of_every_worker_loses_nothing(cluster, oracle):
    tally, records = restart_under_load(cluster, oracle, rolling_restart_workers)
    assert_lost_nothing(tally, records)
    assert [r.name for r in records] == ["worker-0", "worker-1", "worker-2"]


def test_rolling_restart_of_both_routers_loses_nothing(cluster, oracle):
    tally, records = restart_under_load(cluster, oracle, rolling_restart_routers)
    assert_lost_nothing(tally, records)
    assert [r.name for r in records] == ["router", "router-b"]


def test_a_drain_past_its_deadline_ends_the_stream_with_an_error_event(cluster, oracle):
    """worker-2 restarted with --drain-deadline-s 0: SIGTERM cuts its stream at once, cleanly."""
    async def run() -> tuple[list[str], int]:
        child = cluster.workers["worker-2"]
        await asyncio.to_thread(child.stop)
        base = cluster.worker_args
        cluster.worker_args = base + ("--drain-deadline-s", "0")
        try:
            await spawn_worker(cluster, "worker-2")
        finally:
            cluster.worker_args = base
        STARTED_PIDS.append(cluster.workers["worker-2"].pid)
        client = balanced(cluster)
        try:
            await wait_ready(client, 3)
            return await _cut_a_stream(cluster, "worker-2")
        finally:
            await client.close()

    lines, exit_code = asyncio.run(run())
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503, events[-1]
    assert "drain deadline" in events[-1]["error"]["message"]
    # a frame per token; its text is "" while the token ends inside a UTF-8 character (random bytes often do)
    assert any("text" in choice for e in events[:-1] for choice in e.get("choices", ())), "no token before the cut"
    assert exit_code == 0

    async def honest_again() -> None:  # back without the zero deadline; every pool at rest
        await spawn_worker(cluster, "worker-2")
        STARTED_PIDS.append(cluster.workers["worker-2"].pid)
        await quiet_pools(cluster)
    asyncio.run(honest_again())


async def _cut_a_stream(cluster, node_id: str) -> tuple[list[str], int]:
    """A long stream through the router that lands on `node_id` (warmed there; retried until it runs there); SIGTERM
    `node_id` once it streams; the SSE lines the client got, and the worker's exit code."""
    child = cluster.workers[node_id]
    body = {"model": "tiny", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for attempt in range(30):
            text, salt = f"cut me {attempt}: " + PROMPTS[attempt % len(PROMPTS)], f"cut-{attempt}"
            await warm_directly(cluster, node_id, [text], salt)  # it alone holds the prefix: routed there
            prompt = {**body, "prompt": text, "cache_salt": salt}
            async with session.post(f"{cluster.router_url}/v1/completions", json=prompt) as response:
                assert response.status == 200
                first = await response.content.readline()  # the first chunk: a token is out
                if await worker_streams(child) == 0:
                    continue  # it runs elsewhere; let it finish and try another prompt
                stopping = asyncio.create_task(asyncio.to_thread(child.stop))
                lines = [first.decode().strip()] + [raw.decode().strip() async for raw in response.content]
                await stopping
                return [line for line in lines if line], child.process.returncode
    raise AssertionError(f"no stream landed on {node_id} in 30 tries")


def test_prefixpool_up_drains_on_sigterm():
    """`prefixpool up`: a stream running at SIGTERM still completes, then everything exits (etcd last)."""
    up = subprocess.Popen([sys.executable, "-m", "prefixpool.deploy.cli", "up", "--workers", "1"],
                          stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        url = _up_url(up)
        children = _children(up.pid)
        # etcd, a worker and the router (the janitors of its temp dirs are detached: nobody's children)
        assert sorted(_kind(pid) for pid in children) == ["etcd", "router", "worker"]

        async def stream_across_sigterm() -> list[str]:
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    lines = [(await response.content.readline()).decode().strip()]  # a token is out
                    up.send_signal(signal.SIGTERM)
                    lines += [raw.decode().strip() async for raw in response.content]
            return [line for line in lines if line]

        lines = asyncio.run(stream_across_sigterm())
        assert up.wait(timeout=120) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and not any("error" in c for c in chunks), lines[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0].get("text")) > 1
    assert pids_alive(children) == []


def _up_url(up: subprocess.Popen) -> str:
    for line in up.stdout:  # bounded: up exits (closing stdout) if it cannot start
        if line.startswith("prefixpool is up: "):
            return line.split()[3]
    raise AssertionError(f"prefixpool up did not start (exit {up.wait()})")


def _kind(pid: int) -> str:
    """What a child of `prefixpool up` is, from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    if Path(argv[0]).name == "etcd":
        return "etcd"
    return next(word for word in ("worker", "router") if word in argv)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found
