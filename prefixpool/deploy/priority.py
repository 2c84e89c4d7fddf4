"""Lower the CPU priority of chosen processes in a process group, every thread of them.

    renice_group(pgid, "VLLM::Worker", 19)   # -> the pids it reniced

Linux keeps niceness per thread: setpriority(PRIO_PROCESS, pid) changes one
thread, so every thread in /proc/PID/task is set (threads made later inherit
their creator's). Processes are chosen by the start of their name (comm).
Used for vLLM's model worker, which spins on sched_yield for a second after
each step (docs/vllm.md). Knows nothing of vLLM beyond the name it is given.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a /proc stat file; None if it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def group_members(pgid: int, name_prefix: str) -> list[int]:
    """Pids in process group `pgid` whose name starts with `name_prefix`."""
    found = []
    for entry in PROC.iterdir():
        stat = _stat_fields(entry / "stat") if entry.name.isdigit() else None
        if stat is not None and int(stat[1][2]) == pgid and stat[0].startswith(name_prefix):
            found.append(int(entry.name))
    return sorted(found)


def threads(pid: int) -> list[int]:
    """The ids of `pid`'s live threads (none if it is gone)."""
    try:
        return [int(task.name) for task in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return []


def thread_niceness(pid: int) -> dict[int, int]:
    """Each live thread of `pid` and its niceness."""
    niceness = {}
    for task in (PROC / str(pid) / "task").iterdir():
        stat = _stat_fields(task / "stat")
        if stat is not None:
            niceness[int(task.name)] = int(stat[1][16])
    return niceness


def renice_group(pgid: int, name_prefix: str, niceness: int) -> list[int]:
    """Set every thread of the group's `name_prefix` processes to `niceness`; the pids set."""
    pids = group_members(pgid, name_prefix)
    for pid in pids:
        for tid in threads(pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    return pids
