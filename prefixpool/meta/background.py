"""The one way the control plane's background loops stop: cancel the task and wait until it has.

Membership, the publishers and the mirror each run one loop task; `stop_task` ends it and
swallows only what the cancelled task raised on its way out. Knows nothing of etcd.
"""

from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
