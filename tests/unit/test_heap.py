"""The startup heap freeze: what is alive at the call leaves the collector's passes; later garbage does not."""

from __future__ import annotations

import gc

import pytest

from prefixpool.deploy.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_objects_are_not_visited_and_later_cycles_still_collected(unfrozen):
    kept = [{"n": i, "d": {}} for i in range(50_000)]  # long-lived tables, as a server's startup builds
    frozen = freeze_startup_heap()
    assert frozen >= len(kept)
    tracked = {id(o) for o in gc.get_objects(generation=2)}
    assert id(kept[0]) not in tracked and id(kept[-1]["d"]) not in tracked
    _Cycle()  # garbage made after startup: a cycle only the collector frees
    assert gc.collect() >= 1


def test_a_full_pass_after_the_freeze_walks_fewer_objects(unfrozen):
    kept = [[i] for i in range(200_000)]
    before = len(gc.get_objects())
    freeze_startup_heap()
    after = len(gc.get_objects())
    assert after < before - len(kept) // 2, (before, after)
