"""renice_group: every thread of the named processes in one process group, nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

from prefixpool.deploy.priority import group_members, renice_group, thread_niceness

# A child that names itself (its main thread's comm), starts two more threads, with a name to give its own
# child (in its group) starts that too, prints the pids and waits for stdin to close.
CHILD = """
import subprocess, sys, threading
open("/proc/self/comm", "w").write(sys.argv[1])
for _ in range(2):
    threading.Thread(target=sys.stdin.read, daemon=True).start()
pids = []
if len(sys.argv) > 2:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    pids = child.stdout.readline().split()
print(" ".join(map(str, [__import__("os").getpid(), *pids])), flush=True)
sys.stdin.read()
"""


def start(*names: str, **kwargs) -> tuple[subprocess.Popen, list[int]]:
    """The first named process (its child named by the second, if any) and their pids."""
    argv = [sys.executable, "-c", CHILD, names[0], *((CHILD, names[1]) if len(names) > 1 else ())]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kwargs)
    return child, [int(pid) for pid in child.stdout.readline().split()]


def test_only_the_named_processes_of_the_group_are_reniced_every_thread_of_them():
    leader, (pgid, worker) = start("group-leader", "VLLM::Worker", start_new_session=True)  # as vLLM's group
    outsider, (other,) = start("VLLM::Worker")  # the same name in another group: never touched
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        assert leader.pid == pgid and len(thread_niceness(worker)) == 3  # the main thread and its two
        assert group_members(pgid, "VLLM::Worker") == [worker]
        assert renice_group(pgid, "VLLM::Worker", mine + 7) == [worker]
        assert set(thread_niceness(worker).values()) == {mine + 7} and len(thread_niceness(worker)) == 3
        assert set(thread_niceness(pgid).values()) == {mine} == set(thread_niceness(other).values())
        assert renice_group(pgid, "no-such-name", mine + 9) == []
    finally:
        for child in (leader, outsider):  # the leader's stdin closing ends its child's too
            child.stdin.close()
            child.wait(10)
