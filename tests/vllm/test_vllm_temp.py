"""A vLLM server leaves nothing in the temp root: not when stopped, not when its owner is SIGKILLed.

vLLM writes `vllm_dist_<hex>` files and uuid-named ZMQ ipc sockets into its
temp dir (TMPDIR, VLLM_RPC_BASE_PATH). Each owner below is a child process
whose temp root is a fresh directory; two owners start side by side (vLLM
starts slowly on 2 shared cores): one stops its server, one is SIGKILLed.
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

import pytest

pytestmark = pytest.mark.timeout(1200)  # vLLM starts in minutes on 2 loaded cores; nothing here is timed

REPO = Path(__file__).resolve().parents[2]
OWNER = """
import sys
from pathlib import Path
from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
model, run_dir = sys.argv[1:3]
server = VllmServer.start(VllmConfig(model, "tiny-vllm", num_blocks=160), Path(run_dir), "v",
                          temp=vllm_temp_dir())
print(server.pid, flush=True)
sys.stdin.readline()
server.stop()
print("stopped", flush=True)
"""


def start_owner(model_dir: Path, tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    # The owner's whole temp root, which must end empty; short: vLLM's ipc socket paths in it must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix=f"ppt-{name}-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(root), "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(model_dir), str(tmp_path / f"{name}-run")], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return owner, root


def wait_until(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def alive(group: int) -> bool:
    """Any live process in the process group `group` (vLLM's API server leads one; its engine core is in it)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def test_a_stopped_or_orphaned_vllm_server_leaves_nothing_in_the_temp_root(model_dir, tmp_path):
    owners = {name: start_owner(model_dir, tmp_path, name) for name in ("stopped", "killed")}
    try:
        pids = {name: int(owner.stdout.readline()) for name, (owner, _) in owners.items()}  # vLLM is healthy
        for name, (_, root) in owners.items():
            (temp,) = root.iterdir()  # vLLM's own dir, and vLLM really wrote into it
            assert temp.name.startswith("pp-vllm-") and any(temp.iterdir()), name
        stopper, stopped_root = owners["stopped"]
        stopper.stdin.write("stop\n")
        stopper.stdin.flush()
        assert stopper.stdout.readline().strip() == "stopped"
        assert stopper.wait(60) == 0 and not alive(pids["stopped"])
        assert list(stopped_root.iterdir()) == []
        killed, killed_root = owners["killed"]
        killed.send_signal(signal.SIGKILL)
        killed.wait(60)
        # vLLM dies by its parent-death signal and the janitor removes the dir: both a moment later
        assert wait_until(lambda: not alive(pids["killed"]) and not any(killed_root.iterdir())), \
            list(killed_root.rglob("*"))
    finally:
        for owner, root in owners.values():
            if owner.poll() is None:
                owner.kill()
                owner.wait()
            shutil.rmtree(root, ignore_errors=True)
