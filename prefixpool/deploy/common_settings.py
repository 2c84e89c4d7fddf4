"""Settings the router and every worker must agree on, declared once.

Both RouterSettings and WorkerSettings extend this class; the Kubernetes
ConfigMap `prefixpool-common` carries exactly these fields for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.deploy.settings import setting


@dataclass(frozen=True)
class CommonSettings:
    etcd_endpoints: str = setting("127.0.0.1:2379", "comma-separated etcd client endpoints host:port")
    cluster: str = setting("default", "cluster namespace under /prefixpool/ in etcd")
    model: str = setting("tiny", "model preset name, or the served name of --model-path "
                         "(enters the block-key namespace)")
    model_path: str = setting("", "checkpoint directory with config.json, *.safetensors and tokenizer.json; "
                              "empty uses the preset")
    dtype: str = setting("float32", "model and KV dtype: float32, bfloat16 or float16 (enters the block-key namespace)")
    block_size: int = setting(16, "tokens per KV block (enters the block-key namespace)")
