"""Faults and checks for chaos runs against a LocalCluster (used by scripts/chaos.py and tests/cluster/test_chaos.py).

    faults   sigkill_worker, sigstop_worker (past the lease), restart_etcd(keep_data),
             restart_corrupting (--corrupt-transfer-every 1), pinned_flood
    checks   wait_ready (bounded recovery), quiet_pools (check_integrity, nothing pinned
             at rest), routes_naming (no route names a gone worker), pids_alive
Each fault returns the seconds from its injection to full service again.
Knows nothing of the oracle: prefixpool/testing/chaos_client.py judges the answers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.model.source import tokenizer_for
from prefixpool.contract.worker_api import AUTH_HEADER, Done, Failed, FetchPlan, GenerateRequest, SamplingParams, Usage
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.membership import NodeRecord, decode_record
from prefixpool.router.worker_client import WorkerClient
from prefixpool.testing.chaos_client import ApiClient, Outcome, steady_load

LEASE_TTL_S = 3
WORKER_ARGS = ("--lease-ttl-s", str(LEASE_TTL_S), "--num-blocks", "48", "--max-batch-size", "4")


class NotRecovered(AssertionError):
    """The cluster did not come back within its bound."""


def cluster_for(num_workers: int = 3, token: str = "", extra_worker_args: tuple[str, ...] = ()) -> LocalCluster:
    worker_args = WORKER_ARGS + (("--token", token) if token else ()) + extra_worker_args
    router_args = ("--worker-token", token) if token else ()
    return LocalCluster(num_workers, worker_args=worker_args, router_args=router_args)


async def wait_until(predicate, timeout_s: float, what: str, period_s: float = 0.2) -> float:
    """Poll an async predicate; the seconds it took, or NotRecovered."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if await predicate():
                return time.monotonic() - started
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        await asyncio.sleep(period_s)
    raise NotRecovered(f"{what} not within {timeout_s}s")


async def wait_ready(client: ApiClient, num_workers: int, timeout_s: float = 60.0) -> float:
    """Until the router sees `num_workers` workers and a fresh request is answered."""
    async def ready() -> bool:
        status, body = await client.get_json("/readyz")
        return (status == 200 and body["workers"] == num_workers
                and (await client.complete("ping", salt=str(time.time()))).answered)
    return await wait_until(ready, timeout_s, f"{num_workers} workers serving")


async def pool_reports(cluster: LocalCluster, token: str = "") -> dict[str, dict]:
    headers = {AUTH_HEADER: token} if token else {}
    reports = {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as session:
        for node_id, child in cluster.workers.items():
            async with session.get(f"{child.url}/debug/pool") as response:
                assert response.status == 200, f"{node_id} /debug/pool answered {response.status}"
                reports[node_id] = await response.json()
    return reports


async def quiet_pools(cluster: LocalCluster, token: str = "", timeout_s: float = 30.0) -> dict[str, dict]:
    """Reports once no request is in flight anywhere; asserts integrity and zero pins at rest."""
    latest: dict[str, dict] = {}

    async def quiet() -> bool:
        latest.update(await pool_reports(cluster, token))
        return all(r["num_streams"] == 0 and r["num_pinned"] == 0 for r in latest.values())

    try:
        await wait_until(quiet, timeout_s, "pools at rest")
    except NotRecovered as err:
        raise NotRecovered(f"{err}: {latest}") from None
    for node_id, report in latest.items():
        assert report["integrity"] == "ok", f"{node_id}: {report['integrity']}"
    return latest


async def routes_naming(client: ApiClient, prompts: list[str], node_id: str) -> list[dict]:
    """Route decisions for `prompts` that would run on, or fetch from, `node_id`."""
    bad = []
    for prompt in prompts:
        status, plan = await client.post_json("/v1/route", {"model": "tiny", "prompt": prompt})
        if status == 200 and (plan["worker"] == node_id or (plan["fetch"] or {}).get("from") == node_id
                              or plan["matches"].get(node_id, 0) > 0):
            bad.append(plan)
    return bad


async def blocks_of(client: ApiClient, prompts: list[str], node_id: str) -> int:
    total = 0
    for prompt in prompts:
        status, plan = await client.post_json("/v1/route", {"model": "tiny", "prompt": prompt})
        total += plan["matches"].get(node_id, 0) if status == 200 else 0
    return total


def pids_alive(pids: list[int]) -> list[int]:
    """Of `pids`, those that still exist (and are not zombies)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


# -- phases --------------------------------------------------------------------------------------

async def under_load(client: ApiClient, prompts: list[str], fault, max_requests: int,
                     concurrency: int = 3, pause_s: float = 0.2) -> tuple[list[Outcome], object]:
    """Run `fault()` while paced clients send at most `max_requests`; stop them when it returns."""
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(client, prompts, stop, concurrency, max_requests, pause_s=pause_s))
    await asyncio.sleep(0.5)  # the fault lands on a loaded cluster
    try:
        result = await fault()
        await asyncio.sleep(1.0)  # some requests after the recovery, too
    finally:
        stop.set()
    return await load, result


async def spawn_worker(cluster: LocalCluster, node_id: str) -> None:
    await asyncio.to_thread(cluster.start_worker, node_id)  # processes.spawn forks on its own long-lived thread


async def sigkill_worker(cluster: LocalCluster, client: ApiClient, node_id: str) -> float:
    began = time.monotonic()
    child = cluster.workers[node_id]
    os.kill(child.pid, signal.SIGKILL)
    await asyncio.to_thread(child.process.wait)
    await spawn_worker(cluster, node_id)
    await wait_ready(client, len(cluster.workers))
    return time.monotonic() - began


async def sigstop_worker(cluster: LocalCluster, client: ApiClient, node_id: str, prompts: list[str]) -> float:
    """Stopped past its lease: it leaves the index; while gone no route names it; back after SIGCONT."""
    pid = cluster.workers[node_id].pid
    n = len(cluster.workers)
    os.kill(pid, signal.SIGSTOP)
    try:
        async def gone() -> bool:
            status, body = await client.get_json("/readyz")
            return body["workers"] == n - 1
        await wait_until(gone, LEASE_TTL_S * 4 + 5, f"{node_id} leaving the index")
        for _ in range(2):  # while it is gone, with the load still running
            named = await routes_naming(client, prompts, node_id)
            assert not named, f"a route names the stopped {node_id}: {named[0]}"
            await asyncio.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
    await wait_ready(client, n)
    recovery = time.monotonic() - resumed

    async def republished() -> bool:
        return await blocks_of(client, prompts, node_id) > 0
    await wait_until(republished, 30, f"{node_id} re-publishing its blocks")
    return recovery


async def restart_etcd(cluster: LocalCluster, client: ApiClient, keep_data: bool, prompts: list[str]) -> float:
    began = time.monotonic()
    await asyncio.to_thread(cluster.etcd.restart, keep_data)
    await wait_ready(client, len(cluster.workers))

    async def republished() -> bool:
        return all([await blocks_of(client, prompts, node) > 0 for node in cluster.workers])
    await wait_until(republished, 60, "every worker's blocks back in the index")
    return time.monotonic() - began


async def restart_corrupting(cluster: LocalCluster, client: ApiClient, node_id: str) -> float:
    """Restart `node_id` so that every block it serves to peers is damaged on the wire."""
    child = cluster.workers[node_id]
    await asyncio.to_thread(child.stop)
    base = cluster.worker_args
    cluster.worker_args = base + ("--corrupt-transfer-every", "1")
    try:
        await spawn_worker(cluster, node_id)
    finally:
        cluster.worker_args = base
    return await wait_ready(client, len(cluster.workers))


async def warm_directly(cluster: LocalCluster, node_id: str, prompts: list[str], salt: str, token: str = "") -> None:
    """Fill one worker's pool through its internal API, so that it alone holds these prompts' blocks."""
    for i, prompt in enumerate(prompts):
        await generate_directly(cluster, node_id, prompt, salt, request_id=f"warm-{i}", max_tokens=1, token=token)


async def generate_directly(cluster: LocalCluster, node_id: str, prompt: str, salt: str, request_id: str,
                            max_tokens: int, fetch_from: str = "", token: str = "") -> tuple[list[int], Usage]:
    """One request on `node_id` through its internal API, greedy; with `fetch_from`, told to fetch every full
    block of the prompt from that peer first (its transfer address read from the peer's etcd record)."""
    tokens = tokenizer_for("").encode(prompt)
    fetch = None
    if fetch_from:
        peer = await node_record(cluster, fetch_from)
        fetch = FetchPlan(peer=fetch_from, transfer_url=peer.transfer_url, start=0, end=len(tokens) // peer.block_size)
    request = GenerateRequest(request_id=request_id, tokens=tokens, cache_salt=salt, fetch=fetch,
                              sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    client, sampled = WorkerClient(token, read_timeout_s=60), []
    try:
        async for event in client.generate(cluster.workers[node_id].url, request):
            assert not isinstance(event, Failed), f"{node_id} failed {request_id}: {event}"
            if isinstance(event, Done):
                return sampled, event.usage
            sampled.append(event.token)
    finally:
        await client.close()
    raise AssertionError(f"{node_id} ended {request_id} without a done event")


async def node_record(cluster: LocalCluster, node_id: str) -> NodeRecord:
    """`node_id`'s record as etcd holds it now (any namespace)."""
    client = EtcdClient(cluster.etcd.endpoint)
    try:
        snapshot = await client.get_prefix(b"/prefixpool/")
    finally:
        await client.close()
    for kv in snapshot.kvs:
        if b"/nodes/" in kv.key and (record := decode_record(kv.value)).node_id == node_id:
            return record
    raise AssertionError(f"no node record of {node_id} in etcd")


async def pinned_flood(client: ApiClient, num_requests: int, prompt_chars: int = 330,
                       max_tokens: int = 24) -> list[Outcome]:
    """Many concurrent long requests on small pools: they wait for blocks, or fail cleanly."""
    prompts = [f"{i:03d} " + ("long shared context line. " * 40)[:prompt_chars] for i in range(num_requests)]
    prompts.append("x" * 48 * 16 + "an impossible one: larger than any pool")
    outcomes = await asyncio.gather(*(client.complete(p, max_tokens=max_tokens) for p in prompts))
    return list(outcomes)
