"""Child processes the launcher starts: spawn, wait for readiness, stop by PID.

A component announces readiness by printing one line `READY <url>` on
stdout once it is serving; the launcher reads it to learn the real port
(components bind port 0). Everything else the child prints goes to its log
file. Knows nothing of what the children are.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

READY_PREFIX = "READY "
STOP_TIMEOUT_S = 30.0  # above the components' default --drain-deadline-s (20 s), like a pod's grace period
_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child exited or stayed silent before announcing readiness."""


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process:
# every child is forked from this one thread, which lives as long as the process, so a
# caller on a short-lived thread (asyncio.to_thread, a Ray task) cannot get its children killed.
_FORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixpool-forker")


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when its parent dies, so no orphan outlives a crash."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def fork_from_one_thread(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen from the one long-lived forker thread (see _FORKER), so PR_SET_PDEATHSIG holds."""
    return _FORKER.submit(subprocess.Popen, argv, **popen_kwargs).result()


def start_logging() -> None:
    """A component's log lines, one format for all: to stderr, which the launcher sends to its log file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def announce_ready(url: str) -> None:
    """Called by a component once it serves, so a launcher can learn its URL."""
    print(f"{READY_PREFIX}{url}", flush=True)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM: a component drains (finishes what it admitted) and exits."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (past any drain deadline); always reaps the process."""
        if self.alive():
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None, timeout_s: float = 120.0,
          preexec_fn=die_with_parent) -> Child:
    """Start `argv` and wait for its READY line; raise ChildFailed with its log tail otherwise."""
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    process = fork_from_one_thread(argv, stdout=subprocess.PIPE, stderr=log, env={**os.environ, **(env or {})},
                                   preexec_fn=preexec_fn)
    deadline = time.monotonic() + timeout_s
    buffered = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                break
            buffered += chunk
            for line in buffered.decode(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    _drain_to(process, log)
                    return Child(name, process, line[len(READY_PREFIX):].strip(), log_path)
        elif process.poll() is not None:
            break
    process.kill()
    process.wait()
    log.close()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise ChildFailed(f"{name} did not become ready (exit {process.returncode}); log tail:\n{tail}")


def _drain_to(process: subprocess.Popen, log) -> None:
    """Keep the child's stdout flowing into its log so it never blocks on a full pipe."""

    def pump() -> None:
        for chunk in iter(lambda: process.stdout.read1(65536), b""):
            log.write(chunk)
            log.flush()
        log.close()

    threading.Thread(target=pump, name=f"log-{process.pid}", daemon=True).start()


def python_argv(*args: str) -> list[str]:
    """Run the prefixpool CLI with the same interpreter as this process."""
    return [sys.executable, "-m", "prefixpool.deploy.cli", *args]
