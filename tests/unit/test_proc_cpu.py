"""prefixpool.testing.proc_cpu: a process's CPU seconds from /proc (Linux only)."""

import os
import subprocess
import sys
import time

import pytest

from prefixpool.testing.proc_cpu import cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# spins until it has used `argv[1]` CPU seconds, says so, then waits for its stdin to close
SPIN = ("import sys, time\nwhile time.process_time() < float(sys.argv[1]): pass\n"
        "print('spun', flush=True)\nsys.stdin.read()")


def test_counts_what_another_process_spent():
    child = subprocess.Popen([sys.executable, "-c", SPIN, "0.3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "spun"
        assert 0.25 <= cpu_seconds(child.pid) < 5.0  # /proc counts whole clock ticks, process_time finer
    finally:
        child.stdin.close()
        child.wait(10)


def test_own_process_grows():
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu_seconds(os.getpid()) > before
