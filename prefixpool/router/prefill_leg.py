"""The prefill node's half of a disaggregated request (our workers): run the prompt there, drop its answer.

    leg = PrefillLeg.start(client, prefill_url, request, on_end)   # max_tokens 1, sent beside the decode request
    ...the decode node fetches the blocks the prefill node commits, then streams the answer...
    await leg.close()                                              # cancelled if still running; on_end() ran

The prefill node computes the prompt as any request (chunked, committing and publishing each full
block), samples one token nobody reads, and releases the request's blocks: they stay cached, unheld,
so a finished request pins nothing there. Its failure is logged and counted, never raised: the decode
node computes whatever did not arrive (prefixpool/worker/handoff.py). Knows nothing of policies or HTTP
servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable, Protocol

from prefixpool.contract.worker_api import Done, Event, Failed, GenerateRequest
from prefixpool.router.worker_client import WorkerUnreachable

log = logging.getLogger(__name__)


class GeneratesEvents(Protocol):
    def generate(self, worker_url: str, request: GenerateRequest) -> AsyncIterator[Event]: ...


class PrefillLeg:
    def __init__(self, task: asyncio.Task) -> None:
        self.task = task

    @classmethod
    def start(cls, client: GeneratesEvents, url: str, request: GenerateRequest,
              on_end: Callable[[], None]) -> "PrefillLeg":
        return cls(asyncio.create_task(_run(client, url, request, on_end), name=f"prefill-{request.request_id}"))

    async def close(self) -> bool:
        """Stop the leg if it still runs (its stream closes, the prefill node frees the request); whether it
        had ended by itself."""
        ended = self.task.done()
        if not ended:
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return ended

    @property
    def ttft_s(self) -> float | None:
        """The prefill node's own time to its one token (its queue and the prompt's compute), once it finished
        the prompt; None while running, cancelled or failed."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return None
        return self.task.result()


async def _run(client: GeneratesEvents, url: str, request: GenerateRequest,
               on_end: Callable[[], None]) -> float | None:
    """The prefill node's Usage.ttft_s when it finished the prompt; None when it did not."""
    ttft_s = None
    try:
        async with contextlib.aclosing(client.generate(url, request)) as events:
            async for event in events:
                if isinstance(event, Failed):
                    log.warning("prefill %s on %s failed: %s", request.request_id, url, event.message)
                    return None
                if isinstance(event, Done):
                    ttft_s = event.usage.ttft_s
        return ttft_s
    except WorkerUnreachable as err:
        log.warning("prefill %s on %s broke off: %s; the decode node computes the rest", request.request_id, url, err)
        return None
    finally:
        on_end()
