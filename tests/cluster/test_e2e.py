"""End to end with the official `openai` client: a live router, 2 workers and etcd on 127.0.0.1."""

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from prefixpool.deploy.launcher import LocalCluster

WORKER_ARGS = ("--lease-ttl-s", "3", "--num-blocks", "512", "--max-batch-size", "8")
SHARED = "You are a careful assistant. Answer in one short sentence, using plain words only. " * 2


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, worker_args=WORKER_ARGS) as running:
        _wait_for_workers(running.router_url, 2)
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _wait_for_workers(url: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/healthz") as reply:
            if json.load(reply)["workers"] == count:
                return
        time.sleep(0.2)
    raise AssertionError(f"router never saw {count} workers")


def post(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def complete(client, prompt, salt="", max_tokens=12, **extra):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"cache_salt": salt, **extra})


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_completion_chat_and_stream(client):
    text = complete(client, SHARED + "Say hi.")
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(client.completions.create(model="tiny", prompt=SHARED + "Say hi.", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_shared_prefix_is_reused_and_output_equals_cold(client):
    prompt = SHARED + "What is a prefix cache?"
    first = complete(client, prompt, salt="reuse")
    again = complete(client, prompt + " Explain briefly.", salt="reuse")
    assert cached(first) == 0
    assert cached(again) >= len(SHARED) // 16 * 16 - 16
    cold = complete(client, prompt + " Explain briefly.", salt="reuse-cold-oracle")
    assert cached(cold) == 0
    assert again.choices[0].text == cold.choices[0].text


def test_tenants_never_share_blocks(client):
    prompt = SHARED + "Tenant question."
    assert cached(complete(client, prompt, salt="tenant-a")) == 0
    assert cached(complete(client, prompt, salt="tenant-b")) == 0
    assert cached(complete(client, prompt, salt="tenant-a")) > 0


def test_busy_holder_sends_to_idle_worker_with_a_fetch(cluster, client):
    # Long enough that fetching its blocks beats recomputing them, even for the tiny CPU model.
    prompt = SHARED * 12 + "Busy holder question, with a long shared part that the idle worker fetches."
    complete(client, prompt, salt="fetch")
    status, route = post(cluster.router_url, "/v1/route", {"model": "tiny", "prompt": prompt, "cache_salt": "fetch"})
    holder = route["worker"]
    assert status == 200 and route["local_blocks"] > 0
    # Keep the holder busy with long requests sent straight to it; its load report reaches the router via etcd.
    busy = [_start_direct(cluster.workers[holder].url, i) for i in range(4)]
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            _, route = post(cluster.router_url, "/v1/route", {"model": "tiny", "prompt": prompt, "cache_salt": "fetch"})
            if route["worker"] != holder:
                break
            time.sleep(0.2)
        assert route["worker"] != holder and route["fetch"]["from"] == holder
        moved = complete(client, prompt, salt="fetch")
        assert moved.usage.model_extra["prefixpool"]["fetched_tokens"] > 0
    finally:
        for response in busy:
            response.close()
    cold = complete(client, prompt, salt="fetch-cold-oracle")
    assert moved.choices[0].text == cold.choices[0].text


def _start_direct(worker_url: str, seed: int):
    body = {"request_id": f"busy-{seed}", "tokens": list(range(1, 200)),
            "sampling": {"max_tokens": 1000, "seed": seed, "ignore_eos": True}}
    request = urllib.request.Request(worker_url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    response.readline()  # the first token: it is running
    return response


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "x"}, 422, None),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 422, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -5}, 422, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": 9}, 422, "temperature"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x" * 9000, "max_tokens": 10}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, "a"]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [100000]}, 400, "prompt"),
])
def test_bad_input_gets_an_openai_error(cluster, body, status, param):
    code, reply = post(cluster.router_url, "/v1/completions", body)
    assert code == status
    assert reply["error"]["message"] and reply["error"]["type"]
    if param:
        assert reply["error"]["param"] == param


def test_unknown_route_is_a_json_404(cluster):
    code, reply = post(cluster.router_url, "/v1/nothing", {})
    assert code == 404 and "error" in reply


def test_worker_sigkill_is_survived(cluster, client):
    prompt = SHARED + "Survive a dead worker."
    victim_id = "worker-1"
    victim = cluster.workers[victim_id]
    os.kill(victim.pid, signal.SIGKILL)
    victim.process.wait()
    answers = [complete(client, f"{prompt} #{i}", salt="sigkill") for i in range(4)]
    assert all(a.usage.completion_tokens == 12 for a in answers)
    _wait_for_workers(cluster.router_url, 1, timeout_s=15)  # its lease expired: gone from the index
    cluster.start_worker(victim_id)
    _wait_for_workers(cluster.router_url, 2)
    assert complete(client, prompt, salt="sigkill").usage.completion_tokens == 12


def _metrics(router_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{router_url}/metrics") as reply:
        text = reply.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_report_requests_hits_and_the_index(cluster, client):
    missed_before = _metrics(cluster.router_url).get("prefixpool_missed_hit_blocks_total", 0.0)
    complete(client, SHARED + "metrics", salt="metrics")
    complete(client, SHARED + "metrics again", salt="metrics")
    values = _metrics(cluster.router_url)
    assert values['prefixpool_requests_total{endpoint="/v1/completions",status="200"}'] >= 2
    assert values["prefixpool_cached_tokens_total"] > 0
    assert values["prefixpool_ttft_seconds_count"] >= 2
    assert values["prefixpool_index_keys"] > 0
    assert values["prefixpool_workers"] >= 1
    assert values["prefixpool_hit_fraction_count"] >= 2
    # plans counted on blocks; whatever the second request's plan counted on, the worker reused
    assert values["prefixpool_planned_hit_blocks_total"] > 0
    assert values["prefixpool_missed_hit_blocks_total"] == missed_before


def test_live_trace_replay_reuses_the_traces_prefixes(cluster):
    from prefixpool.replay.live import LiveConfig, replay_live, summary_table
    from prefixpool.replay.trace import load_trace

    records = load_trace("conversation", limit=12)
    config = LiveConfig(cluster.router_url, block_tokens=32, speedup=1000.0, concurrency=1, max_output=2,
                        vocab_size=250)
    results = asyncio.run(replay_live(records, config))
    assert [r.error for r in results] == [None] * len(records)
    assert sum(r.cached_tokens for r in results) > 0  # every conversation request starts with block id 0
    assert all(r.ttft_s > 0 for r in results)
    assert "| 12 | 0 |" in summary_table(results)


def test_client_gone_mid_stream_frees_the_worker(cluster):
    body = {"model": "tiny", "prompt": SHARED + "walk away", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(f"{cluster.router_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    reply = urllib.request.urlopen(request, timeout=60)
    assert reply.readline().startswith(b"data: ")
    reply.close()  # the client goes away mid-stream

    def idle() -> bool:
        reports = []
        for child in cluster.workers.values():
            with urllib.request.urlopen(f"{child.url}/debug/pool", timeout=10) as pool:
                reports.append(json.load(pool))
        return all(r["integrity"] == "ok" and r["num_streams"] == 0 and r["num_pinned"] == 0 for r in reports)

    deadline = time.monotonic() + 20
    while not idle():
        assert time.monotonic() < deadline, "a request whose client left still holds a worker's blocks"
        time.sleep(0.2)
