"""`prefixpool ray up|down`: deploy on (or remove from) an existing Ray cluster.

Every PREFIXPOOL_* variable of this shell is passed to the actors' processes,
so worker and router settings are given the same way as everywhere else;
except the addresses (PER_NODE), which describe this machine, not the node an
actor lands on: there each actor reads its node's own environment.
"""

from __future__ import annotations

import argparse
import os

from prefixpool.deploy.vllm_fleet import add_vllm_arguments, num_vllm_servers, vllm_config

PER_NODE = ("PREFIXPOOL_HOST", "PREFIXPOOL_ADVERTISE_HOST")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--address", default="auto", help="Ray cluster: auto, HOST:PORT or ray://HOST:10001")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker actors (one GPU each where GPUs exist; default 2, 0 with --vllm)")
    parser.add_argument("--etcd-endpoints", default="",
                        help="existing etcd; empty starts one as an actor on the head node")
    parser.add_argument("--etcd-port", type=int, default=2379,
                        help="client port of the etcd actor (peer port: +1); fixed, so a restarted actor keeps its "
                             "endpoint")
    parser.add_argument("--etcd-data-dir", default="",
                        help="etcd actor's data dir on the head node (default: TMPDIR/prefixpool-ray-etcd-PORT); "
                             "kept across restarts")
    parser.add_argument("--router-host", default="", help="address the router actor binds (default: the router's "
                        "own rule: loopback on a one-node cluster, the head's address on several; "
                        "0.0.0.0 in Kubernetes)")
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--prefill", type=int, default=0, help="prefill/decode disaggregation: prefill worker "
                        "actors (worker --role prefill), beside --workers")
    parser.add_argument("--decode", type=int, default=0, help="decode worker actors (worker --role decode)")
    add_vllm_arguments(parser)  # vLLM actors: a vLLM server and its sidecar each (--vllm-prefill/--vllm-decode too)


def run(args: argparse.Namespace) -> int:
    import ray

    from prefixpool.deploy import ray_deploy

    ray.init(address=args.address, namespace=ray_deploy.NAMESPACE, log_to_driver=False)
    if args.action == "down":
        print("removed:", ", ".join(ray_deploy.down()) or "nothing")
        return 0
    env = {k: v for k, v in os.environ.items() if k.startswith("PREFIXPOOL_") and k not in PER_NODE}
    disaggregated = args.prefill or args.decode
    workers = args.workers if args.workers is not None else (0 if num_vllm_servers(args) or disaggregated else 2)
    deployment = ray_deploy.up(workers, etcd_endpoints=args.etcd_endpoints, etcd_port=args.etcd_port,
                               etcd_data_dir=args.etcd_data_dir, router_port=args.router_port,
                               router_host=args.router_host, env=env, vllm=vllm_config(args), num_vllm=args.vllm,
                               vllm_connector=args.vllm_connector, num_prefill=args.prefill, num_decode=args.decode,
                               num_vllm_prefill=args.vllm_prefill, num_vllm_decode=args.vllm_decode)
    print(f"router: {deployment.router_url}\netcd: {deployment.etcd_endpoints}\n"
          f"workers: {', '.join([*deployment.worker_names, *deployment.vllm_names])}")
    print(f"worker urls: {', '.join(deployment.worker_urls)}")
    return 0
