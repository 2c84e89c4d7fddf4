"""The vLLM sidecar's settings (`prefixpool vllm-node`; flags `--x-y`, environment `PREFIXPOOL_X_Y`)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.deploy.common_settings import CommonSettings
from prefixpool.deploy.settings import setting


@dataclass(frozen=True)
class VllmNodeSettings(CommonSettings):
    vllm_url: str = setting("http://127.0.0.1:8000", "the vLLM server's OpenAI API base URL, as the router reaches it")
    kv_events: str = setting("tcp://127.0.0.1:5557", "vLLM's KV event PUB endpoint (its --kv-events-config endpoint)")
    replay_endpoint: str = setting("", "vLLM's KV event replay endpoint (ROUTER), used to repair gaps; "
                                   "empty: clear and relearn")
    kv_topic: str = setting("", "topic vLLM publishes KV events under")
    node_id: str = setting("", "unique node name in the cluster (default: vllm-host-pid)")
    lease_ttl_s: int = setting(10, "etcd lease TTL; the node's blocks vanish this long after the sidecar dies")
    health_period_s: float = setting(1.0, "how often vLLM's /health is checked")
    health_failures: int = setting(3, "missed health checks in a row after which the node's lease is revoked")
    tail_delay_s: float = setting(1.0, "with --publish-run-blocks > 1: a chain's last key is published as its "
                                  "tail once the chain has not grown for this long (a request's end)")
    role: str = setting("both", "prefill/decode disaggregation: prefill (its connector is kv_producer), decode "
                        "(kv_consumer) or both (serves whole requests)")
