"""The gateway benchmark's tail verdict: an exact rank test over runs, not requests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gateway.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gateway", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def runs(rng: np.random.Generator, shift_ms: float, count: int = 3, requests: int = 360,
         run_spread_ms: float = 4.0) -> list[dict]:
    """Runs as vLLM's client saves them: a run-wide offset (the machine's mood) plus per-request TTFTs."""
    arms = []
    for _ in range(count):
        offset = shift_ms + rng.normal(0, run_spread_ms)
        errors = [""] * requests
        errors[0] = "failed"  # a failed request's TTFT is not counted
        arms.append({"result": {"ttfts": list((rng.gamma(2.0, 7.0, requests) + 5 + offset) / 1000), "errors": errors}})
    return arms


def test_rank_test_is_exact_on_three_runs_each(bench):
    assert bench.rank_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == (pytest.approx(1 / 20), 1.0)
    assert bench.rank_test([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == (1.0, pytest.approx(1 / 20))
    lower, higher = bench.rank_test([1.0, 5.0, 3.0], [4.0, 2.0, 6.0])
    assert lower > 0.05 and higher > 0.05


def test_a_front_slower_by_far_more_than_the_runs_vary_is_called_worse(bench):
    rng = np.random.default_rng(1)
    assert bench.difference_row("ref", "pressure", runs(rng, 25.0), runs(rng, 0.0)).endswith("| worse / worse |")
    assert bench.difference_row("ref", "pressure", runs(rng, -25.0), runs(rng, 0.0)).endswith("| better / better |")


def test_run_to_run_drift_alone_is_rarely_called_a_difference(bench):
    """Both fronts drawn from one distribution whose runs drift: a test over requests calls most of these a
    difference; over runs, at most its level (2 x 1/20 for both directions) plus sampling slack."""
    rng = np.random.default_rng(7)
    rows = [bench.difference_row("ref", "pressure", runs(rng, 0.0), runs(rng, 0.0)) for _ in range(120)]
    called = sum(not row.endswith("| not told apart / not told apart |") for row in rows)
    assert called <= 0.2 * len(rows), called


def test_failed_requests_are_left_out(bench):
    arm = runs(np.random.default_rng(5), 0.0, count=1)[0]
    assert len(bench.ttfts_ms(arm)) == 359


def test_pin_servers_moves_every_process_of_each_server_onto_its_own_cpu(bench):
    """A stand-in for the fleet (only its servers' pids are read): each 'server' a shell with a child, in a
    process group of its own as vLLM servers are started."""
    import os
    import subprocess
    import time
    from types import SimpleNamespace

    from prefixpool.deploy.priority import group_members

    procs = [subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while any(len(group_members(p.pid, "")) < 2 for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        cluster = SimpleNamespace(vllm_servers={f"vllm-{i}": SimpleNamespace(pid=p.pid) for i, p in enumerate(procs)})
        pinned = bench.pin_servers(cluster)
        cpus = sorted(os.sched_getaffinity(0))
        assert pinned == {"vllm-0": cpus[0], "vllm-1": cpus[1 % len(cpus)]}
        for i, p in enumerate(procs):
            group = group_members(p.pid, "")
            assert len(group) == 2  # the shell and its sleep
            assert all(os.sched_getaffinity(pid) == {pinned[f"vllm-{i}"]} for pid in group)
        assert os.sched_getaffinity(0) == set(cpus)  # this process, outside both groups, is left alone
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_each_of_our_fronts_is_compared_with_each_sglang_front(bench, capsys):
    rng = np.random.default_rng(3)
    arms = {"pressure": runs(rng, 0.0), "cost": runs(rng, 0.0), "sglang": runs(rng, 0.0),
            "sglang-nodelay": runs(rng, 0.0)}
    bench.difference_table([("ref", arms)], None)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ref |")]
    pairs = {tuple(cell.strip() for cell in row.split("|")[2:4]) for row in rows}
    assert pairs == {(f"prefixpool {front}", name) for front in ("pressure", "cost") for name in bench.PEERS.values()}


ACCEPTED_NODELAY = """
import socket
server = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(server.getsockname())
accepted, _ = server.accept()
print(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
"""


def test_the_nodelay_shim_sets_tcp_nodelay_on_each_accepted_socket(bench, tmp_path):
    """The sglang-nodelay front's LD_PRELOAD library, built as the bench builds it, in a process that accepts."""
    import os
    import subprocess

    library = bench.build_nodelay_shim(tmp_path)

    def accepted_nodelay(env: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", ACCEPTED_NODELAY], env={**os.environ, **env}, check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()

    assert accepted_nodelay({}) == "False"  # Linux's default, and sglang-router's: Nagle's algorithm on
    assert accepted_nodelay({"LD_PRELOAD": str(library)}) == "True"


def test_rows_name_each_front_pooled_or_not(bench):
    arm = {"shape": "ref", "result": {"completed": 1, "num_prompts": 1}, "hit_rate": 0.5, "ideal": 0.9, "split": 0.5,
           "preempted": 0, "load": 1.0}
    names = {front: bench.row({**arm, "front": front}).split(" | ")[1] for front in
             ("pressure", "sglang", "sglang-nodelay, 2 rounds pooled", "round_robin (warm-up, not counted)")}
    assert names == {"pressure": "prefixpool pressure", "sglang": "sglang-router cache_aware",
                     "sglang-nodelay, 2 rounds pooled": "sglang-router cache_aware, TCP_NODELAY added, 2 rounds pooled",
                     "round_robin (warm-up, not counted)": "prefixpool round_robin (warm-up, not counted)"}
