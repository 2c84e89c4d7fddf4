"""The router process's settings (flags `--x-y`, environment `PREFIXPOOL_X_Y`)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.settings import setting


@dataclass(frozen=True)
class RouterSettings:
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port to bind (0 picks a free one)")
    etcd_endpoints: str = setting("127.0.0.1:2379", "comma-separated etcd client endpoints host:port")
    cluster: str = setting("default", "cluster namespace under /prefixpool/ in etcd")
    model: str = setting("tiny", "served model name (a preset or the checkpoint's name); must match the workers")
    model_path: str = setting("", "checkpoint directory (config.json, tokenizer.json); empty uses the preset")
    dtype: str = setting("float32", "KV dtype of the workers (enters the block-key namespace)")
    block_size: int = setting(16, "tokens per KV block; must match the workers")
    policy: str = setting("cost", "routing policy: cost, cost_local, least_load, longest_prefix, round_robin, random")
    api_key: str = setting("", "if set, clients must send 'Authorization: Bearer <key>'")
    worker_token: str = setting("", "shared token sent to workers' internal API")
    max_retries: int = setting(2, "retries on another worker when one fails before streaming")
    request_timeout_s: float = setting(300.0, "longest a worker may stay silent mid-stream")
    default_max_tokens: int = setting(64, "max_tokens when a request gives none")
    prefill_tokens_per_s: float = setting(2000.0, "prefill speed assumed until workers report a measured one")
    decode_step_s: float = setting(0.01, "TTFT the cost model adds per request already running on a worker")
    link_bytes_per_s: float = setting(1e9, "bandwidth between workers assumed by the cost model")
