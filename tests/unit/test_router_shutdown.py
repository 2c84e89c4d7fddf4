"""The router's teardown after a drain: a step that never ends is named in the log and left behind."""

import asyncio
import logging

from prefixpool.deploy.router_cli import _bounded


def test_a_stuck_teardown_step_is_named_and_left_behind(caplog):
    finished = []

    async def stuck() -> None:
        await asyncio.Event().wait()

    async def quick() -> None:
        finished.append("quick")

    async def teardown() -> None:
        await _bounded("mirror", stuck(), timeout_s=0.05)
        await _bounded("publisher", quick(), timeout_s=5)

    with caplog.at_level(logging.WARNING):
        asyncio.run(teardown())
    assert finished == ["quick"]
    assert [r.getMessage() for r in caplog.records] == ["router shutdown: mirror did not stop within 0.05s; going on"]
