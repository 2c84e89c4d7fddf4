"""Rolling restarts under load: every worker, then every router, drained by SIGTERM in turn and started again.

    drains = await rolling_restart_workers(cluster, client)   # one DrainRecord per worker, in turn
    drains = await rolling_restart_routers(cluster, client)   # each back on its own port

A graceful restart must lose nothing: while steady load runs, every request is
answered in full (no failure at all, clean or not) and equals the cold output.
Each SIGTERM waits until the victim has work in flight (a worker: a stream in
its pool report; a router: a request in its in-flight gauge), so every drain
has something to finish. Used by scripts/chaos.py --rolling-restart and
tests/cluster/test_drain.py. Knows nothing of the oracle: prefixpool/testing/chaos_client.py judges.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.processes import Child
from prefixpool.testing.chaos_client import ApiClient
from prefixpool.testing.chaos_faults import NotRecovered, spawn_worker, wait_ready, wait_until


@dataclass(frozen=True)
class DrainRecord:
    name: str
    busy_at_sigterm: int  # streams (worker) or requests (router) in flight just before SIGTERM
    seconds: float  # SIGTERM -> process exited (interpreter teardown included)
    exit_code: int
    drain_s: float | None  # SIGTERM -> nothing admitted any more, as the process logged it
    log_tail: str = ""  # the process's last log lines when it did not exit cleanly (its log dir goes with the test)


def logged_drain_s(log_path: Path) -> float | None:
    """The drain time the component logged ("... drained in 0.42s ...") before it exited."""
    found = re.findall(r"drained in ([0-9.]+)s", log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url) as response:
            return response.status, await response.text()


async def worker_streams(child: Child) -> int:
    status, text = await _get(f"{child.url}/debug/pool")
    return int(json.loads(text)["num_streams"]) if status == 200 else 0


async def router_inflight(child: Child) -> int:
    """The sum of the router's per-worker in-flight gauge (GET /metrics)."""
    _, text = await _get(f"{child.url}/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("prefixpool_worker_inflight{")))


async def drain(child: Child, busy, busy_timeout_s: float = 30.0) -> DrainRecord:
    """Once `busy(child)` > 0: SIGTERM, and wait (off the loop) for the process to exit."""
    found: list[int] = []

    async def has_work() -> bool:
        found.append(await busy(child))
        return found[-1] > 0
    try:
        await wait_until(has_work, busy_timeout_s, f"{child.name} having work in flight", period_s=0.01)
    except NotRecovered as err:
        raise NotRecovered(f"{err} ({len(found)} polls answered, exit code {child.process.poll()}, "
                           f"log tail: {child.log_path.read_text(errors='replace')[-2000:]!r})") from err
    began = time.monotonic()
    await asyncio.to_thread(child.stop)
    seconds = time.monotonic() - began
    code = child.process.returncode
    tail = "" if code == 0 else child.log_path.read_text(errors="replace")[-3000:]
    return DrainRecord(child.name, found[-1], seconds, code, logged_drain_s(child.log_path), tail)


async def rolling_restart_workers(cluster: LocalCluster, client: ApiClient) -> list[DrainRecord]:
    records = []
    for node_id in list(cluster.workers):
        records.append(await drain(cluster.workers[node_id], worker_streams))
        await spawn_worker(cluster, node_id)
        await wait_ready(client, len(cluster.workers))
    return records


async def rolling_restart_routers(cluster: LocalCluster, client: ApiClient) -> list[DrainRecord]:
    records = []
    for name in list(cluster.routers):
        port = cluster.routers[name].url.rsplit(":", 1)[1]
        records.append(await drain(cluster.routers[name], router_inflight))
        await asyncio.to_thread(cluster.start_router, name, int(port))  # processes.spawn forks on its own thread
        await wait_ready(client, len(cluster.workers))
    return records
