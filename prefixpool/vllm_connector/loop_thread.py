"""An asyncio event loop on a daemon thread, for code that vLLM calls synchronously.

    loop = LoopThread("prefixpool-pool")
    result = loop.run(coroutine, timeout_s=5.0)   # blocks the caller; TimeoutError past the limit
    future = loop.submit(coroutine)               # returns at once: a concurrent.futures.Future
    loop.call(function, *args)                    # a plain function run on the loop, waited for
    loop.close()                                   # cancels what still runs, joins the thread

vLLM calls a KV connector from its engine thread, without an event loop; the
pool's transfer server, etcd lease and publisher are asyncio code that must
keep running between those calls (peers fetch at any time). So they live on
this loop, and every block operation runs there (NodeBlocks is single-threaded).
Knows nothing of vLLM or of the pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coroutine` on the loop; its future's callbacks run on the loop's thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, function: Callable[..., T], *args: Any) -> T:
        return self.run(_apply(function, args))

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for it; on timeout it is cancelled and TimeoutError raised."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"gave up after {timeout_s}s") from None

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        self.run(_cancel_others(), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


async def _apply(function: Callable[..., T], args: tuple) -> T:
    return function(*args)


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
