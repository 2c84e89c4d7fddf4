"""Reuse equals recompute in bfloat16 (issue 28), on a live cluster: etcd, a router and 2 workers serving a
transformers-made Llama checkpoint (hidden 1024, 4 layers, 16 query / 4 KV heads, intermediate 2816; byte
tokenizer: the directory has no tokenizer.json) in bfloat16 with --batch-invariant.

A prompt whose prefix comes from the pool gives the same text and the same per-token logprobs, `==` on
every float (top alternatives too), as the same prompt under a fresh cache_salt, which is computed cold:

    local hit   the worker holding the prefix serves it            usage: local_hit_tokens > 0
    fetch       the holder is kept busy, the idle worker fetches   usage: fetched_tokens, fetched_bytes > 0
    host / SSD  the holder's device pool is flushed (its prefix    /v1/route: lower_tiers of the holder
                demoted), then the prefix is promoted back         usage: cached_tokens > 0

Cold, a prompt prefills in 512-token chunks; cached, only its suffix is computed: other shapes. The same
checkpoint on workers without the mode is measured, not asserted: how many cached answers differ from
cold is printed (pytest -s shows it).
"""

import json
import threading
import time
import urllib.request

import pytest
import torch

from prefixpool.contract.worker_api import GenerateRequest, SamplingParams, encode
from prefixpool.deploy.launcher import LocalCluster
from tests.cluster.test_e2e import _wait_for_workers, post

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")

MODEL = "bf16-llama"
MAX_TOKENS = 12
TOP = 2
LLAMA = dict(vocab_size=320, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,  # bytes + 3 specials
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
             bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False)
BLOCK = 16
DEVICE_BLOCKS, HOST_BLOCKS = 256, 128
COMMON = ("--model", MODEL, "--dtype", "bfloat16")
POOL_ARGS = ("--lease-ttl-s", "3", "--num-blocks", str(DEVICE_BLOCKS), "--max-batch-size", "8")
TIER_ARGS = ("--host-tier-blocks", str(HOST_BLOCKS), "--disk-tier-blocks", "1024", "--disk-queue-blocks", "1024")
DOCUMENT = ("A prefix pool keeps the key and value tensors of every full block of a prompt, found again by a "
            "chained hash of its tokens, so a repeated prefix is computed once and then reused or fetched. ")
PREFIX = DOCUMENT * 2  # 384 bytes: 24 blocks of 16 byte-tokens
# Suffixes of 20 to 270 tokens: cold, the prompt is one 512-token prefill chunk (or one and a bit); cached, only
# the suffix is computed, in a matrix multiply of other rows (where bf16 kernels round differently without the mode).
QUESTIONS = [f"Question {i}: " + "why does the shape of a matrix multiply change its rounding? " * i for i in range(5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """transformers' LlamaForCausalLM, weights spread so the logits are (HF's 0.02 init makes near-ties), saved
    with save_pretrained (safetensors)."""
    from tests.unit.test_transformers_parity import spread_weights

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    spread_weights(model, seed=28)
    directory = tmp_path_factory.mktemp("bf16-llama")
    model.save_pretrained(directory)
    assert list(directory.glob("*.safetensors")) and not (directory / "tokenizer.json").exists()
    return directory


def start(checkpoint, *mode: str, tier_dir=None) -> LocalCluster:
    tiers = (*TIER_ARGS, "--disk-tier-dir", str(tier_dir)) if tier_dir else ()
    model = (*COMMON, "--model-path", str(checkpoint))
    cluster = LocalCluster(num_workers=2, worker_args=(*model, *POOL_ARGS, *tiers, *mode), router_args=model)
    cluster.start()
    _wait_for_workers(cluster.router_url, 2, timeout_s=60)
    return cluster


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    running = start(checkpoint, "--batch-invariant", tier_dir=tmp_path_factory.mktemp("ssd"))
    yield running
    running.stop()


def complete(url: str, prompt: str, salt: str) -> dict:
    status, body = post(url, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": TOP,
        "ignore_eos": True, "cache_salt": salt})
    assert status == 200, body
    return body


def chat(url: str, content: str, salt: str) -> dict:
    status, body = post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": TOP, "ignore_eos": True,
        "cache_salt": salt})
    assert status == 200, body
    return body


def answer(body: dict):
    """Everything compared bit for bit: the text and every logprob float, the alternatives' too."""
    choice = body["choices"][0]
    if "message" in choice:
        return choice["message"]["content"], choice["logprobs"]["content"]
    logprobs = choice["logprobs"]
    return choice["text"], logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def cold(url: str, ask, text: str) -> dict:
    body = ask(url, text, f"cold-{time.monotonic_ns()}")
    assert cached(body) == 0, "a fresh salt computes the whole prompt"
    return body


def assert_same_as_cold(url: str, ask, text: str, warm: dict) -> None:
    assert cached(warm) > 0, "nothing came from the pool: the comparison would prove nothing"
    assert len(answer(warm)[1]) == MAX_TOKENS
    assert answer(warm) == answer(cold(url, ask, text))


def test_a_local_hit_equals_recompute_bit_for_bit(cluster):
    url = cluster.router_url
    complete(url, PREFIX + "Warm the pool.", "local")
    for question in QUESTIONS[::2]:
        text = PREFIX + question
        for _ in range(2):  # the second time the whole prompt but its last block is cached
            warm = complete(url, text, "local")
            assert warm["usage"]["prefixpool"]["local_hit_tokens"] == cached(warm)
            assert_same_as_cold(url, complete, text, warm)


def test_a_chat_answer_from_the_pool_equals_recompute(cluster):
    url = cluster.router_url
    chat(url, "Warm the pool.", "chat")
    for question in ["What is kept?", "Say it again, more slowly."]:
        assert_same_as_cold(url, chat, question, chat(url, question, "chat"))


def test_blocks_fetched_from_a_busy_peer_equal_recompute(cluster):
    url = cluster.router_url
    texts = [PREFIX + f"Fetched question {i}: where did the blocks come from?" for i in range(3)]
    salts = [f"fetch-{i}" for i in range(3)]
    for text, salt in zip(texts, salts):
        complete(url, text + " Warm.", salt)
    holders = {route(url, text, salt)["worker"] for text, salt in zip(texts, salts)}
    assert len(holders) == 1, "the idle pool sends every first request to the same worker"
    [holder] = holders
    with BusyWorker(cluster.workers[holder].url):
        wait_until(lambda: route(url, texts[0], salts[0])["worker"] != holder, "the router to avoid the busy holder")
        warm = [complete(url, text, salt) for text, salt in zip(texts, salts)]
    for text, body in zip(texts, warm):
        extra = body["usage"]["prefixpool"]
        assert extra["fetched_tokens"] > 0 and extra["fetched_bytes"] > 0
        assert_same_as_cold(url, complete, text, body)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_promoted_from_a_lower_tier_equals_recompute(cluster, tier):
    url, text, salt = cluster.router_url, PREFIX + f"Promoted from {tier}?", f"tier-{tier}"
    complete(url, text, salt)
    holder = route(url, text, salt)["worker"]
    demoted = {tier: len(text) // BLOCK}
    for i in range(20):  # each flush takes 38 device blocks of the holder: older blocks move down a tier
        flush(cluster.workers[holder].url, f"flush-{tier}-{i}")
        if poll(lambda: route(url, text, salt)["lower_tiers"].get(holder) == demoted, timeout_s=1.0):
            break
    assert route(url, text, salt)["lower_tiers"].get(holder) == demoted
    wait_until(lambda: route(url, text, salt)["fetch"] is None, "the flushes' load to clear, so the holder promotes")
    warm = complete(url, text, salt)
    assert warm["usage"]["prefixpool"]["fetched_tokens"] == 0
    assert_same_as_cold(url, complete, text, warm)


def test_without_the_mode_cached_and_cold_are_counted(checkpoint):
    """A measurement, not a failure: bf16 without --batch-invariant, cached vs cold on the same prompts."""
    plain = start(checkpoint)
    try:
        url = plain.router_url
        complete(url, PREFIX + "Warm the pool.", "plain")
        texts = [PREFIX + question for question in QUESTIONS]
        pairs = [(complete(url, text, "plain"), cold(url, complete, text)) for text in texts]
    finally:
        plain.stop()
    assert all(cached(warm) > 0 for warm, _ in pairs)
    text_differs = sum(answer(warm)[0] != answer(cold_body)[0] for warm, cold_body in pairs)
    logprobs_differ = sum(answer(warm) != answer(cold_body) for warm, cold_body in pairs)
    print(f"\nbf16 without --batch-invariant, {len(pairs)} cached prompts vs cold: text differs in {text_differs}, "
          f"text or logprobs differ in {logprobs_differ}")


def route(url: str, text: str, salt: str) -> dict:
    status, body = post(url, "/v1/route", {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS,
                                           "cache_salt": salt})
    assert status == 200, body
    return body


def poll(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    assert poll(condition, timeout_s), f"timed out waiting for {what}"


def flush(worker_url: str, salt: str) -> None:
    """A 600-token prompt of its own, straight to the worker: its blocks push older ones down a tier."""
    body = GenerateRequest(request_id=salt, tokens=[(7 * i) % 256 for i in range(600)], cache_salt=salt,
                           sampling=SamplingParams(max_tokens=1))
    request = urllib.request.Request(worker_url + "/generate", data=encode(body),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        events = [json.loads(line) for line in reply if line.strip()]
    assert events[-1]["type"] == "done", events[-1]


class BusyWorker:
    """Four long generations sent straight to one worker, so the router sees it loaded; ended on exit."""

    def __init__(self, worker_url: str) -> None:
        self.worker_url, self.stop = worker_url, threading.Event()
        self.threads = [threading.Thread(target=self._generate, args=(i,), daemon=True) for i in range(4)]

    def __enter__(self) -> "BusyWorker":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def _generate(self, seed: int) -> None:
        body = GenerateRequest(request_id=f"busy-{seed}", tokens=list(range(1, 33)),
                               sampling=SamplingParams(max_tokens=200, seed=seed, ignore_eos=True))
        request = urllib.request.Request(self.worker_url + "/generate", data=encode(body),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            for _ in reply:
                if self.stop.is_set():
                    return
