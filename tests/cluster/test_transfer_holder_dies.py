"""A holder process SIGKILLed in the middle of a stream: the fetcher keeps the verified prefix that arrived."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prefixpool.transfer import fetch
from tests.unit.test_transfer import TRANSPORTS, assert_clean, assert_received, hold, keys_for, node, release, url

HOLDER_PROCESS = """
import asyncio, sys
from tests.unit.test_transfer import DyingSource, hold, keys_for, node
from prefixpool.transfer import serve

async def main():
    pool, arena = node(16)
    hold(pool, arena, keys_for(12), seed=7)
    server = await serve(pool, arena, sys.argv[1], source=DyingSource(pool, arena, die_after=5))
    print(server.url, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_holder_killed_mid_stream_returns_what_arrived(transport):
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_PROCESS, url(transport)], stdout=subprocess.PIPE, text=True, cwd=root, env=env
    )
    try:
        peer_url = holder.stdout.readline().strip()
        assert peer_url.startswith(transport)
        keys = keys_for(12)
        pool, arena = node(16)
        result = asyncio.run(fetch(peer_url, keys, pool, arena, deadline_s=60))
        assert holder.wait(timeout=30) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    expected_pool, expected_arena = node(16)
    blocks = hold(expected_pool, expected_arena, keys, seed=7)
    assert result.keys == keys[:5]
    assert_received(result, pool, arena, keys, blocks)
    assert_clean(pool, pinned=5)
    release(result, pool)
