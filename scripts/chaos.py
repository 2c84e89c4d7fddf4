"""Chaos: faults injected into a live cluster under steady load, with the cold-output oracle.

    python scripts/chaos.py --requests 300 --rounds 2      (long run; prints a markdown table)

Phases (each under load from scripts/chaos_client.steady_load):
    baseline          no fault
    sigkill           SIGKILL a worker, start it again
    sigstop           SIGSTOP a worker past its lease TTL; while gone no route names it;
                      SIGCONT: it re-registers and re-publishes its blocks
    etcd_keep/wipe    restart etcd keeping / wiping its data
    corrupt           a worker restarted with --corrupt-transfer-every 1 (every block it
                      serves to a peer has a flipped byte on the wire)
    pinned            many concurrent long requests on a small pool
After each: answered == cold output, failures clean (503/4xx + JSON), recovery
within a bound, every pool passes check_integrity with no block pinned at rest.
tests/test_chaos.py runs the quick versions of the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.launcher import LocalCluster  # noqa: E402
from cluster.model_source import tokenizer_for  # noqa: E402
from router.worker_api import AUTH_HEADER  # noqa: E402
from scripts.chaos_client import ApiClient, Oracle, Outcome, Tally, steady_load, workload  # noqa: E402

LEASE_TTL_S = 3
# Children die with the *thread* that spawned them (PR_SET_PDEATHSIG follows the thread, not the
# process), so workers are restarted from this one thread, which lives as long as the process:
# asyncio.to_thread's executor is shut down by asyncio.run, and its workers would die with it.
SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="chaos-spawner")
WORKER_ARGS = ("--lease-ttl-s", str(LEASE_TTL_S), "--num-blocks", "48", "--max-batch-size", "4")


class NotRecovered(AssertionError):
    """The cluster did not come back within its bound."""


@dataclass
class PhaseResult:
    name: str
    tally: Tally
    recovery_s: float
    pools_ok: bool
    note: str = ""


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
        return status == 200 and body["workers"] == num_workers and (await client.complete("ping", salt=str(time.time()))).answered
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
    await asyncio.get_running_loop().run_in_executor(SPAWNER, cluster.start_worker, node_id)


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
    tokenizer = tokenizer_for("")
    headers = {AUTH_HEADER: token} if token else {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for i, prompt in enumerate(prompts):
            request = {"request_id": f"warm-{i}", "tokens": tokenizer.encode(prompt), "max_tokens": 1, "cache_salt": salt}
            async with session.post(f"{cluster.workers[node_id].url}/generate", json=request) as response:
                assert response.status == 200, await response.text()
                await response.read()


async def pinned_flood(client: ApiClient, num_requests: int, prompt_chars: int = 330, max_tokens: int = 24) -> list[Outcome]:
    """Many concurrent long requests on small pools: they wait for blocks, or fail cleanly."""
    prompts = [f"{i:03d} " + ("long shared context line. " * 40)[:prompt_chars] for i in range(num_requests)]
    prompts.append("x" * 48 * 16 + "an impossible one: larger than any pool")
    outcomes = await asyncio.gather(*(client.complete(p, max_tokens=max_tokens) for p in prompts))
    return list(outcomes)


# -- the long run ----------------------------------------------------------------------------------

async def run_rounds(cluster: LocalCluster, rounds: int, requests: int) -> list[PhaseResult]:
    prompts = workload(12)
    client = ApiClient(cluster.router_url)
    results: list[PhaseResult] = []
    try:
        await wait_ready(client, len(cluster.workers))
        oracle = await Oracle.build(client, prompts)
        for r in range(rounds):
            victim = f"worker-{r % len(cluster.workers)}"
            phases = {
                "baseline": lambda: asyncio.sleep(5),
                f"SIGKILL {victim}": lambda: sigkill_worker(cluster, client, victim),
                f"SIGSTOP {victim} > lease, SIGCONT": lambda: sigstop_worker(cluster, client, victim, prompts),
                "etcd restart, data kept": lambda: restart_etcd(cluster, client, True, prompts),
                "etcd restart, data wiped": lambda: restart_etcd(cluster, client, False, prompts),
                f"{victim} corrupts every block it serves": lambda: restart_corrupting(cluster, client, victim),
            }
            for name, fault in phases.items():
                outcomes, recovery = await under_load(client, prompts, fault, requests)
                if "corrupts" in name:
                    salt = f"tenant-{r}"
                    await warm_directly(cluster, victim, prompts, salt)
                    outcomes += await steady_load(client, prompts, asyncio.Event(), 4, requests, salt=salt)
                    corrupted = (await pool_reports(cluster))[victim]["corrupted_blocks_sent"]
                    await spawn_restart(cluster, client, victim)  # back to an honest worker
                await quiet_pools(cluster)
                note = f"{corrupted} blocks corrupted in transit" if "corrupts" in name else ""
                results.append(PhaseResult(name, Tally.of(outcomes, oracle), recovery or 0.0, True, note))
                print_row(results[-1])
            flood = await pinned_flood(client, 12)
            flood_oracle = await Oracle.build(client, [o.prompt for o in flood if o.answered], max_tokens=24)
            await quiet_pools(cluster)
            tally = Tally.of(flood, flood_oracle)
            results.append(PhaseResult("pinned flood (12 long + 1 impossible)", tally, 0.0, True,
                                       f"impossible request answered {flood[-1].status}"))
            print_row(results[-1])
    finally:
        await client.close()
    return results


async def spawn_restart(cluster: LocalCluster, client: ApiClient, node_id: str) -> float:
    await asyncio.to_thread(cluster.workers[node_id].stop)
    await spawn_worker(cluster, node_id)
    return await wait_ready(client, len(cluster.workers))


HEADER = ("| fault | requests | served | clean failures (503/4xx) | unclean | wrong outputs | recovery s | pools at rest | note |\n"
          "|---|---|---|---|---|---|---|---|---|")


def print_row(result: PhaseResult) -> None:
    t = result.tally
    print(f"| {result.name} | {t.requests} | {t.served} | {t.clean_failures} | {len(t.dirty)} | {len(t.wrong)} | "
          f"{result.recovery_s:.1f} | {'integrity ok, 0 pinned' if result.pools_ok else 'BROKEN'} | {result.note} |",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="chaos rounds against a local cluster (3 workers)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=120, help="at most this many requests per phase")
    args = parser.parse_args()
    cluster = cluster_for(3).start()
    pids = [cluster.etcd.pid, cluster.router.pid]
    print(HEADER, flush=True)
    try:
        results = asyncio.run(run_rounds(cluster, args.rounds, args.requests))
    finally:
        pids += [c.pid for c in cluster.workers.values()]
        cluster.stop()
    total = sum((r.tally for r in results), Tally())
    left = pids_alive(pids)
    print(f"| **total** | {total.requests} | {total.served} | {total.clean_failures} | {len(total.dirty)} | "
          f"{len(total.wrong)} | | | leftover processes: {len(left)} |")
    for bad in (total.wrong + total.dirty)[:5]:
        print("BAD:", bad)
    return 0 if not total.wrong and not total.dirty and not left else 1


if __name__ == "__main__":
    sys.exit(main())
