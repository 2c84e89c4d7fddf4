"""A vLLM server started with a bounded spin (prefixpool/vllm_connector/serve.py) serves as vLLM does, and
its worker and engine core stop spinning once the requests end.

vLLM 0.32's own setting spins each of them on sched_yield for a second after every message: about a
second of CPU each after the last request. Bounded to 20 ms, both together must use under a quarter
of that (CPU seconds from /proc, not wall time) while the server idles, which they can only do if the
bound reached the processes vLLM started (forked or spawned).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from prefixpool.deploy.priority import group_members
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from prefixpool.testing.proc_cpu import cpu_seconds

pytestmark = pytest.mark.timeout(900)

IDLE_WINDOW_S = 3.0


def complete(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny-vllm", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    started = VllmServer.start(VllmConfig(str(model_dir), "tiny-vllm", num_blocks=160, spin_s=0.02),
                               tmp_path_factory.mktemp("spin"), "spin")
    yield started
    started.stop()


def test_a_bounded_server_answers_and_caches(server):
    prompt = list(range(5, 200))
    first, again = complete(server.url, prompt), complete(server.url, prompt)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160  # whole 32-token blocks of 195


def test_its_worker_and_engine_core_stop_spinning_after_the_requests(server):
    spinners = group_members(server.pid, "VLLM::Worker") + group_members(server.pid, "VLLM::EngineCor")
    assert len(spinners) == 2, f"expected vLLM's worker and engine core in group {server.pid}: {spinners}"
    for i in range(4):
        complete(server.url, [7 + i] + list(range(20, 120)))
    before = sum(cpu_seconds(pid) for pid in spinners)
    time.sleep(IDLE_WINDOW_S)  # a window to count CPU in, not a timing assertion
    spent = sum(cpu_seconds(pid) for pid in spinners) - before
    print(f"worker + engine core: {spent:.3f} CPU s in the {IDLE_WINDOW_S} s after the requests")
    assert spent < 0.25, f"worker + engine core used {spent:.2f} CPU s in the {IDLE_WINDOW_S} s after the requests"
