"""The router process's settings (flags `--x-y`, environment `PREFIXPOOL_X_Y`)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.deploy.common_settings import CommonSettings
from prefixpool.deploy.settings import setting


@dataclass(frozen=True)
class RouterSettings(CommonSettings):
    host: str = setting("", "address to bind (default: 127.0.0.1 when etcd is on loopback, else the local address "
                        "of the interface routing to etcd; 0.0.0.0 binds all)")
    advertise_host: str = setting("", "address clients, operators and other routers reach this router at, put in its "
                                  "etcd load entry (default: host; with host 0.0.0.0 the address routing to etcd; "
                                  "never loopback into a remote etcd)")
    port: int = setting(8000, "port to bind (0 picks a free one)")
    policy: str = setting("cost", "routing policy: cost, cost_local, pressure, least_load, longest_prefix, "
                                  "round_robin, random")
    api_key: str = setting("", "if set, clients must send 'Authorization: Bearer <key>'")
    worker_token: str = setting("", "shared token sent to workers' internal API")
    max_retries: int = setting(2, "retries on another worker when one fails before streaming")
    request_timeout_s: float = setting(300.0, "longest a worker may stay silent mid-stream")
    drain_deadline_s: float = setting(20.0, "on SIGTERM, how long in-flight requests may run on before they are "
                                      "ended with an error event (below the manifests' terminationGracePeriodSeconds)")
    default_max_tokens: int = setting(64, "max_tokens when a request gives none")
    prefill_tokens_per_s: float = setting(2000.0, "prefill speed assumed until workers report a measured one")
    decode_step_s: float = setting(0.01, "TTFT the cost model adds per request already running on a worker")
    link_bytes_per_s: float = setting(1e9, "bandwidth between workers assumed by the cost model")
    lost_reuse_weight: float = setting(2.0, "cost policy: weight on recomputing a prefix another node holds, "
                                       "beyond this request's TTFT (the work later requests queue behind)")
    pd_interference_weight: float = setting(1.0, "prefill/decode fleets: seconds of stalled decoding priced per "
                                            "second of prompt compute on a decoding node, per request it decodes "
                                            "(higher disaggregates shorter prompts)")
    pd_handoff_setup_s: float = setting(0.005, "prefill/decode fleets: a handoff's cost beyond its priced terms "
                                        "until handoffs are seen; the router then learns it per pair kind")
    pd_handoff_wait_s: float = setting(5.0, "a decode node computes the rest itself once the prefill node's blocks "
                                       "stop coming for this long (plus twice the predicted prefill)")
    processes: int = setting(1, "router processes serving one port (SO_REUSEPORT), each with its own etcd mirror")
    router_id: str = setting("", "this router's name in etcd (its load entry); empty: <hostname>-<pid>")
    lease_ttl_s: int = setting(10, "TTL of the router's etcd lease: a dead router's load entry vanishes after it")
    load_publish_s: float = setting(0.02, "at most one put of this router's in-flight load per this many seconds")
    load_publish_alone_s: float = setting(1.0, "the same while no other router is routing (an end is ordered at "
                                          "once by a read of etcd's revision: the workers' own load reports need "
                                          "it)")
