"""The connector's settings, read once from vLLM's `kv_connector_extra_config` (JSON keys below).

    --kv-transfer-config '{"kv_connector": "PrefixPoolConnector",
                           "kv_connector_module_path": "prefixpool.vllm_connector.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"etcd_endpoints": "127.0.0.1:2379", "node_id": "vllm-0"}}'

`kv_load_failure_policy: recompute` matters: vLLM's default ("fail") ends a
request whose blocks did not load instead of recomputing them. The namespace
(model name, dtype, block size; salt and LoRA per request) is the one the
router and the vLLM sidecar hash under. Knows nothing of vLLM's classes.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from prefixpool.meta.runs import check_run_blocks
from prefixpool.meta.shards import parse_shards
from prefixpool.store.keys import Namespace

POOL_KIND = "vllm-pool"  # a node record that holds and serves blocks but takes no requests


class BadConnectorConfig(ValueError):
    """kv_connector_extra_config names a key we do not know, or a value of the wrong type."""


@dataclass(frozen=True)
class ConnectorConfig:
    etcd_endpoints: str = "127.0.0.1:2379"
    etcd_shards: str = ""  # index shards' endpoints, ';' between shards, shard 0 first (meta/shards.py); "": one
    cluster: str = "default"  # the etcd namespace (Layout), as --cluster elsewhere
    node_id: str = ""  # the vLLM node's id; the pool registers as "<node_id>.pool" (default: host + engine id)
    model: str = ""  # the name keys are namespaced under (default: vLLM's served model name)
    dtype: str = ""  # default: vLLM's model dtype
    host: str = "127.0.0.1"  # where the transfer server binds
    advertise_host: str = ""  # what peers are told (default: host)
    transfer: str = "tcp"  # or "ucx"
    transfer_port: int = 0
    token: str = ""  # shared transfer secret
    pool_blocks: int = 256  # blocks of the pool's host-memory arena
    disk_tier_dir: str = ""  # the SSD tier lives in <disk_tier_dir>/<node_id>; blocks evicted from the arena go there
    disk_tier_blocks: int = 0
    ssd_write_through: bool = False  # also write every saved block to the SSD tier at once (needs the tier)
    async_load: bool = True  # blocks from a peer load in the background (vLLM's WAITING_FOR_REMOTE_KVS)
    lease_ttl_s: int = 10
    publish_run_blocks: int = 1  # the fleet's --publish-run-blocks: the pool publishes, the lookups match, per run
    fetch_timeout_s: float = 5.0  # one peer fetch; past it the request recomputes
    lookup_timeout_s: float = 1.0  # the scheduler's wait for its etcd mirror's thread, per request
    fault_file: str = ""  # fault injection for tests: prefixpool/node/faults.py reads it per fetch served

    def shard_endpoints(self) -> tuple[str, ...]:
        """Each index shard's etcd endpoints, shard 0 first (one shard: etcd_endpoints)."""
        return parse_shards(self.etcd_shards) or (self.etcd_endpoints,)

    def pool_node_id(self) -> str:
        return f"{self.node_id}.pool"

    def namespace(self, served_model: str, model_dtype: str, block_size: int) -> Namespace:
        return Namespace(model=self.model or served_model, dtype=self.dtype or model_dtype, block_size=block_size)


def config_from(extra: Mapping[str, Any], engine_id: str = "") -> ConnectorConfig:
    """The default node id is the same in vLLM's scheduler and worker processes: they share the engine id."""
    fields = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        raise BadConnectorConfig(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(fields)}")
    values = {}
    for name, value in extra.items():
        kind = type(fields[name].default)
        if kind is bool and not isinstance(value, bool):
            raise BadConnectorConfig(f"kv_connector_extra_config[{name!r}] = {value!r}: not true or false")
        try:
            values[name] = kind(value)
        except (TypeError, ValueError) as err:
            raise BadConnectorConfig(f"kv_connector_extra_config[{name!r}] = {value!r}: {err}") from None
    if not values.get("node_id"):
        values["node_id"] = f"vllm-{socket.gethostname()}-{engine_id[:8]}"
    config = ConnectorConfig(**values)
    try:
        config.shard_endpoints()
    except ValueError as err:
        raise BadConnectorConfig(f"kv_connector_extra_config['etcd_shards']: {err}") from None
    try:
        check_run_blocks(config.publish_run_blocks)
    except ValueError as err:
        raise BadConnectorConfig(f"kv_connector_extra_config['publish_run_blocks']: {err}") from None
    if config.ssd_write_through and config.disk_tier_blocks <= 0:
        raise BadConnectorConfig("ssd_write_through needs an SSD tier (disk_tier_blocks > 0, disk_tier_dir)")
    return config


KV_ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}  # node role -> vLLM's kv_role


def kv_transfer_json(extra: Mapping[str, Any], role: str = "both") -> str:
    """vLLM's --kv-transfer-config for this connector with `extra` as its settings (checked here first);
    `role` is the node's (prefill: kv_producer, decode: kv_consumer, both: kv_both)."""
    config_from(extra)
    return json.dumps({"kv_connector": "PrefixPoolConnector",
                       "kv_connector_module_path": "prefixpool.vllm_connector.connector",
                       "kv_role": KV_ROLES[role], "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": dict(extra)})
