"""Logprobs end to end with the official `openai` client: a live router, 2 workers (float32) and etcd.

    /v1/completions  logprobs: N  -> choices[0].logprobs {tokens, token_logprobs, top_logprobs, text_offset}
    /v1/chat/completions  logprobs: true, top_logprobs: N
                                  -> choices[0].logprobs.content [{token, logprob, bytes, top_logprobs}]

streamed and not, greedy. A prompt answered from the pool and the same prompt
under a fresh cache_salt give the same tokens and the same logprobs up to
float32 rounding: the engine computes a cached prompt's suffix in matrix
multiplies of another shape, so bit equality is not promised without the
batch-invariant mode (measured on this CPU, 13 new tokens after a cached prefix
of 64 / 300 / 496 tokens: bit-equal / up to 7.2e-7 apart / bit-equal). The exact variant, `==` on every
logprob, runs in bfloat16 with --batch-invariant: tests/cluster/test_bf16_reuse.py.
"""

import math

import openai
import pytest

from prefixpool.deploy.launcher import LocalCluster
from tests.cluster.test_e2e import SHARED, WORKER_ARGS, _wait_for_workers, post

MAX_TOKENS = 10
FP32_ROUNDING = 1e-5  # about 40 float32 steps at logprobs near -3


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, worker_args=WORKER_ARGS) as running:
        _wait_for_workers(running.router_url, 2)
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, prompt, salt, **extra):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
                                     extra_body={"cache_salt": salt}, **extra)


def chat(client, content, salt, **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"cache_salt": salt}, **extra)


def completion_positions(logprobs) -> list[tuple[str, float, dict[str, float], int]]:
    return list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset))


def check_completion_logprobs(logprobs) -> None:
    """Greedy: the sampled token is the most likely one; probabilities are probabilities; offsets add up."""
    offset = 0
    for token, logprob, top, text_offset in completion_positions(logprobs):
        assert token in top and len(top) <= 3  # the sampled token heads the top 3: no 4th entry
        assert max(top.values()) <= logprob
        if len(top) == 3:  # no two of them share a text (vLLM's dict keeps the last one's value)
            assert top[token] == logprob
        assert all(lp <= 0 for lp in top.values()) and math.fsum(math.exp(lp) for lp in top.values()) <= 1 + 1e-6
        assert text_offset == offset
        offset += len(token)
    assert sum(len(top) for top in logprobs.top_logprobs) > len(logprobs.tokens)  # alternatives came too


def test_completion_logprobs_streamed_and_not(client):
    whole = complete(client, SHARED + "Logprobs, please.", salt="lp-completion")
    choice = whole.choices[0]
    assert whole.usage.completion_tokens == MAX_TOKENS and len(choice.logprobs.tokens) == MAX_TOKENS
    check_completion_logprobs(choice.logprobs)
    chunks = list(complete(client, SHARED + "Logprobs, please.", salt="lp-completion-stream", stream=True,
                           stream_options={"include_usage": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) == MAX_TOKENS  # one chunk per token, as vLLM streams them
    positions = [p for logprobs in streamed for p in completion_positions(logprobs)]
    assert positions == completion_positions(choice.logprobs)  # both computed cold: bit for bit
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def check_chat_logprobs(content) -> None:
    for entry in content:
        assert len(entry.top_logprobs) == 2
        best = entry.top_logprobs[0]
        assert (entry.token, entry.logprob) == (best.token, best.logprob)
        assert entry.top_logprobs[1].logprob <= best.logprob <= 0 and math.exp(best.logprob) <= 1
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_logprobs_streamed_and_not(client):
    whole = chat(client, "Logprobs in a chat.", salt="lp-chat")
    content = whole.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS == whole.usage.completion_tokens
    check_chat_logprobs(content)
    chunks = list(chat(client, "Logprobs in a chat.", salt="lp-chat-stream", stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_a_prompt_from_the_pool_gives_the_logprobs_of_a_cold_one(client):
    prompt = SHARED + "Same answer from the pool?"
    complete(client, prompt + " First.", salt="lp-pool")
    warm = complete(client, prompt, salt="lp-pool")
    cold = complete(client, prompt, salt="lp-pool-cold-oracle")
    assert warm.usage.prompt_tokens_details.cached_tokens >= 160 and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm_lp, cold_lp = warm.choices[0].logprobs, cold.choices[0].logprobs
    assert warm_lp.tokens == cold_lp.tokens and warm.choices[0].text == cold.choices[0].text
    assert [list(top) for top in warm_lp.top_logprobs] == [list(top) for top in cold_lp.top_logprobs]
    for warm_top, cold_top in zip(warm_lp.top_logprobs, cold_lp.top_logprobs):
        assert all(abs(warm_top[t] - cold_top[t]) <= FP32_ROUNDING for t in warm_top)


@pytest.mark.parametrize("path, extra, status, param", [
    ("/v1/completions", {"logprobs": -1}, 422, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, 422, "logprobs"),
    ("/v1/completions", {"logprobs": "three"}, 422, "logprobs"),
    ("/v1/completions", {"logprobs": True}, 422, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -2}, 422, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, 422, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
])
def test_bad_logprobs_values_are_4xx(cluster, path, extra, status, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    code, reply = post(cluster.router_url, path, body)
    assert code == status and reply["error"]["param"] == param and reply["error"]["message"]
