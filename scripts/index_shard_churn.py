"""bench_index.py's shards section: block churn over 1 vs 2 etcd clusters (index shards), mirror lag p99 < 100 ms.

    nodes (this process)                   etcd servers (own, loopback)      router mirror (another process)
    4 nodes, each a ShardedPublisher  -->  shard 0, shard 1             -->  one ShardedMirror watching both,
    (a Publisher and a lease per shard)                                      timestamps each put it applies

The load steps, the lag measure and "sustained" are the churn section's (scripts/index_churn.py):
`gpus` Llama-3-8B H100s' churn (1,562.5 new 16-token blocks/s each, as many evicted) offered for a
few seconds; sustained when the generator kept its rate, nothing was dropped or lost, lag p99 <
100 ms. Here the same steps run against one etcd server and against two, in one run, for
per-block publication (etcd-bound: what sharding relieves) and for the coalesced run-granular one.

Everything shares this machine's cores: two etcd servers, the nodes' event loop and the mirror
process compete for them, so 1 -> 2 shards measures what sharding gains here, a floor for
shards on machines of their own (docs/how-it-works.md, "Index shards").

What sharding divides is measured too, per etcd server (the processes the section started, by pid):
over each step's churn and flush, the etcd ops the publishers wrote to each shard and that server's
CPU seconds (utime + stime from /proc/<pid>/stat: Linux only). Per step it prints ops/s and etcd
CPU per 1,000 ops per shard and the busiest server's CPU / wall; at the top step both shard counts
sustained, rows give each server's CPU (and, for 2 shards, the ops split and each server's CPU as a
share of the 1-shard server's) and the capacity per etcd server core: etcd ops per etcd CPU second
over etcd ops per GPU, the GPUs one etcd server saturating one core absorbs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time

from index_churn import BEFORE, GPU_OPS_PER_S, Setting, Step, after, offer

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.meta.index import BlockIndex
from prefixpool.meta.sharded_mirror import ShardedIndex


def paired_ladder(servers: list[EtcdServer], setting: Setting, gpu_steps: list[int], seconds: float,
                  tries: int = 1) -> dict[int, dict[int, Step]]:  # fmt: skip
    """Each step against 1 shard, then at once against 2 (the same machine load for both), rising while
    either still sustains it; a step gets up to `tries` tries (other load only ever lowers what a step
    sustains, as in index_churn.try_step), each recording its etcd servers' ops and CPU; {shards: {gpus: step}}."""
    endpoints, pids = [server.endpoint for server in servers], [server.pid for server in servers]
    steps: dict[int, dict[int, Step]] = {1: {}, 2: {}}
    for gpus in gpu_steps:
        for shards in (1, 2):
            ran = steps[shards]
            if ran and not ran[max(ran)].sustained:
                continue  # this one already failed a lower step
            for _ in range(tries):
                ns = f"shards{shards}r{setting.run_blocks}x{gpus}t{time.monotonic_ns()}"
                step = ran[gpus] = asyncio.run(offer(endpoints[:shards], ns, setting, gpus, seconds,
                                                     etcd_pids=pids[:shards]))  # fmt: skip
                if step.sustained:
                    break
            print(f"  {shards} shard(s), {setting.name}: {gpus} GPUs -> {step.offered_ops_s:,.0f} block ops/s, "
                  f"etcd {step.etcd_ops_s:,.0f} ops/s, lag p50 {step.p50_ms:.1f} p99 {step.p99_ms:.1f} ms, "
                  f"{step.missing} missing; {per_server(step)}", file=sys.stderr, flush=True)
        if all(ran and not ran[max(ran)].sustained for ran in steps.values()):
            break
    return steps


def best(steps: dict[int, Step]) -> Step | None:
    """The largest step sustained with every lower one sustained too."""
    found = None
    for gpus in sorted(steps):
        if not steps[gpus].sustained:
            break
        found = steps[gpus]
    return found


def per_server(step: Step) -> str:
    """Per shard (a / b): etcd ops/s and etcd CPU per 1,000 ops; and the busiest etcd server's CPU / wall."""
    ops_s = " / ".join(f"{ops / step.window_s:,.0f}" for ops in step.shard_ops)
    per_kop = " / ".join(f"{1e6 * cpu / ops:.1f}" for cpu, ops in zip(step.etcd_cpu_s, step.shard_ops))
    return f"{ops_s} ops/s, {per_kop} ms etcd CPU per 1k ops, busiest etcd {_utilisation(step)[0]:.0%} of a core"


def _utilisation(step: Step) -> list[float]:
    """Each etcd server's CPU seconds per wall second over the step, busiest first."""
    return sorted((cpu / step.window_s for cpu in step.etcd_cpu_s), reverse=True)


def common_step(steps: dict[int, dict[int, Step]]) -> tuple[int, str]:
    """The top step both shard counts sustained (every lower one too), else the highest both ran; (gpus, which)."""
    one, two = best(steps[1]), best(steps[2])
    if one and two:
        return min(one.gpus, two.gpus), "the top step both sustained"
    return max(set(steps[1]) & set(steps[2])), "the highest step both ran; not sustained"


def _per_gpu_core(step: Step) -> str:
    """GPUs one etcd core absorbs: etcd ops per etcd CPU second / etcd ops per GPU (etcd ops per block op, both
    measured in the step, x a GPU's 3,125 block ops/s)."""
    per_cpu_s = sum(step.shard_ops) / sum(step.etcd_cpu_s)
    per_gpu = step.etcd_ops_s / step.offered_ops_s * GPU_OPS_PER_S
    return f"{per_cpu_s:,.0f} / {per_gpu:,.0f} = {per_cpu_s / per_gpu:,.0f} GPUs"


def _split_cell(one: Step, two: Step) -> str:
    """2 shards' ops split x:y, each server's CPU / wall, and that as a share of the 1-shard server's."""
    total, base = sum(two.shard_ops), _utilisation(one)[0]
    split = ":".join(f"{100 * ops / total:.0f}" for ops in two.shard_ops)
    cpus = [cpu / two.window_s for cpu in two.etcd_cpu_s]
    return (f"{' / '.join(f'{u:.2f}' for u in cpus)} (ops split {split}; each server's CPU "
            f"{' / '.join(f'{u / base:.0%}' for u in cpus)} of the 1-shard server's)")


def server_rows(name: str, steps: dict[int, dict[int, Step]]) -> list[tuple[str, str, str]]:
    """What sharding divides, measured per etcd server at the top common step (1 shard, 2 shards)."""
    gpus, which = common_step(steps)
    one, two = steps[1][gpus], steps[2][gpus]
    at = f"at {gpus} GPUs ({which})"
    return [
        (f"index shards, {name}: per etcd server {at}: ops/s (per shard), etcd CPU per 1,000 ops (per shard), "
         "busiest etcd server's CPU / wall", per_server(one), per_server(two)),
        (f"index shards, {name}: etcd CPU per shard {at}, CPU seconds per wall second (1 vs 2 shards)",
         f"{_utilisation(one)[0]:.2f} (one server)", _split_cell(one, two)),
        (f"index shards, {name}: capacity per etcd server core {at} = etcd ops per etcd CPU second / etcd ops "
         "per GPU (GPUs one etcd server saturating one core absorbs)", _per_gpu_core(one), _per_gpu_core(two)),
    ]


def _churn_cell(step: Step | None) -> str:
    if step is None:
        return "< lowest step"
    return f"{2 * step.stores_s:,.0f} ({step.gpus} GPUs; etcd wrote {step.etcd_ops_s:,.0f} ops/s)"


def _gpus(step: Step | None) -> float:
    return 0.0 if step is None else 2 * step.stores_s / GPU_OPS_PER_S


def _lag_cells(steps: dict[int, dict[int, Step]]) -> tuple[str, str, str]:
    """(metric, 1 shard, 2 shards) at the highest step both ran."""
    gpus = max(set(steps[1]) & set(steps[2]))
    one, two = steps[1][gpus], steps[2][gpus]
    return (f"mirror lag p50 / p99 at {gpus} GPUs (the highest step both ran)",
            f"{one.p50_ms:.1f} / {one.p99_ms:.1f} ms", f"{two.p50_ms:.1f} / {two.p99_ms:.1f} ms")


def _capacity_cell(step: Step | None) -> str:
    if step is None:
        return "< 1 GPU (no step sustained)"
    return f"{2 * step.stores_s:,.0f} / 3,125 per GPU = {_gpus(step):,.0f} GPUs"


def lookup_row() -> tuple[str, str, str]:
    """The router's longest_prefix over one index and over two shards' blocks in one (bench_index.py's timing)."""
    from bench_index import prompt_chains, time_longest_prefix

    chains = prompt_chains(8000)
    one, two = (time_longest_prefix(index, chains) for index in (BlockIndex(), ShardedIndex(2)))
    return ("index shards: longest_prefix at 8k tokens over 8 workers, wall (thread CPU) (before: one index, "
            "after: two shards' blocks in one shared index)", *(f"{wall:.1f} us ({cpu:.1f} us)"
                                                                         for wall, cpu in (one, two)))


def shard_rows(args) -> list[tuple[str, str, str]]:
    """Rows (metric, 1 etcd cluster, 2 etcd clusters) for bench_index.py."""
    print(f"  shards section: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=sys.stderr)
    lookup = lookup_row()
    runs = after(args.run_blocks)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(EtcdServer()) for _ in range(2)]
        tries = getattr(args, "churn_tries", 1)
        per_block = paired_ladder(servers, BEFORE, [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64], args.churn_seconds,
                                  tries)
        coalesced = paired_ladder(servers, runs, [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768],
                                  args.churn_seconds, tries)
    block1, block2 = best(per_block[1]), best(per_block[2])
    run1, run2 = best(coalesced[1]), best(coalesced[2])
    scaling = _gpus(block2) / _gpus(block1) if block1 else float("nan")
    run_scaling = _gpus(run2) / _gpus(run1) if run1 else float("nan")
    k = 4
    return [
        lookup,
        ("index shards, per block (txns of 128): sustainable block churn, stores + evictions/s, lag p99 < 100 ms "
         "(before: 1 etcd cluster, after: 2)", _churn_cell(block1), _churn_cell(block2)),
        ("index shards, per block: " + _lag_cells(per_block)[0], *_lag_cells(per_block)[1:]),
        ("index shards, per block: scaling 1 -> 2 etcd clusters on this 2-core machine", "1.00x", f"{scaling:.2f}x"),
        *server_rows("per block", per_block),
        (f"index shards, {runs.name}: sustainable block churn (before: 1 etcd cluster, after: 2)",
         _churn_cell(run1), _churn_cell(run2)),
        (f"index shards, {runs.name}: " + _lag_cells(coalesced)[0], *_lag_cells(coalesced)[1:]),
        (f"index shards, {runs.name}: scaling 1 -> 2 etcd clusters", "1.00x", f"{run_scaling:.2f}x"),
        *server_rows(runs.name, coalesced),
        ("fleet capacity (2 shards) (before: per block, after: coalesced runs)",
         _capacity_cell(block2), _capacity_cell(run2)),
        (f"fleet capacity on paper, {k} shards each on a machine of its own = {k} x this run's 1-shard capacity "
         "(linear: shards share nothing but the routers; not what this 2-core machine measures, see the scaling "
         "rows) (before: per block, after: coalesced runs)",
         *(f"{k} x {_gpus(one):,.0f} = {k * _gpus(one):,.0f} GPUs" +
           (f"; 1,000 GPUs need {math.ceil(1000 / _gpus(one))} shards" if one else "") for one in (block1, run1))),
    ]
