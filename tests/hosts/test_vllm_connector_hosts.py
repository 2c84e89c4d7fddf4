"""The KV connector across hosts: etcd on host 1, vLLM A on host 2, vLLM B on host 3 (network namespaces).

Each pool binds and advertises its own host's address (the connector's `host`
setting); B's fetch from A crosses the bridge, and B's answer must equal B's
own cold recompute (a fresh cache_salt).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from prefixpool.deploy.vllm_fleet import vllm_temp_dir
from prefixpool.vllm_connector.config import kv_transfer_json
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from tests.support.multihost import block_count, node_records, start_etcd, wait_until
from tests.support.vllm_model import make_tiny_llama
from tests.vllm.test_vllm import BLOCK, MODEL, cached, complete
from tests.vllm.test_vllm_connector import BLOCK_BYTES, prompt

pytestmark = pytest.mark.timeout(1200)
NUM_HOSTS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def spread(hosts, model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("connector-hosts")
    etcd = start_etcd(hosts, hosts[0], logs)
    servers = {}
    try:
        for name, host in (("a", hosts[1]), ("b", hosts[2])):
            extra = {"etcd_endpoints": etcd, "node_id": name, "host": host.address, "pool_blocks": 64}
            config = VllmConfig(str(model_dir), MODEL, BLOCK, max_model_len=1024, num_blocks=96, host=host.address,
                                kv_transfer_config=kv_transfer_json(extra))
            servers[name] = VllmServer.launch(config, logs, name, vllm_temp_dir(), wrap=tuple(host.argv([])))
        for server in servers.values():
            server.wait_healthy(900)
        yield etcd, servers
    finally:
        for server in servers.values():
            server.stop()


def test_b_on_another_host_loads_a_prefix_from_a_and_answers_like_a_cold_recompute(hosts, spread):
    etcd, servers = spread
    records = node_records(etcd)
    for name, host in (("a", hosts[1]), ("b", hosts[2])):
        assert urlsplit(servers[name].url).hostname == host.address
        assert records[f"{name}.pool"]["transfer_url"].startswith(f"tcp://{host.address}:")
    text = prompt("hosts")
    first = complete(servers["a"].url, text)
    num_blocks = (first.usage.prompt_tokens - 1) // BLOCK
    wait_until(lambda: block_count(etcd, "a.pool") >= num_blocks, "A's pool publishing the prompt's blocks")
    time.sleep(1.0)  # B's etcd mirror follows the same watch
    answer = complete(servers["b"].url, text)
    assert cached(answer) == num_blocks * BLOCK
    log = servers["b"].log_path.read_text(errors="replace")
    pattern = rf"prefixpool load \S+: {num_blocks} of {num_blocks} blocks \({num_blocks} fetched from tcp://"
    assert re.search(pattern + re.escape(hosts[1].address) + rf":\d+, {num_blocks * BLOCK_BYTES} bytes\)", log)
    cold = complete(servers["b"].url, text, salt="cold-hosts")
    assert cached(cold) == 0 and answer.choices[0].text == cold.choices[0].text == first.choices[0].text

