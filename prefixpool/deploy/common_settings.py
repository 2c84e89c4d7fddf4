"""Settings the router and every worker must agree on, declared once.

Both RouterSettings and WorkerSettings extend this class; the Kubernetes
ConfigMap `prefixpool-common` carries exactly these fields for both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from prefixpool.deploy.settings import setting
from prefixpool.meta.runs import check_run_blocks
from prefixpool.meta.shards import parse_shards


@dataclass(frozen=True)
class CommonSettings:
    etcd_endpoints: str = setting("127.0.0.1:2379", "comma-separated etcd client endpoints host:port")
    etcd_shards: str = setting("", "index shards: one etcd cluster's endpoints per shard, ';' between shards, "
                               "shard 0 first (node records and router loads live there; it is --etcd-endpoints); "
                               "block keys spread over the shards by key hash. Empty: one shard, --etcd-endpoints")
    cluster: str = setting("default", "cluster namespace under /prefixpool/ in etcd")
    model: str = setting("tiny", "model preset name, or the served name of --model-path "
                         "(enters the block-key namespace)")
    model_path: str = setting("", "checkpoint directory with config.json, *.safetensors and tokenizer.json; "
                              "empty uses the preset")
    dtype: str = setting("float32", "model and KV dtype: float32, bfloat16 or float16 (enters the block-key namespace)")
    block_size: int = setting(16, "tokens per KV block (enters the block-key namespace)")
    publish_run_blocks: int = setting(1, "nodes publish one etcd key per run of about N blocks, routers match at "
                                         "that granularity (a power of two up to 256; docs/capacity.md); 1: per block")

    def __post_init__(self) -> None:
        """With index shards, --etcd-endpoints is shard 0: left at its default it becomes shard 0, else it must be."""
        check_run_blocks(self.publish_run_blocks)
        shards = parse_shards(self.etcd_shards)
        if not shards:
            return
        default = next(f.default for f in fields(CommonSettings) if f.name == "etcd_endpoints")
        if self.etcd_endpoints not in (default, shards[0]):
            raise ValueError(f"--etcd-endpoints {self.etcd_endpoints} is not shard 0 of --etcd-shards ({shards[0]})")
        object.__setattr__(self, "etcd_endpoints", shards[0])  # frozen: set once, here

    @property
    def shard_endpoints(self) -> tuple[str, ...]:
        """Each index shard's etcd endpoints, shard 0 first (one shard: --etcd-endpoints)."""
        return parse_shards(self.etcd_shards) or (self.etcd_endpoints,)
