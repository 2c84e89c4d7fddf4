"""No orphans: SIGKILL of `prefixpool up`, `worker`, `router --processes` or `etcd` leaves no process and no
temp dir behind.

Each command runs with TMPDIR pointed at a directory of the test's own, so
"no temp dir left" is checked exactly; every descendant is found through
/proc before the kill and must be gone after it. Also: `prefixpool etcd
--data-dir` creates a data directory that does not exist yet.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from prefixpool.deploy.processes import python_argv

DEADLINE_S = 60.0


def descendants(pid: int) -> set[int]:
    """Every live process under `pid`, read from /proc (children in any session)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_until(argv: list[str], marker: str, env: dict[str, str]) -> subprocess.Popen:
    """Start `argv` and read its stdout until a line contains `marker`."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    deadline, seen = time.monotonic() + DEADLINE_S * 2, b""
    while marker.encode() not in seen:
        assert time.monotonic() < deadline and process.poll() is None, f"{argv} never printed {marker!r}: {seen!r}"
        if select.select([process.stdout], [], [], 0.5)[0]:
            seen += os.read(process.stdout.fileno(), 4096)
    return process


def assert_all_gone(pids: set[int], tmp: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and ({p for p in pids if alive(p)} or any(tmp.iterdir())):
        time.sleep(0.2)
    assert {p for p in pids if alive(p)} == set(), "processes outlived their SIGKILLed parent"
    assert sorted(p.name for p in tmp.iterdir()) == [], "temp dirs left behind"


def kill_and_check(process: subprocess.Popen, tmp: Path) -> None:
    pids = descendants(process.pid)
    assert pids, "the command should have started children"
    process.kill()
    process.wait()
    process.stdout.close()
    assert_all_gone(pids, tmp)


def env_with_tmp(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "PREFIXPOOL_NUM_BLOCKS": "64"}


def test_sigkill_of_up_leaves_no_etcd_worker_router_or_temp_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    process = start_until(python_argv("up", "--workers", "1"), "prefixpool is up", env_with_tmp(tmp))
    pids = descendants(process.pid)
    names = {Path(f"/proc/{p}/exe").resolve().name for p in pids if alive(p)}
    assert "etcd" in names, names  # etcd runs in its own session: exactly the one that used to stay
    assert [p.name for p in tmp.iterdir() if p.name.startswith("prefixpool-")], "up should use temp dirs here"
    kill_and_check(process, tmp)


def test_sigkill_of_worker_leaves_nothing(etcd, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = python_argv("worker", "--etcd-endpoints", etcd.endpoint, "--cluster", f"orphan{os.getpid()}")
    process = start_until(argv, "READY ", env_with_tmp(tmp))
    pid = process.pid
    process.kill()
    process.wait()
    process.stdout.close()
    assert not alive(pid)
    assert_all_gone(set(), tmp)


def test_sigkill_of_router_processes_leaves_nothing(etcd, tmp_path):
    """`router --processes 2`: the parent owns the children's shared metrics dir; SIGKILL takes all of it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = python_argv("router", "--processes", "2", "--port", "0", "--etcd-endpoints", etcd.endpoint,
                       "--cluster", f"orphan{os.getpid()}")
    process = start_until(argv, "READY ", env_with_tmp(tmp))
    assert [p.name for p in tmp.iterdir() if p.name.startswith("prefixpool-router-metrics-")]
    kill_and_check(process, tmp)


def test_sigkill_of_etcd_command_removes_its_temp_data_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    process = start_until(python_argv("etcd"), "READY ", env_with_tmp(tmp))
    assert [p.name for p in tmp.iterdir() if p.name.startswith("prefixpool-etcd-")]
    kill_and_check(process, tmp)


def test_etcd_data_dir_is_created_when_missing(tmp_path):
    data_dir = tmp_path / "var" / "lib" / "etcd"
    process = start_until([*python_argv("etcd"), "--data-dir", str(data_dir)], "READY ", dict(os.environ))
    process.send_signal(signal.SIGTERM)
    assert process.wait(DEADLINE_S) == 0
    process.stdout.close()
    assert (data_dir / "member-data").is_dir(), "etcd should have written its data under the new dir"
    assert (data_dir / "etcd.log").exists()


