"""A vLLM worker on Ray: a vLLM actor (a real vLLM server and its sidecar) behind the router actor.

A request through the router is answered by the Ray-hosted vLLM, its blocks
appear in etcd under the actor's node, and `ray down` leaves no process and no
temp dir behind.
"""

import json
import os
import tempfile
from pathlib import Path

import openai
import pytest
import ray

from prefixpool.deploy import ray_deploy
from prefixpool.deploy.etcd_server import free_port
from prefixpool.meta.layout import Layout
from prefixpool.deploy.vllm_server import VllmConfig
from tests.conftest import etcdctl_get_prefix
from tests.ray.test_ray import _alive as running, wait_for, workers_seen
from tests.vllm.test_vllm import BLOCK, MODEL, SHARED
from tests.vllm.test_vllm_temp import alive

pytestmark = pytest.mark.timeout(1200)  # vLLM starts in minutes on 2 loaded cores; nothing here is timed


def complete(url: str, prompt: str, salt: str = ""):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"cache_salt": salt} if salt else None)


def node_blocks(etcd_endpoint: str, node_id: str) -> int:
    server = type("Endpoint", (), {"client_url": f"http://{etcd_endpoint}"})()
    layout = Layout("default")
    _, kvs = etcdctl_get_prefix(server, layout.blocks_prefix.decode())
    return sum(1 for raw in kvs if (entry := layout.parse_block(raw)) is not None and entry.node_id == node_id)


def test_a_vllm_actor_serves_through_the_router_and_ray_down_leaves_nothing(model_dir):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=4, include_dashboard=False, namespace=ray_deploy.NAMESPACE, log_to_driver=False)
    removed: list[str] = []
    try:
        config = VllmConfig(str(model_dir), MODEL, BLOCK, num_blocks=160)
        deployed = ray_deploy.up(0, router_port=0, etcd_port=free_port(), vllm=config, num_vllm=1,
                                 env={"PREFIXPOOL_LEASE_TTL_S": "3"})
        assert deployed.vllm_names == ("vllm-0",)
        wait_for(lambda: workers_seen(deployed.router_url) == 1)
        actor = ray_deploy.get_actor("vllm-0")
        vllm_url, vllm_pid, sidecar_pid, log_dir, temp_dir = ray.get([
            actor.vllm_url.remote(), actor.vllm_pid.remote(), actor.pid.remote(), actor.log_path.remote(),
            actor.vllm_temp_path.remote()])
        answer = complete(deployed.router_url, SHARED + "Ray?")
        direct = complete(vllm_url, SHARED + "Ray?", salt="cold")  # the same server, recomputing every block
        assert (answer.choices[0].text == direct.choices[0].text
                and answer.usage.prompt_tokens == direct.usage.prompt_tokens)
        wait_for(lambda: node_blocks(deployed.etcd_endpoints, "vllm-0") >= len(SHARED) // 4 // BLOCK // 2)
        again = complete(deployed.router_url, SHARED + "Ray again?")
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert Path(temp_dir).is_dir() and Path(log_dir).is_dir()
    finally:
        removed = ray_deploy.down()
        ray.shutdown()
    assert {"router", "etcd", "vllm-0"} <= set(removed)
    wait_for(lambda: not alive(vllm_pid) and not running(sidecar_pid), timeout_s=60)  # vLLM: its whole group
    assert not Path(temp_dir).exists() and not Path(log_dir).exists()
    etcd_port = deployed.etcd_endpoints.rsplit(":", 1)[1]
    assert not Path(tempfile.gettempdir(), f"prefixpool-ray-etcd-{etcd_port}").exists()


def test_a_vllm_actor_with_the_connector_saves_into_its_pool_and_ray_down_takes_it(model_dir):
    """`ray up --vllm-connector`: vLLM loads PrefixPoolConnector inside the actor; its pool registers and saves."""
    ray.init(num_cpus=4, include_dashboard=False, namespace=ray_deploy.NAMESPACE, log_to_driver=False)
    try:
        config = VllmConfig(str(model_dir), MODEL, BLOCK, num_blocks=160)
        deployed = ray_deploy.up(0, router_port=0, etcd_port=free_port(), vllm=config, num_vllm=1,
                                 env={"PREFIXPOOL_LEASE_TTL_S": "3"}, vllm_connector=True)
        wait_for(lambda: workers_seen(deployed.router_url) == 1)  # the pool takes no requests: not a worker
        answer = complete(deployed.router_url, SHARED + "Ray with the connector?")
        assert answer.usage.prompt_tokens > 4 * BLOCK
        wait_for(lambda: node_blocks(deployed.etcd_endpoints, "vllm-0.pool") >= answer.usage.prompt_tokens // BLOCK)
        server = type("Endpoint", (), {"client_url": f"http://{deployed.etcd_endpoints}"})()
        _, kvs = etcdctl_get_prefix(server, Layout("default").node_key("vllm-0.pool").decode())
        assert [json.loads(value)["kind"] for value in kvs.values()] == ["vllm-pool"]
    finally:
        removed = ray_deploy.down()
        ray.shutdown()
    assert {"router", "etcd", "vllm-0"} <= set(removed)
