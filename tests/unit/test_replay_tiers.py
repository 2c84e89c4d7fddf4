"""The simulator's tiers: a node model that demotes and promotes like the real chain, and more hits with depth."""

import pytest

from prefixpool.replay.simulator import SimConfig, simulate
from prefixpool.replay.sim_node import SimNode
from prefixpool.replay.trace import load_trace
from prefixpool.router.cost_model import profile
from prefixpool.store.keys import BlockKey


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def test_node_demotes_to_host_then_ssd_and_promotes_back():
    node = SimNode("n", capacity=2, host_blocks=2, disk_blocks=2)
    node.store([key(0), key(1)])
    assert set(node.store([key(2), key(3)])) == {key(0), key(1), key(2), key(3)}
    assert [node.tier_of(key(i)) for i in range(4)] == ["host", "host", "device", "device"]
    node.store([key(4), key(5)])
    assert [node.tier_of(key(i)) for i in range(6)] == ["disk", "disk", "host", "host", "device", "device"]
    assert node.lower_blocks([key(0), key(1), key(2)]) == {"disk": 2, "host": 1}
    node.store([key(0), key(1)])  # an SSD hit promoted; 4, 5 demoted push 2, 3 down, and 0, 1 off the SSD
    assert [node.tier_of(key(i)) for i in range(6)] == ["device", "device", "disk", "disk", "host", "host"]
    assert list(node.disk) == [key(3), key(2)]
    node.blocks.check_integrity()


def test_device_only_node_drops_what_it_evicts():
    node = SimNode("n", capacity=2)
    node.store([key(0), key(1)])
    assert set(node.store([key(2), key(3)])) == {key(0), key(1), key(2), key(3)}
    assert node.tier_of(key(0)) is None and not node.host and not node.disk


@pytest.fixture(scope="module")
def conversation():
    return load_trace("conversation", limit=2000)


def test_deeper_tiers_hit_more_at_the_same_device_size(conversation):
    costs = profile("llama-3-70b-a800", 512)
    runs = [simulate(conversation, "cost", SimConfig(num_nodes=4, capacity_blocks=250, costs=costs, host_blocks=h,
                                                     disk_blocks=d)) for h, d in [(0, 0), (1000, 0), (1000, 4000)]]
    device, host, ssd = (r.hit_rate for r in runs)
    assert device < host < ssd
