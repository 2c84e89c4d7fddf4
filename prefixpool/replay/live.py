"""Live trace replay: drive a running router with a time-compressed slice of a trace.

Each record becomes a streaming /v1/completions request whose prompt is token
ids made from its block ids (identical ids -> identical tokens), so the
trace's prefix sharing reaches the real pool. Measures TTFT at the client
and the router's reported cached tokens. Bounded: a fixed record list and
at most `concurrency` requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from prefixpool.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord, tokens_of


@dataclass(frozen=True)
class LiveConfig:
    router_url: str
    model: str = "tiny"
    block_tokens: int = 16
    speedup: float = 60.0
    concurrency: int = 8
    max_output: int = 4
    vocab_size: int = 256
    timeout_s: float = 120.0


@dataclass(frozen=True)
class LiveResult:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


async def replay_live(records: list[TraceRecord], config: LiveConfig) -> list[LiveResult]:
    gate = asyncio.Semaphore(config.concurrency)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    start = time.perf_counter()
    origin = records[0].timestamp_ms if records else 0
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(record: TraceRecord) -> LiveResult:
            delay = (record.timestamp_ms - origin) / 1000.0 / config.speedup - (time.perf_counter() - start)
            await asyncio.sleep(max(0.0, delay))
            async with gate:
                return await _request(session, record, config)

        return list(await asyncio.gather(*(one(r) for r in records)))


async def _request(session: aiohttp.ClientSession, record: TraceRecord, config: LiveConfig) -> LiveResult:
    length = max(1, round(record.input_length * config.block_tokens / TRACE_BLOCK_TOKENS))
    prompt = tokens_of(record, config.block_tokens, config.vocab_size, length)
    body = {"model": config.model, "prompt": prompt, "max_tokens": max(1, min(record.output_length, config.max_output)),
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    ttft, cached = None, 0
    try:
        async with session.post(f"{config.router_url}/v1/completions", json=body) as response:
            if response.status != 200:
                return LiveResult(0.0, len(prompt), 0, f"HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return LiveResult(0.0, len(prompt), 0, chunk["error"]["message"])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - sent
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return LiveResult(0.0, len(prompt), 0, repr(err))
    return LiveResult(ttft or 0.0, len(prompt), cached)


def summary_table(results: list[LiveResult]) -> str:
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok]) if ok else np.zeros(1)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return "\n".join([
        "| requests | errors | cached / prompt tokens | TTFT mean ms | p50 | p90 | p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(results)} | {len(results) - len(ok)} | {cached:,} / {prompt:,} ({cached / max(prompt, 1):.3f}) | "
        f"{ttft.mean() * 1e3:.1f} | {np.quantile(ttft, .5) * 1e3:.1f} | {np.quantile(ttft, .9) * 1e3:.1f} | "
        f"{np.quantile(ttft, .99) * 1e3:.1f} |",
    ])
