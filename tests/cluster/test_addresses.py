"""Address rules: bind what is asked, advertise what peers can reach, refuse loopback into a remote etcd.

Workers put their advertised URLs in their node records, routers theirs in their load entries."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from urllib.parse import urlsplit

import pytest

from prefixpool.deploy.addresses import AddressError, advertise_host, bind_host, interface_of, route_source
from prefixpool.deploy.processes import python_argv, spawn
from prefixpool.deploy.vllm_fleet import add_vllm_arguments, on_node, vllm_config
from prefixpool.deploy.vllm_server import bound_host
from tests.conftest import etcdctl_get_prefix

REMOTE_ETCD = "198.18.250.1:2379"  # benchmarking range: routed (by default route) but never contacted


def test_loopback_etcd_keeps_everything_on_loopback():
    assert bind_host("", "127.0.0.1:2379") == "127.0.0.1"
    assert advertise_host("127.0.0.1", "", "127.0.0.1:2379,localhost:2380") == "127.0.0.1"
    assert advertise_host("0.0.0.0", "", "127.0.0.1:2379") == "127.0.0.1"


def test_given_addresses_win():
    assert bind_host("0.0.0.0", REMOTE_ETCD) == "0.0.0.0"
    assert advertise_host("0.0.0.0", "10.9.8.7", REMOTE_ETCD) == "10.9.8.7"
    assert advertise_host("10.9.8.7", "", REMOTE_ETCD) == "10.9.8.7"


def test_nothing_given_with_a_remote_etcd_picks_the_address_routing_to_it():
    try:
        expected = route_source("198.18.250.1")
    except AddressError:
        pytest.skip("this machine has no route towards 198.18.0.0/15 at all")
    assert bind_host("", REMOTE_ETCD) == expected
    assert advertise_host("0.0.0.0", "", REMOTE_ETCD) == expected
    assert interface_of(expected) is not None
    assert interface_of("127.0.0.1") == "lo"


@pytest.mark.parametrize("bound, given", [("127.0.0.1", ""), ("0.0.0.0", "127.0.0.1"), ("10.0.0.5", "localhost")])
def test_loopback_into_a_remote_etcd_is_refused(bound, given):
    with pytest.raises(AddressError, match="loopback"):
        advertise_host(bound, given, REMOTE_ETCD)


@pytest.mark.parametrize("component, flags", [("worker", ("--host", "127.0.0.1")), ("router", ("--host", "127.0.0.1")),
                                              ("router", ("--host", "0.0.0.0", "--advertise-host", "localhost"))])
def test_worker_and_router_refuse_clearly_before_starting_anything(component, flags):
    done = subprocess.run(python_argv(component, *flags, "--etcd-endpoints", REMOTE_ETCD),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "would advertise loopback" in done.stderr and "--advertise-host" in done.stderr
    assert f"prefixpool {component}:" in done.stderr


@pytest.mark.parametrize("flags, host", [(("--host", "0.0.0.0"), "127.0.0.1"),
                                         (("--host", "0.0.0.0", "--advertise-host", "127.0.0.2"), "127.0.0.2")])
def test_router_puts_its_advertised_url_in_its_etcd_entry(etcd, ns, tmp_path, flags, host):
    router = spawn("router", python_argv("router", "--etcd-endpoints", etcd.endpoint, "--cluster", ns, "--port", "0",
                                         "--router-id", "r-addr", *flags), tmp_path)
    try:
        _, kvs = etcdctl_get_prefix(etcd, f"/prefixpool/{ns}/routers/")
    finally:
        router.stop()
    assert [json.loads(value)["url"] for value in kvs.values()] == [router.url]
    assert urlsplit(router.url).hostname == host


def vllm_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)  # the flags of `prefixpool up --vllm` and `prefixpool ray up --vllm`
    return parser.parse_args(["--vllm", "1", "--model-path", "/models/tiny", *flags])


def test_vllm_binds_by_the_address_rules_when_no_host_is_given():
    config = vllm_config(vllm_args())
    assert config.host == ""
    local = on_node(config, "vllm-0", "127.0.0.1:2379", connector=True)
    assert local.host == "127.0.0.1"  # `prefixpool up --vllm`: its etcd is on loopback
    assert json.loads(local.kv_transfer_config)["kv_connector_extra_config"]["host"] == "127.0.0.1"
    assert bound_host(config) == "127.0.0.1"  # a server started without the rules (no etcd known)


def test_vllm_with_a_remote_etcd_and_no_host_binds_the_address_routing_to_it():
    config = vllm_config(vllm_args())
    try:
        expected = route_source("198.18.250.1")
    except AddressError:
        pytest.skip("this machine has no route towards 198.18.0.0/15 at all")
    assert on_node(config, "vllm-0", REMOTE_ETCD, connector=False).host == expected


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "198.18.250.7"])
def test_a_given_vllm_host_is_bound_as_given(host):
    config = dataclasses.replace(vllm_config(vllm_args()), host=host)
    assert on_node(config, "vllm-0", REMOTE_ETCD, connector=False).host == host
    assert on_node(config, "vllm-0", "127.0.0.1:2379", connector=False).host == host
