"""A worker's drain on SIGTERM: leave the cluster first, then let the admitted work finish.

    1. gate.begin(deadline)   new /generate: 503 that the router retries elsewhere; /healthz 503
    2. node.leave()           nothing more is written under the lease, then it is revoked: the
                              record and every block key leave etcd at once, so each router
                              drops this node on its next mirror event
    3. gate.wait()            admitted requests, streams included, finish; past the deadline
                              the ones left end with a Failed event (never a truncated body)
    4. transfer idle          peers mid-fetch finish reading: the node core's transfer server
                              stays up until here, bounded by what is left of the deadline
The caller then closes the servers (node.close()) and exits 0. Knows nothing of HTTP or engines.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prefixpool.contract.drain import Drain, DrainReport
from prefixpool.node.core import NodeCore

log = logging.getLogger(__name__)


async def drain_worker(gate: Drain, node: NodeCore, deadline_s: float, poll_s: float = 0.02) -> DrainReport:
    """Steps 1 to 4 above; the report of the HTTP drain (transfer reads waited for as well)."""
    deadline = time.monotonic() + deadline_s
    gate.begin(deadline_s)
    await node.leave()
    report = await gate.wait()
    source = node.source
    while source.num_sending and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    if source.num_sending:
        log.warning("drain deadline: %d transfer reads cut; the peers recompute", source.num_sending)
    return report
