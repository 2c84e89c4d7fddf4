"""A vLLM server whose connector finds etcd out of reach while vLLM starts comes up, and its pool registers later.

The connector's pool registers (lease, record) while vLLM's engine core initializes its KV cache. CI once
saw that engine fail at startup ("Engine core initialization failed") on a machine busy enough for etcd to
answer late. Here etcd is frozen (SIGSTOP: connections open, no answer) before vLLM starts. Ordering, not
timing: etcd resumes only after the pool has said it will register later. Then the pool's record and the
blocks of a prompt vLLM computed must appear in etcd, and a second ask must hit vLLM's prefix cache.
One vLLM server and one etcd of this module's own.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from prefixpool.vllm_connector.config import kv_transfer_json
from tests.support.multihost import block_count, node_records, wait_until
from tests.vllm.test_vllm import BLOCK, MODEL, cached, complete
from tests.vllm.test_vllm_connector import prompt

pytestmark = pytest.mark.timeout(900)
WARNING = "etcd unavailable"  # what Membership logs when a patient start finds etcd out of reach


def test_a_connector_pool_registers_once_etcd_answers_again(model_dir, frozen_etcd, tmp_path):
    extra = {"etcd_endpoints": frozen_etcd.endpoint, "node_id": "late", "pool_blocks": 64}
    config = VllmConfig(str(model_dir), MODEL, BLOCK, max_model_len=1024, num_blocks=96,
                        kv_transfer_config=kv_transfer_json(extra))
    server = VllmServer.launch(config, tmp_path, "late", vllm_temp_dir())
    try:
        deadline = time.monotonic() + 600
        while WARNING not in server.log_path.read_text(errors="replace"):
            assert server.process.poll() is None, f"vLLM exited: {server.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no warning from the pool: {server.log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        os.kill(frozen_etcd.pid, signal.SIGCONT)
        server.wait_healthy(600)
        wait_until(lambda: "late.pool" in node_records(frozen_etcd.endpoint), "the pool's record in etcd")
        text = prompt("late etcd")
        first = complete(server.url, text)
        num_blocks = (first.usage.prompt_tokens - 1) // BLOCK
        wait_until(lambda: block_count(frozen_etcd.endpoint, "late.pool") >= num_blocks,
                   "the pool publishing the prompt's blocks")
        again = complete(server.url, text)
        assert cached(again) == num_blocks * BLOCK
        assert again.choices[0].text == first.choices[0].text
    finally:
        server.stop()
