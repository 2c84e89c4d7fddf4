"""A sidecar whose etcd is out of reach when its vLLM server comes up waits for etcd instead of exiting.

CI once saw etcd too slow to answer while two vLLM servers started on 2 cores, and the sidecar exited
with `vllm-node stopped: UNAVAILABLE: ... connection attempt timed out before receiving SETTINGS frame`.
Here etcd is frozen (SIGSTOP: connections open, no answer), which gives that exact error. Ordering, not
timing: etcd resumes only after the sidecar has warned. One vLLM server and one etcd of this module's own.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import pytest

from prefixpool.deploy.processes import READY_PREFIX, python_argv
from prefixpool.deploy.vllm_fleet import sidecar_args
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from prefixpool.meta.layout import Layout
from tests.conftest import etcdctl_get_prefix

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def config(model_dir) -> VllmConfig:
    return VllmConfig(str(model_dir), "tiny-vllm", num_blocks=160)


@pytest.fixture(scope="module")
def server(config, tmp_path_factory):
    started = VllmServer.start(config, tmp_path_factory.mktemp("sidecar-etcd"), "v")
    yield started
    started.stop()


def test_a_sidecar_registers_once_etcd_answers_again(config, server, frozen_etcd, tmp_path):
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log:
        sidecar = subprocess.Popen(python_argv(*sidecar_args("late", server, frozen_etcd.endpoint, config,
                                                             ("--cluster", "late"))),
                                   stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 120
        while "etcd is out of reach" not in log_path.read_text() and sidecar.poll() is None:
            assert time.monotonic() < deadline, f"no warning from the sidecar: {log_path.read_text()[-2000:]}"
            time.sleep(0.2)
        assert sidecar.poll() is None, f"the sidecar exited: {log_path.read_text()[-2000:]}"
        os.kill(frozen_etcd.pid, signal.SIGCONT)
        ready, _, _ = select.select([sidecar.stdout], [], [], 120)
        assert ready and sidecar.stdout.readline().startswith(READY_PREFIX), log_path.read_text()[-2000:]
        _, kvs = etcdctl_get_prefix(frozen_etcd, Layout("late").prefix.decode())
        assert Layout("late").node_key("late") in kvs
    finally:
        sidecar.terminate()
        sidecar.wait(30)
