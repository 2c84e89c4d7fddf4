"""CPU seconds a process has used, from /proc (Linux only): for benchmarks that charge a server's CPU
to the work it served, a figure the machine's other load does not distort the way it does latency.

    cpu_seconds(pid)  ->  utime + stime of every thread of `pid`, in seconds (/proc/<pid>/stat fields 14, 15)
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux's /proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
