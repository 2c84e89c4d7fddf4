"""vLLM's load, read from its Prometheus /metrics: requests waiting and running, summed over engines.

    vllm:num_requests_running{engine="0",model_name="m"} 3.0   ─▶ Load(num_queued=waiting, num_running=3)
    vllm:num_requests_waiting{engine="0",model_name="m"} 1.0

Knows nothing of etcd or of what the load is for.
"""

from __future__ import annotations

import aiohttp

from prefixpool.meta.load_report import Load

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def parse_load(text: str) -> Load | None:
    """None when either gauge is missing (not vLLM, or metrics off)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (RUNNING, WAITING):
            try:
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
    if RUNNING not in totals or WAITING not in totals:
        return None
    return Load(num_queued=int(totals[WAITING]), num_running=int(totals[RUNNING]))


async def sample_load(session: aiohttp.ClientSession, vllm_url: str) -> Load | None:
    """vLLM's load now; None when it does not answer."""
    try:
        async with session.get(f"{vllm_url}/metrics") as response:
            if response.status != 200:
                return None
            return parse_load(await response.text())
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
