"""The worker process's settings (flags `--x-y`, environment `PREFIXPOOL_X_Y`)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.deploy.common_settings import CommonSettings
from prefixpool.deploy.settings import setting


@dataclass(frozen=True)
class WorkerSettings(CommonSettings):
    node_id: str = setting("", "unique node name in the cluster (default: host-pid)")
    host: str = setting("", "address the internal HTTP API and the transfer server bind (default: 127.0.0.1 "
                        "when etcd is on loopback, else the local address of the interface routing to etcd)")
    port: int = setting(0, "internal HTTP port (0 picks a free one)")
    advertise_host: str = setting("", "address peers and the router use to reach this worker, put in etcd (default: "
                                  "host; with host 0.0.0.0 the address routing to etcd; "
                                  "never loopback into a remote etcd)")
    role: str = setting("both", "prefill/decode disaggregation: prefill (computes prompts for decode nodes), decode "
                        "(streams answers, receiving prompts' KV from prefill nodes) or both (serves whole requests)")
    transfer: str = setting("tcp", "block transfer transport: tcp or ucx")
    transfer_port: int = setting(0, "transfer server port (0 picks a free one)")
    drain_deadline_s: float = setting(20.0, "on SIGTERM, how long admitted requests may run on before they are "
                                      "ended with an error event (below the manifests' terminationGracePeriodSeconds)")
    lease_ttl_s: int = setting(10, "etcd lease TTL; the node's blocks vanish this long after it dies")
    device: str = setting("auto", "torch device: auto (CUDA when present), cpu, cuda, cuda:N")
    seed: int = setting(0, "seed of a preset's random weights (identical on every worker)")
    num_blocks: int = setting(1024, "KV blocks in the device pool")
    max_batch_size: int = setting(8, "requests decoded together")
    chunk_size: int = setting(512, "prefill chunk, in tokens")
    batch_invariant: bool = setting(False, "every token's K,V, hidden states and logits bit-identical whatever "
                                    "the chunk, batch or cached length (reuse == recompute in bf16); costs "
                                    "speed (benchmarks/engine.md). Workers that share blocks must agree")
    fetch_timeout_s: float = setting(5.0, "deadline of one block fetch from a peer")
    fetch_while_queued: bool = setting(True, "queue a request before its planned fetch ends, "
                                       "so the transfer overlaps the wait")
    cpu_threads: int = setting(1, "torch CPU threads (0 keeps torch's default); "
                               "small kernels on shared cores run best on 1")
    token: str = setting("", "shared token required on the internal API and transfer port")
    corrupt_transfer_every: int = setting(0, "fault injection (chaos tests): flip a byte in blocks N, 2N, ... of "
                                          "every fetch served to peers; 0 is off")
    fault_file: str = setting("", "fault injection (chaos tests): a file naming the fault of each fetch served to "
                              "peers, read as it starts ('corrupt N', 'stall N', 'pause N'; prefixpool/node/faults.py)")
    host_tier_blocks: int = setting(0, "blocks in the host-memory tier under the device pool (0: no host tier)")
    disk_tier_blocks: int = setting(0, "blocks in the local SSD tier (0: no SSD tier)")
    disk_tier_dir: str = setting("", "directory of the SSD tier's block files (kept across restarts)")
    disk_queue_blocks: int = setting(64, "SSD write queue; a block demoted while it is full is dropped")
    min_residency_s: float = setting(0.0, "a newly computed block stays at least this long before eviction")
    soft_pin_blocks: int = setting(0, "budget of blocks soft-pinned as the most hit prefixes (0: off)")
    soft_pin_ttl_s: float = setting(60.0, "how long a soft pin lasts unless refreshed")
    soft_pin_refresh_s: float = setting(10.0, "how often the soft-pinned set is re-chosen")
