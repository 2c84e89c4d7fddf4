"""Temp directories that outlive no process: removed on close, and also when their owner is SIGKILLed.

    tmp = OwnedTempDir("prefixpool-etcd-")   # tmp.path; a janitor process holds a pipe from us
    tmp.kill_group_if_orphaned(pgid)         # optional: a process group that must not outlive us either
    ...
    tmp.close()                              # removes the dir now and lets the janitor go

A SIGKILLed process runs no cleanup, so each directory gets a tiny janitor
child (its own session: Ctrl-C does not reach it) that blocks reading a pipe
whose only writer is the owner. When the owner dies, however it dies, the
kernel closes the pipe, the janitor reads EOF and removes the directory
(retrying briefly while the owner's other children, killed by their
parent-death signal at the same moment, still write into it). The janitor
forks once more and its first process exits, so it is nobody's child: Ray
SIGKILLs an exiting actor's children (ray.kill, `ray down`), and a janitor
still among them died with its directory in place. A child's parent-death
signal does not reach the processes that child started (vLLM's engine core
outlives its killed API server), so the owner may name process groups down
the pipe: orphaned, the janitor SIGKILLs them first; closed, it leaves them
(the owner stopped them). Knows nothing of what the directories hold.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class OwnedTempDir:
    def __init__(self, prefix: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._janitor = subprocess.Popen([sys.executable, "-m", "prefixpool.deploy.janitor", str(self.path)],
                                         stdin=subprocess.PIPE, start_new_session=True)
        self._janitor.wait()  # its first process exits once the janitor is detached: from here on it is safe

    def kill_group_if_orphaned(self, pgid: int) -> None:
        assert self._janitor.stdin is not None
        self._janitor.stdin.write(f"group {pgid}\n".encode())
        self._janitor.stdin.flush()

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._janitor.stdin is not None and not self._janitor.stdin.closed:
            self._janitor.stdin.write(b"closed\n")
            self._janitor.stdin.close()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_when_orphaned(path: Path, attempts: int = 50, pause_s: float = 0.1) -> None:
    """Block until stdin reaches EOF (the owner closed it or died), then remove `path`."""
    lines = sys.stdin.buffer.read().decode().split()
    if "closed" not in lines:
        for pgid in (int(word) for before, word in zip(lines, lines[1:]) if before == "group"):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(pause_s)


def detach() -> None:
    """Leave the owner's children: the first process exits, the grandchild carries on (reparented to init)."""
    if os.fork():
        os._exit(0)


if __name__ == "__main__":
    detach()
    remove_when_orphaned(Path(sys.argv[1]))
