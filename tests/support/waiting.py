"""Helpers shared by the cluster tests (not a test module): waiting for a condition a real process makes true."""

from __future__ import annotations

import asyncio
from typing import Callable


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition` (in a thread: it may run etcdctl) until it holds; AssertionError after timeout_s (a hang)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not await asyncio.to_thread(condition):
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None
