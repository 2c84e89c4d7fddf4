"""Chaos: faults injected into a live cluster under steady load, with the cold-output oracle.

    python scripts/chaos.py --requests 300 --rounds 2      (long run; prints a markdown table)

Phases (each under load from prefixpool.testing.chaos_client.steady_load):
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
tests/cluster/test_chaos.py runs the quick versions of the same functions.

    python scripts/chaos.py --rolling-restart --requests 600

Rolling restarts instead (prefixpool/testing/chaos_rolling.py): 3 workers and 2 routers behind
a BalancedClient, streaming load; every worker, then every router, is drained by
SIGTERM in turn (each while it has work in flight) and started again. Goal: every
request answered in full, none wrong; reports the longest drain.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.testing.chaos_client import ApiClient, BalancedClient, Oracle, Tally, steady_load, workload
from prefixpool.testing.chaos_rolling import DrainRecord, rolling_restart_routers, rolling_restart_workers
from prefixpool.testing.chaos_faults import (
    cluster_for, pids_alive, pinned_flood, pool_reports, quiet_pools, restart_corrupting, restart_etcd,
    sigkill_worker, sigstop_worker, spawn_worker, under_load, wait_ready, warm_directly,
)


@dataclass
class PhaseResult:
    name: str
    tally: Tally
    recovery_s: float
    pools_ok: bool
    note: str = ""


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


HEADER = ("| fault | requests | served | clean failures (503/4xx) | unclean | wrong outputs | recovery s "
          "| pools at rest | note |\n"
          "|---|---|---|---|---|---|---|---|---|")


def print_row(result: PhaseResult) -> None:
    t = result.tally
    print(f"| {result.name} | {t.requests} | {t.served} | {t.clean_failures} | {len(t.dirty)} | {len(t.wrong)} | "
          f"{result.recovery_s:.1f} | {'integrity ok, 0 pinned' if result.pools_ok else 'BROKEN'} | {result.note} |",
          flush=True)


# -- rolling restarts ------------------------------------------------------------------------------

ROLLING_HEADER = ("| restarted in turn, under load | requests | served in full | clean failures | unclean "
                  "| wrong outputs | drains (busy at SIGTERM) | exit codes | longest drain s "
                  "| longest SIGTERM to exit s |\n"
                  "|---|---|---|---|---|---|---|---|---|---|")


async def run_rolling(cluster: LocalCluster, requests: int, max_tokens: int = 32) -> list[PhaseResult]:
    prompts = workload(12)
    client = BalancedClient([c.url for c in cluster.routers.values()])
    results = []
    try:
        await wait_ready(client, len(cluster.workers))
        oracle = await Oracle.build(client, prompts, max_tokens=max_tokens)
        for name, restart in (("every worker", rolling_restart_workers), ("both routers", rolling_restart_routers)):
            stop = asyncio.Event()
            load = asyncio.create_task(steady_load(client, prompts, stop, 3, requests, stream_every=1,
                                                   max_tokens=max_tokens, pause_s=0.05))
            await asyncio.sleep(0.5)
            try:
                drains = await restart(cluster, client)
                await asyncio.sleep(1.0)
            finally:
                stop.set()
            tally = Tally.of(await load, oracle)
            await quiet_pools(cluster)
            longest_drain = max(d.drain_s if d.drain_s is not None else float("nan") for d in drains)
            note = f"{_drains_note(drains)} | {longest_drain:.2f}"
            results.append(PhaseResult(name, tally, max(d.seconds for d in drains), True, note))
            print_rolling_row(results[-1])
    finally:
        await client.close()
    return results


def _drains_note(drains: list[DrainRecord]) -> str:
    busy = ", ".join(f"{d.name} ({d.busy_at_sigterm})" for d in drains)
    return f"{busy} | {', '.join(str(d.exit_code) for d in drains)}"


def print_rolling_row(result: PhaseResult) -> None:
    t = result.tally
    print(f"| {result.name} | {t.requests} | {t.served} | {t.clean_failures} | {len(t.dirty)} | {len(t.wrong)} | "
          f"{result.note} | {result.recovery_s:.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="chaos rounds against a local cluster (3 workers)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=120, help="at most this many requests per phase")
    parser.add_argument("--rolling-restart", action="store_true",
                        help="instead: drain-restart every worker, then both of two routers, under streaming load")
    args = parser.parse_args()
    cluster = cluster_for(3).start()
    pids = [cluster.etcd.pid, cluster.router.pid]
    try:
        if args.rolling_restart:
            cluster.start_router("router-b")
            print(ROLLING_HEADER, flush=True)
            results = asyncio.run(run_rolling(cluster, args.requests))
        else:
            print(HEADER, flush=True)
            results = asyncio.run(run_rounds(cluster, args.rounds, args.requests))
    finally:
        pids += [c.pid for c in [*cluster.workers.values(), *cluster.routers.values()]]
        cluster.stop()
    total = sum((r.tally for r in results), Tally())
    left = pids_alive(pids)
    print(f"| **total** | {total.requests} | {total.served} | {total.clean_failures} | {len(total.dirty)} | "
          f"{len(total.wrong)} | | | leftover processes: {len(left)} |")
    for bad in (total.wrong + total.dirty)[:5]:
        print("BAD:", bad)
    lost = args.rolling_restart and total.served != total.requests  # a graceful restart loses nothing
    return 0 if not total.wrong and not total.dirty and not left and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
