"""Fixtures of the vLLM test modules."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from prefixpool.deploy.etcd_server import EtcdServer
from tests.support.vllm_model import make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint, one per test module."""
    return make_tiny_llama(tmp_path_factory)


@pytest.fixture
def frozen_etcd():
    """An etcd of the test's own, SIGSTOPped (connections open, no answer: an etcd too slow to answer);
    the test SIGCONTs it when it wants it back."""
    etcd = EtcdServer().start()
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        yield etcd
    finally:
        os.kill(etcd.pid, signal.SIGCONT)
        etcd.stop()
