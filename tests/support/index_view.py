"""A router ClusterView over a real BlockIndex and FleetLoad, with fixed workers: for unit tests of the Router."""

from __future__ import annotations

from prefixpool.meta.fleet_load import FleetLoad
from prefixpool.meta.index import BlockIndex


class IndexView:
    """What the etcd mirror answers the router, read from a BlockIndex the test fills and a FleetLoad it feeds."""

    def __init__(self, nodes: dict, index: BlockIndex | None = None) -> None:
        self.nodes = nodes
        self.index = BlockIndex() if index is None else index
        self.fleet = FleetLoad()

    def workers(self):
        return self.nodes

    def longest_prefix(self, keys):
        return self.index.longest_prefix(keys)

    def lower_tiers(self, node_id, keys):
        return self.index.lower_tiers(node_id, keys)

    def fleet_share(self, worker, exclude):
        return self.fleet.share(worker, exclude)

    def held_blocks(self, node_id):
        return self.index.num_blocks(node_id)

    def fleet_routed(self, keys, exclude):
        return self.fleet.routed(keys, exclude)

    def report_revision(self, node_id):
        return 0

    def num_keys(self):
        return len(self.index)

    def lag_s(self):
        return 0.0
