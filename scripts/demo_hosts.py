"""`prefixpool demo`'s three phases across hosts: etcd, the router and two workers each in a network namespace.

    python scripts/demo_hosts.py [--prefix-repeats 24] [--questions 4]     # as root

Same workload and table as `prefixpool demo` (cold, local hit, remote fetch,
every cached answer re-asked cold), but the fetch crosses a veth bridge
between two namespaces (prefixpool/testing/hosts.py), and every component is started
with only --etcd-endpoints, so each advertises its own host's address.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prefixpool.deploy.demo import DOCUMENT, Demo, _wait_ready
from prefixpool.deploy.processes import Child, python_argv
from prefixpool.testing.hosts import Hosts


@dataclass
class HostsCluster:
    """What Demo reads of a cluster: the router URL and the workers by node id."""

    router_url: str = ""
    workers: dict[str, Child] = field(default_factory=dict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-repeats", type=int, default=24)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--transfer", default="tcp", choices=["tcp", "ucx"])
    args = parser.parse_args()
    with Hosts(4) as hosts, tempfile.TemporaryDirectory(prefix="prefixpool-demo-hosts-") as logs:
        etcd = hosts.spawn(hosts[0], "etcd", python_argv("etcd", "--host", hosts[0].address), Path(logs)).url
        cluster = HostsCluster()
        for i in range(2):
            cluster.workers[f"worker-{i}"] = hosts.spawn(hosts[i + 2], f"worker-{i}", python_argv(
                "worker", "--etcd-endpoints", etcd, "--node-id", f"worker-{i}", "--num-blocks", "2048",
                "--lease-ttl-s", "5", "--transfer", args.transfer), Path(logs))
        cluster.router_url = hosts.spawn(hosts[1], "router", python_argv(
            "router", "--etcd-endpoints", etcd, "--port", "0"), Path(logs)).url
        _wait_ready(cluster.router_url, 2)
        where = ", ".join(f"{name} {child.url}" for name, child in cluster.workers.items())
        print(f"etcd {etcd}; router {cluster.router_url}; {where}\n", flush=True)
        print(Demo(cluster, "tiny", DOCUMENT * args.prefix_repeats, args.questions).run())


if __name__ == "__main__":
    main()
