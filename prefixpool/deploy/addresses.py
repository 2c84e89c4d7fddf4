"""Which address a component binds and which it advertises to peers, decided once at start.

    bind_host(host, etcd)            host if given; else 127.0.0.1 when etcd is on loopback,
                                     else the local address of the interface that routes to etcd
    advertise_host(bound, given, etcd)
                                     given if any; else the bound address, or (bound to 0.0.0.0)
                                     the address routing to etcd; loopback advertised into a
                                     non-loopback etcd is refused (AddressError): peers on other
                                     machines would call themselves (workers and routers alike)
    interface_of(address)            the interface holding it (what UCX_NET_DEVICES names)

Knows nothing of what is served on these addresses.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARDS = ("0.0.0.0", "::")
_SIOCGIFADDR = 0x8915


class AddressError(ValueError):
    """No usable address to advertise, or one that peers on other machines could not reach."""


def etcd_hosts(endpoints: str) -> list[str]:
    return [e.strip().rsplit(":", 1)[0].strip("[]") for e in endpoints.split(",") if e.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: assume it names another machine


def etcd_on_loopback(endpoints: str) -> bool:
    return all(is_loopback(h) for h in etcd_hosts(endpoints))


def route_source(peer_host: str) -> str:
    """The local address the kernel would use to reach `peer_host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer_host, 9))
        except OSError as err:
            raise AddressError(f"no route to etcd host {peer_host}: {err}; pass --host / --advertise-host") from err
        return sock.getsockname()[0]


def bind_host(host: str, etcd_endpoints: str) -> str:
    if host:
        return host
    if etcd_on_loopback(etcd_endpoints):
        return "127.0.0.1"
    return route_source(etcd_hosts(etcd_endpoints)[0])


def _reachable_host(bound: str, etcd_endpoints: str) -> str:
    """The bound address, or (bound to every interface) the one a peer of etcd would reach."""
    if bound not in WILDCARDS:
        return bound
    return "127.0.0.1" if etcd_on_loopback(etcd_endpoints) else route_source(etcd_hosts(etcd_endpoints)[0])


def advertise_host(bound: str, given: str, etcd_endpoints: str) -> str:
    chosen = given or _reachable_host(bound, etcd_endpoints)
    if is_loopback(chosen) and not etcd_on_loopback(etcd_endpoints):
        raise AddressError(
            f"would advertise loopback {chosen} into etcd at {etcd_endpoints}, which is not on loopback: peers on "
            "other machines could not reach it; pass --host with a routable address (or 0.0.0.0) "
            "or --advertise-host")
    return chosen


def interface_of(address: str) -> str | None:
    """The name of the interface whose IPv4 address is `address`, if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this one
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None
