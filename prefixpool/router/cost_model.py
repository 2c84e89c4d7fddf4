"""The cost model behind the `cost` policy: predicted seconds for queueing, prefill and transfer.

    queue_s    = queued prefill tokens / prefill speed + running requests x decode step
    prefill_s  = computed / prefill speed + attention x computed x (cached + computed / 2)
    transfer_s = setup + blocks x block_bytes / link bandwidth
    tier read  = blocks x block_bytes / tier bandwidth   (host or SSD hit, between a
                 device hit, which is free, and a recompute)
    lost reuse = weight x prefill of the tokens the fleet holds but this worker would
                 recompute (not a TTFT: the work every later request on that node waits behind)

Numbers come from a named profile or from the workers' measured prefill
speed. Knows nothing of nodes, HTTP or etcd.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefixpool.store.tier_names import DEVICE, DISK, HOST

GB = 1e9


@dataclass(frozen=True)
class CostModel:
    block_size: int = 16
    block_bytes: int = 16 * 128 * 1024  # Llama-3-8B, bf16: 128 KiB per token
    prefill_tokens_per_s: float = 10_000.0
    attention_s_per_token_pair: float = 0.0  # the quadratic part of prefill
    decode_step_s: float = 0.0  # queue wait added per request already running
    link_bytes_per_s: float = 10 * GB
    transfer_setup_s: float = 0.001
    host_read_bytes_per_s: float = 20 * GB
    ssd_read_bytes_per_s: float = 3 * GB
    # A held prefix recomputed elsewhere costs this request its prefill and, once more, every request
    # that queues behind that work; the TTFT alone is myopic (it gives up affinity for a short queue).
    lost_reuse_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("speeds must be positive")
        if self.lost_reuse_weight < 0:
            raise ValueError("lost_reuse_weight must be >= 0")

    def prefill_s(self, computed_tokens: int, cached_tokens: int) -> float:
        linear = computed_tokens / self.prefill_tokens_per_s
        quadratic = self.attention_s_per_token_pair * computed_tokens * (cached_tokens + computed_tokens / 2)
        return linear + quadratic

    def transfer_s(self, num_blocks: int) -> float:
        return self.transfer_setup_s + num_blocks * self.block_bytes / self.link_bytes_per_s

    def queue_s(self, queued_prefill_tokens: int, num_running: int) -> float:
        return queued_prefill_tokens / self.prefill_tokens_per_s + num_running * self.decode_step_s

    def tier_read_s(self, tier: str, num_blocks: int) -> float:
        """Seconds to bring `num_blocks` up from `tier` (a worker's "disk" tier is the SSD)."""
        bandwidth = {DEVICE: None, HOST: self.host_read_bytes_per_s, DISK: self.ssd_read_bytes_per_s,
                     "ssd": self.ssd_read_bytes_per_s}[tier]  # "ssd": what operators call the disk tier
        return 0.0 if bandwidth is None else num_blocks * self.block_bytes / bandwidth

    def with_prefill_speed(self, tokens_per_s: float) -> "CostModel":
        return dataclasses.replace(self, prefill_tokens_per_s=tokens_per_s)


# Named profiles. Assumptions, stated so they can be checked:
# - llama-3-70b-a800: one prefill node = 8x A800 (312 TFLOPS bf16 peak each) at ~40% MFU
#   over 2 x 70e9 FLOP/token -> ~7,100 tokens/s; attention adds 2 x 80 layers x 8192 dims
#   x 2 FLOP per token pair -> ~1.1e-9 s per pair at that rate. KV 320 KiB/token (80 layers,
#   8 KV heads x 128 dims x 2 x bf16). Links: 8 x 200 Gbps RDMA NICs ~ 100 GB/s usable.
# - llama-3-8b-h100: one H100 (989 TFLOPS bf16) at ~40% MFU over 16e9 FLOP/token -> ~25k
#   tokens/s; KV 128 KiB/token; one 400 Gbps NIC ~ 40 GB/s usable.
PROFILES: dict[str, dict] = {
    "llama-3-70b-a800": dict(prefill_tokens_per_s=7_100.0, attention_s_per_token_pair=1.1e-9,
                             per_token_bytes=320 * 1024, link_bytes_per_s=100 * GB, transfer_setup_s=0.0005),
    "llama-3-8b-h100": dict(prefill_tokens_per_s=25_000.0, attention_s_per_token_pair=1.1e-10,
                            per_token_bytes=128 * 1024, link_bytes_per_s=40 * GB, transfer_setup_s=0.0005),
}


def profile(name: str, block_size: int) -> CostModel:
    """The CostModel of a named profile at a given block size."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}")
    spec = dict(PROFILES[name])
    per_token = spec.pop("per_token_bytes")
    return CostModel(block_size=block_size, block_bytes=per_token * block_size, **spec)
