"""Many hosts on one machine: Linux network namespaces on a bridge, in 198.18.0.0/15 only.

    with Hosts(3) as hosts:                     # 3 namespaces, each with eth0 on one bridge, lo up
        hosts[0].address                        # 198.18.K.1 (hosts are .1 .. .N; the bridge is .254)
        hosts.spawn(hosts[0], "etcd", python_argv("etcd", "--host", hosts[0].address), log_dir)
        hosts.link_down(hosts[1]) / link_up     # cut a host off the bridge (ip link set ... down)
        hosts.partition(hosts[0], hosts[1])     # cut two hosts apart only (blackhole routes); heal() undoes
        hosts.shape(hosts[1], mbit=200)         # tc tbf on both directions of that host's link
    # on exit, also on failure: processes stopped by pid, namespaces and links deleted

The bridge holds 198.18.K.254, so this process (in the root namespace) reaches
every host. Needs root and `ip`/`tc` (iproute2). As a script:

    python -m prefixpool.testing.hosts up 3      # prints the hosts, keeps them until Enter or Ctrl-C, then removes them

Knows nothing of prefixpool beyond starting its processes by argv.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prefixpool.deploy.processes import Child, spawn

BRIDGE_HOST = 254


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no permission)."""


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    address: str  # its eth0 address on the bridge
    link: str  # the root-namespace end of its veth pair

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for index in range(os.getpid() % 200, os.getpid() % 200 + 250):
        if f"198.18.{index % 250}." not in used:
            return index % 250
    raise HostsUnavailable("no free /24 left in 198.18.0.0/16")


class Hosts:
    def __init__(self, count: int) -> None:
        assert 0 < count < BRIDGE_HOST
        self.count = count
        self.tag = f"{os.getpid() % 100000}"
        self.bridge = f"ppb{self.tag}"
        self.hosts: list[Host] = []
        self.children: list[Child] = []

    def create(self) -> "Hosts":
        if os.geteuid() != 0:
            raise HostsUnavailable("network namespaces need root")
        try:
            self._create()
        except (subprocess.CalledProcessError, FileNotFoundError) as err:
            self.remove()
            detail = getattr(err, "stderr", b"") or b""
            raise HostsUnavailable(f"cannot make network namespaces: {err} {detail.decode(errors='replace')}") from err
        except BaseException:
            self.remove()
            raise
        return self

    def _create(self) -> None:
        subnet = _free_subnet()
        self.subnet = f"198.18.{subnet}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.{BRIDGE_HOST}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.count + 1):
            host = Host(f"pp{self.tag}h{i}", f"{self.subnet}.{i}", f"ppv{self.tag}h{i}")
            self.hosts.append(host)
            _ip("netns", "add", host.name)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _ip("link", "set", host.link, "master", self.bridge)
            _ip("link", "set", host.link, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            _ip("-n", host.name, "link", "set", "lo", "up")

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def spawn(self, host: Host, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
              timeout_s: float = 120.0) -> Child:
        """Start a component inside `host` and wait for its READY line; stopped by pid on remove()."""
        # A host is another machine: it does not inherit this process's choice of UCX device (tests of one
        # machine set UCX_NET_DEVICES=lo, which would leave a worker in a namespace unable to reach a peer).
        argv = ["env", "-u", "UCX_NET_DEVICES", *argv]
        # `ip netns exec` and env exec: the pid is the child's
        child = spawn(name, host.argv(argv), log_dir, env, timeout_s)
        self.children.append(child)
        return child

    def link_down(self, host: Host) -> None:
        _ip("link", "set", host.link, "down")

    def link_up(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def partition(self, a: Host, b: Host) -> None:
        """Cut a and b apart (blackhole routes both ways); both stay reachable from everyone else."""
        _ip("-n", a.name, "route", "add", "blackhole", f"{b.address}/32")
        _ip("-n", b.name, "route", "add", "blackhole", f"{a.address}/32")

    def heal(self, a: Host, b: Host) -> None:
        _ip("-n", a.name, "route", "del", "blackhole", f"{b.address}/32")
        _ip("-n", b.name, "route", "del", "blackhole", f"{a.address}/32")

    def shape(self, host: Host, mbit: int) -> None:
        """Limit the host's link to `mbit` both ways (tbf; netem is not in every kernel)."""
        for prefix, dev in ((["tc"], host.link), (["ip", "netns", "exec", host.name, "tc"], "eth0")):
            subprocess.run([*prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                            "burst", "32kb", "latency", "200ms"], check=True, capture_output=True, timeout=30)

    def sent_bytes(self, host: Host) -> int:
        """Bytes the host has sent through its shaped eth0 since shape() (the qdisc's counter)."""
        out = subprocess.run(host.argv(["tc", "-s", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True,
                             check=True, timeout=30).stdout
        return int(out.split("Sent ", 1)[1].split()[0])

    def unshape(self, host: Host) -> None:
        for prefix, dev in ((["tc"], host.link), (["ip", "netns", "exec", host.name, "tc"], "eth0")):
            subprocess.run([*prefix, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    def remove(self) -> None:
        """Stop every process (ours by pid, then any other pid still inside a namespace), delete the links."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        for host in self.hosts:
            listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout
            for pid in (int(p) for p in listed.split()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)  # takes its veth pair along
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)  # if the namespace never got it
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts.clear()

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "up":
        print(__doc__)
        return 2
    with Hosts(int(argv[1])) as hosts:
        for host in hosts.hosts:
            print(f"{host.name}  {host.address}  (run: ip netns exec {host.name} CMD)", flush=True)
        print(f"bridge {hosts.bridge} {hosts.subnet}.{BRIDGE_HOST}; Enter or Ctrl-C removes everything", flush=True)
        try:
            sys.stdin.readline()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
