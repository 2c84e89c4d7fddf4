"""The etcd process: start, restart keeping or wiping data, and the `prefixpool etcd` subcommand."""

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.conftest import etcdctl


def test_restart_keeps_or_wipes_data(own_etcd):
    etcdctl(own_etcd, "put", "/k", "v")
    own_etcd.restart(keep_data=True)
    assert etcdctl(own_etcd, "get", "/k", "--print-value-only").strip() == "v"
    own_etcd.restart(keep_data=False)
    assert etcdctl(own_etcd, "get", "/k", "--print-value-only").strip() == ""


def test_cli_subcommand_serves_until_sigterm_and_cleans_up():
    process = subprocess.Popen([sys.executable, "-m", "prefixpool.deploy.cli", "etcd"], stdout=subprocess.PIPE,
                               text=True, cwd=Path(__file__).resolve().parents[2],
                               start_new_session=True)  # fmt: skip
    try:
        line = process.stdout.readline()  # "etcd http://127.0.0.1:PORT (pid N, data DIR)"
        url, data_dir = line.split()[1], line.rsplit("data ", 1)[1].rstrip(")\n")
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            assert b'"true"' in response.read()
        assert Path(data_dir).exists()
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(20) == 0
        assert not Path(data_dir).exists()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
