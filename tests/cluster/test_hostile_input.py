"""Hostile input against a live router (etcd, one worker): every bad request is a 4xx with a message.

Hypothesis draws malformed bodies: bad JSON, wrong types, huge and negative
numbers, unicode edge cases (lone surrogates, NUL, RTL marks, emoji, invalid
UTF-8), prompts past the context, bodies past the size limit, and floods of
tiny requests. Never a 5xx; afterwards the router and the worker still serve
and the worker's pool passes check_integrity with nothing pinned.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixpool.testing.chaos_faults import cluster_for, quiet_pools, wait_ready
from prefixpool.testing.chaos_client import ApiClient

pytestmark = pytest.mark.timeout(300)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/route")
EDGE_TEXT = ["\ud800", "\udfff x", "a\x00b", "\u202eevil\u202c", "\U0001f600" * 5, "\ufeff", "e\u0301",
             "\u0000" * 20, "\U0010ffff", "", " ", "\n\r\t", "<|eot_id|>", "\\u0000"]
HOSTILE_NUMBERS = [-1, 0, -(2**63), 2**31, 2**31 - 1, 2**63, 2**64, 10**40, -0.0, 1.5, 1e308, -1e308, 3.0]
ODD_VALUES = [None, True, False, [], {}, "8", [1, 2], {"a": 1}, "NaN"]


def text() -> st.SearchStrategy:
    return st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=40),
                     st.lists(st.sampled_from(EDGE_TEXT), max_size=4).map("".join))


def value() -> st.SearchStrategy:
    return st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(ODD_VALUES), text(), st.integers(), st.floats())


def body() -> st.SearchStrategy:
    """A request dict in which some fields are hostile (sometimes the whole thing is valid)."""
    prompt = st.one_of(text(), st.lists(st.one_of(st.integers(), text()), max_size=4), value())
    messages = st.one_of(value(), st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "wizard"]), value()),
         "content": st.one_of(text(), value())}),
        max_size=3))
    fields = {"model": st.one_of(st.just("tiny"), text(), value()), "prompt": prompt, "messages": messages,
              "max_tokens": st.one_of(st.sampled_from([1, 2, 3]), value()), "temperature": value(), "top_p": value(),
              "seed": value(), "n": value(), "stream": value(), "stream_options": value(), "cache_salt": value(),
              "max_completion_tokens": value(), "echo": value(), "logprobs": value(), "user": value()}
    return st.dictionaries(st.sampled_from(sorted(fields)), st.just(None)).flatmap(
        lambda chosen: st.fixed_dictionaries({k: fields[k] for k in chosen}))


def raw_bodies() -> st.SearchStrategy:
    """Bytes that are mostly not a valid request document at all."""
    return st.one_of(st.binary(max_size=64), st.sampled_from([
        b"", b"{", b"[]", b"null", b"1", b'"x"', b'{"model": "tiny", "prompt": "a"', b'{"model": NaN}',
        b'{"model": "tiny", "prompt": "\xff\xfe"}', b'{"model": "tiny", "prompt": "\\ud800"}',
        b'{"model": "tiny", "prompt": "a", "max_tokens": 1e999}', b'{"model":"tiny","prompt":"a","prompt":[1]}',
        b"\x00" * 32, b"[" * 100_000 + b"]" * 100_000, b'{"model": "tiny", "prompt": ' + b"[" * 5000,
        b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        "{\"model\": \"tiny\", \"prompt\": \"\u202e\"}".encode()]))


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_for(1).start()
    asyncio.run(_ready(cluster.router_url))
    yield cluster
    cluster.stop()


async def _ready(url: str) -> None:
    client = ApiClient(url)
    try:
        await wait_ready(client, 1)
    finally:
        await client.close()


def post(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def assert_clean(status: int, payload: bytes, sent: object) -> None:
    assert status < 500, f"{status} for {sent!r}: {payload[:300]!r}"
    if status >= 400:
        message = json.loads(payload)["error"]["message"]
        assert isinstance(message, str) and message, f"no message for {sent!r}"


HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYPOTHESIS
@given(endpoint=st.sampled_from(ENDPOINTS), document=body())
def test_hostile_json_fields_get_a_4xx(cluster, endpoint, document):
    if document.get("stream") is True:  # a valid stream answers 200 with SSE; the field fuzz is the point here
        document["stream"] = "yes"
    data = json.dumps(document).encode()  # json escapes lone surrogates as \udXXX: the server must cope
    status, payload = post(cluster.router_url + endpoint, data)
    assert_clean(status, payload, document)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(ENDPOINTS), data=raw_bodies())
def test_bytes_that_are_not_json_get_a_4xx(cluster, endpoint, data):
    status, payload = post(cluster.router_url + endpoint, data)  # (a shrunk example may turn valid: 200)
    assert_clean(status, payload, data)


def test_prompts_past_the_context_and_bodies_past_the_limit(cluster):
    url = cluster.router_url + "/v1/completions"
    cases = {
        "text past the context": {"model": "tiny", "prompt": "z" * 9000, "max_tokens": 1},
        "token ids past the context": {"model": "tiny", "prompt": [65] * 9000, "max_tokens": 1},
        "token id past the vocabulary": {"model": "tiny", "prompt": [65, 10**6], "max_tokens": 1},
        "token id past int32": {"model": "tiny", "prompt": [65, 2**31], "max_tokens": 1},
        "token id past int64": {"model": "tiny", "prompt": [65, 10**30], "max_tokens": 1},
        "negative token id": {"model": "tiny", "prompt": [-1, 65], "max_tokens": 1},
        "max_tokens past the context": {"model": "tiny", "prompt": "hi", "max_tokens": 2**31 - 1},
    }
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "y" * 9000}]}
    for name, document in [*cases.items(), ("chat past the context", chat)]:
        path = "/v1/chat/completions" if "messages" in document else "/v1/completions"
        status, payload = post(cluster.router_url + path, json.dumps(document).encode())
        assert status == 400, (name, status, payload[:200])
        assert_clean(status, payload, name)
    status, payload = post(url, b'{"model": "tiny", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}')
    assert status == 413, (status, payload[:200])
    assert_clean(status, payload, "a 33 MiB body")


def test_a_flood_of_tiny_requests_is_answered(cluster):
    url = cluster.router_url
    shots = [("/v1/completions", b"{}"), ("/v1/chat/completions", b"[]"), ("/v1/route", b'{"model": "tiny"}'),
             ("/v1/completions", b'{"model": "tiny", "prompt": ""}'), ("/nowhere", b"x")] * 60
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda shot: post(url + shot[0], shot[1]), shots))
    assert len(answers) == 300
    for (path, data), (status, payload) in zip(shots, answers):
        assert 400 <= status < 500, (path, data, status, payload[:200])
        assert_clean(status, payload, data)


def test_still_serving_afterwards(cluster):
    status, payload = post(cluster.router_url + "/v1/completions",
                           json.dumps({"model": "tiny", "prompt": "still here?", "max_tokens": 4,
                                       "temperature": 0}).encode())
    assert status == 200, payload[:300]
    assert json.loads(payload)["usage"]["completion_tokens"] >= 1
    reports = asyncio.run(quiet_pools(cluster))
    assert reports["worker-0"]["integrity"] == "ok"
