"""Keep a benchmark's terminal for its table: native libraries' logs go to a file.

Mooncake's transfer engine (glog, written before InitGoogleLogging, so GLOG_* settings do not
silence it), UCX and etcd write straight to file descriptor 2. `send_native_logs_to(path)`
points fd 2 at a log file (children inherit it) and keeps Python's own `sys.stderr`, and so our
tracebacks and warnings, on the terminal. It says where the logs went, once, on stdout.
"""

from __future__ import annotations

import os
import sys
import tempfile


def send_native_logs_to(path: str | None = None) -> str:
    if path is None:
        fd, path = tempfile.mkstemp(prefix="prefixpool-bench-", suffix=".log")
        os.close(fd)
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)
    print(f"(third-party logs: {path})", flush=True)
    return path
