"""vLLM's load and cache size, read from its Prometheus /metrics: requests waiting and running, summed
over engines, and the KV blocks it allocated.

    vllm:num_requests_running{engine="0",model_name="m"} 3.0   ─▶ Load(num_queued=waiting, num_running=3)
    vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
    vllm:cache_config_info{...,num_gpu_blocks="150",...} 1.0  ─▶ 149 blocks (one is vLLM's null block)

Knows nothing of etcd or of what the load is for.
"""

from __future__ import annotations

import re

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


def parse_num_blocks(text: str) -> int | None:
    """The KV blocks vLLM can fill with prefixes (its null block left out); None when it does not say."""
    found = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    return max(0, int(found.group(1)) - 1) if found else None


async def sample_num_blocks(session: aiohttp.ClientSession, vllm_url: str) -> int | None:
    """vLLM's KV cache size in blocks (the node record's num_blocks: what the router prices eviction by)."""
    try:
        async with session.get(f"{vllm_url}/metrics") as response:
            return parse_num_blocks(await response.text()) if response.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
