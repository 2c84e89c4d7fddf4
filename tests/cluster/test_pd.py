"""Prefill/decode disaggregation on a live fleet of our workers: `up --prefill 1 --decode 1`, then its faults.

Every answer is checked against an independent engine (the same tiny preset, in this process, computing
the whole prompt itself): the handoff, a damaged or stalled transfer, a dead prefill node and a dead
decode node all cost time only, never a different greedy answer.
"""

import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.worker_cli import build_engine
from prefixpool.deploy.worker_settings import WorkerSettings
from prefixpool.engine.sampling import SamplingParams
from prefixpool.model.tokenizer import ByteTokenizer
from tests.cluster.test_e2e import SHARED, WORKER_ARGS, _metrics, _wait_for_workers, post

PD_ARGS = (*WORKER_ARGS, "--chunk-size", "64", "--fetch-timeout-s", "1")  # blocks appear 4 at a time
# A fast CPU prefills the tiny model's 1200 tokens in a few ms: weight 4 keeps them worth disaggregating there too
ROUTER_ARGS = ("--pd-handoff-wait-s", "1", "--pd-interference-weight", "4")
LONG = SHARED * 7  # ~1200 tokens: prefill on the decode node would stall its decoding more than a handoff costs
TOKENIZER = ByteTokenizer()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fault_file = tmp_path_factory.mktemp("pd") / "fault"
    fault_file.write_text("")
    with LocalCluster(num_workers=0, num_decode=1, worker_args=PD_ARGS, router_args=ROUTER_ARGS) as running:
        running.fault_file = fault_file
        running.start_worker("prefill-0", "prefill", ("--fault-file", str(fault_file)))
        _wait_for_workers(running.router_url, 2)
        yield running


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle():
    """Greedy text of the whole prompt computed by one engine, nothing reused or moved."""
    engine = build_engine(WorkerSettings(num_blocks=256, device="cpu"))

    def answer(prompt: str, max_tokens: int) -> str:
        tokens, _ = engine.generate(TOKENIZER.encode(prompt), SamplingParams(max_tokens=max_tokens))
        return TOKENIZER.decode(tokens)
    return answer


def stream(client, prompt: str, salt: str, max_tokens: int = 16, on_chunk=None):
    """(text, usage) of a streamed greedy completion; on_chunk(i) runs after each chunk."""
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"cache_salt": salt})
    text, usage = "", None
    for i, chunk in enumerate(chunks):
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
        if on_chunk is not None:
            on_chunk(i)
    return text, usage


def route(fleet, prompt: str, salt: str) -> dict:
    status, plan = post(fleet.router_url, "/v1/route", {"model": "tiny", "prompt": prompt, "cache_salt": salt})
    assert status == 200
    return plan


def pool(fleet, node: str) -> dict:
    with urllib.request.urlopen(f"{fleet.workers[node].url}/debug/pool") as reply:
        return json.load(reply)


def full_block_tokens(prompt: str) -> int:
    return len(TOKENIZER.encode(prompt)) // 16 * 16


def test_a_long_prompt_is_prefilled_on_the_prefill_node_and_streamed_by_the_decode_node(fleet, client, oracle):
    prompt = LONG + "Handoff question."
    plan = route(fleet, prompt, "pd")
    assert plan["roles"] == {"prefill-0": "prefill", "decode-0": "decode"}
    assert plan["prefill"]["node"] == "prefill-0" and plan["decode"]["node"] == "decode-0"
    assert plan["disaggregation"]["mode"] == "disaggregated" and plan["disaggregation"]["why"]
    assert plan["decode"]["fetch"]["from"] == "prefill-0"
    before = _metrics(fleet.router_url)
    text, usage = stream(client, prompt, "pd")
    assert text == oracle(prompt, 16)
    # the decode node computed only the partial last block: every full block came from the prefill node
    assert usage.prompt_tokens_details.cached_tokens == full_block_tokens(prompt)
    after = _metrics(fleet.router_url)
    moved = after["prefixpool_pd_handoff_bytes_total"] - before.get("prefixpool_pd_handoff_bytes_total", 0.0)
    assert moved > 0 and after["prefixpool_pd_handoffs_total"] >= 1
    assert after["prefixpool_pd_handoff_seconds_count"] >= 1
    handoff = pool(fleet, "decode-0")["handoff"]
    assert handoff["num_handoffs"] >= 1 and handoff["num_bytes"] >= moved


def test_a_finished_request_leaves_nothing_pinned_on_either_node(fleet, client):
    stream(client, LONG + "Pins question.", "pd-pins")
    deadline = time.monotonic() + 10  # the prefill leg's stream closes just after the decode node's
    while time.monotonic() < deadline:
        reports = [pool(fleet, node) for node in ("prefill-0", "decode-0")]
        if all(r["num_pinned"] == 0 and r["num_streams"] == 0 for r in reports):
            break
        time.sleep(0.1)
    assert [(r["integrity"], r["num_pinned"], r["num_streams"]) for r in reports] == [("ok", 0, 0)] * 2


def test_short_prompts_and_prefixes_the_decode_node_holds_are_served_in_place(fleet, client, oracle):
    short = route(fleet, "Hi there.", "pd-short")
    assert short["prefill"] is None and short["worker"] == "decode-0"
    assert short["disaggregation"]["mode"] == "in_place"
    prompt = LONG + "Held prefix question."
    stream(client, prompt, "pd-held")  # disaggregated: the decode node now holds the prompt's blocks
    deadline = time.monotonic() + 10  # until the index has seen the decode node's fetched blocks
    while route(fleet, prompt, "pd-held")["prefill"] is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    held = route(fleet, prompt, "pd-held")
    assert held["prefill"] is None and held["worker"] == "decode-0" and held["local_blocks"] > 0
    text, usage = stream(client, prompt, "pd-held")
    assert text == oracle(prompt, 16) and usage.prompt_tokens_details.cached_tokens == full_block_tokens(prompt)


def test_a_damaged_transfer_is_recomputed_by_the_decode_node(fleet, client, oracle):
    prompt = LONG + "Damaged transfer question."
    sent = pool(fleet, "prefill-0")["corrupted_blocks_sent"]
    fleet.fault_file.write_text("corrupt 1")  # the first block of every fetch leaves damaged
    try:
        text, usage = stream(client, prompt, "pd-corrupt")
    finally:
        fleet.fault_file.write_text("")
    assert text == oracle(prompt, 16)
    assert pool(fleet, "prefill-0")["corrupted_blocks_sent"] > sent
    assert usage.prompt_tokens_details.cached_tokens < full_block_tokens(prompt)  # it computed what failed


def test_a_prefill_node_stalling_mid_prompt_costs_time_not_the_answer(fleet, client, oracle):
    prompt = LONG + "Stalled prefill question."
    incomplete = pool(fleet, "decode-0")["handoff"]["num_incomplete"]
    fleet.fault_file.write_text("pause 3")  # 3 blocks, then nothing until the file changes
    try:
        text, usage = stream(client, prompt, "pd-stall")
    finally:
        fleet.fault_file.write_text("")
    assert text == oracle(prompt, 16)
    assert pool(fleet, "decode-0")["handoff"]["num_incomplete"] == incomplete + 1
    assert 3 * 16 <= usage.prompt_tokens_details.cached_tokens < full_block_tokens(prompt)


def test_a_decode_node_dying_mid_stream_resumes_greedily_elsewhere(fleet, client, oracle):
    prompt = LONG + "Dead decode node question."
    victim = fleet.workers["decode-0"]

    def kill_after_first_tokens(i: int) -> None:
        if i == 3:
            os.kill(victim.pid, signal.SIGKILL)
    try:
        text, usage = stream(client, prompt, "pd-dead-decode", max_tokens=120, on_chunk=kill_after_first_tokens)
        assert victim.process.wait(timeout=10) is not None
        assert text == oracle(prompt, 120) and usage.completion_tokens == 120
    finally:
        fleet.start_worker("decode-0", "decode")
        _wait_for_workers(fleet.router_url, 2, timeout_s=30)


def test_a_prefill_node_dying_mid_prompt_leaves_the_decode_node_to_compute_the_rest(fleet, client, oracle):
    prompt = LONG + "Dead prefill node question."
    victim = fleet.workers["prefill-0"]
    _wait_until_routed(fleet, prompt, "pd-dead-prefill")
    fleet.fault_file.write_text("pause 2")
    killer = threading.Thread(target=_kill_when_paused, args=(victim,))
    killer.start()
    try:
        text, usage = stream(client, prompt, "pd-dead-prefill")
    finally:
        killer.join()
        fleet.fault_file.write_text("")
    assert not victim.alive()
    assert text == oracle(prompt, 16)
    assert usage.prompt_tokens_details.cached_tokens < full_block_tokens(prompt)


def _wait_until_routed(fleet, prompt: str, salt: str) -> None:
    """The restarted decode node is in the index's fleet again: the prompt is disaggregated."""
    deadline = time.monotonic() + 15
    while route(fleet, prompt, salt)["prefill"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert route(fleet, prompt, salt)["prefill"]["node"] == "prefill-0"


def _kill_when_paused(victim) -> None:
    deadline = time.monotonic() + 30
    while b"prefixpool fault: pausing" not in victim.log_path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    victim.process.wait()
