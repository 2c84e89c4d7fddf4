"""Per-token logprobs, from the engine's logits to the OpenAI shapes.

    engine      token_logprobs: raw log_softmax in fp32 of the step's logits (before temperature
                and top-p), top N by logit with ties to the lower id; only requests that asked
    wire        SamplingParams.logprobs in [0, 20]; Token(token, logprob, top) round-trips exactly,
                and a Token without logprobs is the same bytes as before
    router      the OpenAI bodies' logprobs fields (4xx when bad), the completion and chat shapes,
                stream frames, and the vLLM client's reading of vLLM's "token_id:<id>" logprobs
"""

import json
import math

import msgspec
import numpy as np
import pytest
import torch

from prefixpool.contract.worker_api import (GenerateRequest, RequestLimits, SamplingError, SamplingParams, Token,
                                            decode_event, decode_request, encode_event)
from prefixpool.engine.checkpoint import random_model
from prefixpool.engine.sampling import LOGPROB_FLOOR, token_logprobs
from prefixpool.model.config import preset
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router import openai_format as fmt
from prefixpool.router.detokenizer import TokenTexts
from prefixpool.router.errors import APIError
from prefixpool.router.openai_logprobs import LogprobsShape
from prefixpool.router.openai_schema import ChatBody, CompletionBody, decode, requested_logprobs
from prefixpool.router.vllm_client import VllmClient, _StreamState
from tests.support.engine import make_engine, tokens

TEXTS = TokenTexts(ByteTokenizer().decode)
LIMITS = RequestLimits(vocab_size=259, max_model_len=64, block_size=4, num_blocks=10)


def oracle(logits: torch.Tensor) -> np.ndarray:
    """log_softmax in float64, by hand."""
    x = logits.double().numpy()
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


# -- the engine ------------------------------------------------------------------------------------

def test_token_logprobs_are_the_raw_log_softmax_with_the_top_n_in_order():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 4
    want = oracle(logits)
    got = token_logprobs(logits, 17, 5)
    assert abs(got.logprob - want[17]) < 1e-5
    assert [i for i, _ in got.top] == np.argsort(-want, kind="stable")[:5].tolist()
    assert all(abs(lp - want[i]) < 1e-5 for i, lp in got.top)
    assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True)
    assert math.fsum(math.exp(v) for v in want) == pytest.approx(1.0)
    assert token_logprobs(logits, 17, 0).top == ()
    assert len(token_logprobs(logits, 17, 1000).top) == 300  # at most the vocabulary


def test_ties_go_to_the_lower_id_as_argmax_breaks_them():
    logits = torch.zeros(64)
    logits[[40, 9, 33, 50]] = 5.0
    logits[[2, 60]] = 4.0
    got = token_logprobs(logits, int(torch.argmax(logits)), 6)
    assert [i for i, _ in got.top] == [9, 33, 40, 50, 2, 60]
    assert got.top[0][0] == int(torch.argmax(logits)) and got.logprob == got.top[0][1]
    for _ in range(5):  # the same answer every time
        assert token_logprobs(logits, 9, 6) == got


def test_minus_infinity_and_nan_are_floored_to_vllms_minus_9999():
    logits = torch.tensor([0.0, float("-inf"), 1.0])
    assert token_logprobs(logits, 1, 3).logprob == LOGPROB_FLOOR
    assert token_logprobs(logits, 1, 3).top[-1] == (1, LOGPROB_FLOOR)
    assert token_logprobs(torch.tensor([0.0, float("nan")]), 1, 0).logprob == LOGPROB_FLOOR


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=1)


def run(engine, prompt, params):
    engine.submit(prompt, params)
    events = []
    while engine.has_work():
        events += engine.step()
    return events


def test_only_requests_that_ask_get_logprobs_and_greedy_tokens_head_their_top_list(model):
    engine = make_engine(model)
    prompt = tokens(21, 1)
    plain = run(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    asked = run(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4))
    assert [e.token for e in plain] == [e.token for e in asked]
    assert all(e.logprobs is None for e in plain)
    for event in asked:
        assert len(event.logprobs.top) == 4 and event.logprobs.top[0] == (event.token, event.logprobs.logprob)
        assert all(lp <= 0 for _, lp in event.logprobs.top)


def test_logprobs_are_of_the_logits_before_temperature_and_top_p(model):
    """The first token's logits are the prompt's, whatever the sampling: so are its logprobs."""
    prompt = tokens(18, 2)
    logits, _ = make_engine(model).prefill_logits(prompt)
    want = oracle(logits)
    for params in (SamplingParams(max_tokens=1, logprobs=3),
                   SamplingParams(max_tokens=1, logprobs=3, temperature=1.7, top_p=0.3, seed=5)):
        first = run(make_engine(model), prompt, params)[0]
        assert abs(first.logprobs.logprob - want[first.token]) < 1e-5
        assert [i for i, _ in first.logprobs.top] == np.argsort(-want, kind="stable")[:3].tolist()


# -- the wire ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 21, 10**6])
def test_logprobs_outside_0_to_20_are_refused_on_construction_and_decode(value):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=value)
    wire = msgspec.json.encode({"request_id": "r", "tokens": [1], "sampling": {"logprobs": value}})
    with pytest.raises(msgspec.ValidationError, match="logprobs"):
        decode_request(wire, "application/json", LIMITS)


@pytest.mark.parametrize("value", ["3", 2.5, [1]])
def test_logprobs_of_the_wrong_type_are_refused_on_decode(value):
    wire = msgspec.json.encode({"request_id": "r", "tokens": [1], "sampling": {"logprobs": value}})
    with pytest.raises(msgspec.ValidationError, match="logprobs"):
        decode_request(wire, "application/json", LIMITS)


def test_tokens_carry_fp32_logprobs_exactly_and_plain_tokens_are_unchanged():
    assert encode_event(Token(5)) == b'{"type":"token","token":5}\n'
    values = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), dim=-1).tolist()
    token = Token(7, values[7], tuple((i, values[i]) for i in range(20)))
    assert decode_event(encode_event(token)) == token
    assert all(torch.tensor(v, dtype=torch.float32).item() == v for _, v in decode_event(encode_event(token)).top)
    request = GenerateRequest(request_id="r", tokens=[1], sampling=SamplingParams(logprobs=20))
    assert decode_request(msgspec.json.encode(request), "application/json", LIMITS).sampling.logprobs == 20


# -- the router: request bodies ------------------------------------------------------------------------

def test_requested_logprobs_follow_each_endpoints_fields():
    def chat(**extra):
        return decode(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}),
                      ChatBody)

    def completion(**extra):
        return decode(msgspec.json.encode({"model": "m", "prompt": "x", **extra}), CompletionBody)

    assert requested_logprobs(completion()) is None
    assert requested_logprobs(completion(logprobs=0)) == 0 and requested_logprobs(completion(logprobs=20)) == 20
    assert requested_logprobs(chat()) is None and requested_logprobs(chat(top_logprobs=0)) is None
    assert requested_logprobs(chat(logprobs=True)) == 0
    assert requested_logprobs(chat(logprobs=True, top_logprobs=2)) == 2
    assert requested_logprobs(chat(logprobs=True, top_logprobs=None)) == 0
    assert requested_logprobs(chat(logprobs=None, top_logprobs=None)) is None


@pytest.mark.parametrize("kind, extra, status, param", [
    (CompletionBody, {"logprobs": -1}, 422, "logprobs"),
    (CompletionBody, {"logprobs": 21}, 422, "logprobs"),
    (CompletionBody, {"logprobs": "3"}, 422, "logprobs"),
    (CompletionBody, {"logprobs": True}, 422, "logprobs"),
    (CompletionBody, {"logprobs": 2.5}, 422, "logprobs"),
    (ChatBody, {"logprobs": True, "top_logprobs": -1}, 422, "top_logprobs"),
    (ChatBody, {"logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    (ChatBody, {"logprobs": True, "top_logprobs": "2"}, 422, "top_logprobs"),
    (ChatBody, {"logprobs": 3}, 422, "logprobs"),
    (ChatBody, {"top_logprobs": 2}, 400, "top_logprobs"),
    (ChatBody, {"logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
])
def test_bad_logprobs_values_are_4xx_naming_the_field(kind, extra, status, param):
    base = {"model": "m", "prompt": "x"} if kind is CompletionBody else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError) as caught:
        decode(msgspec.json.encode({**base, **extra}), kind)
    assert caught.value.status == status and caught.value.param == param


# -- the router: OpenAI shapes ------------------------------------------------------------------------

A, B, C = ord("a"), ord("b"), ord("c")
STREAM = [Token(A, -0.5, ((A, -0.5), (B, -1.25))), Token(B, -2.0, ((C, -0.75), (A, -1.0))), Token(C, -0.75, ())]


def test_completion_logprobs_list_the_sampled_token_then_the_top_n_with_text_offsets():
    shape = LogprobsShape(TEXTS, chat=False).of(STREAM)
    assert shape == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-0.5, -2.0, -0.75],
        "top_logprobs": [{"a": -0.5, "b": -1.25}, {"b": -2.0, "c": -0.75, "a": -1.0}, {"c": -0.75}],
        "text_offset": [0, 1, 2],
    }
    assert list(shape["top_logprobs"][1]) == ["b", "c", "a"]  # the sampled token first, as vLLM orders them


def test_parts_of_a_character_are_named_as_vllm_names_them():
    """A part alone is "", the part that completes the character names it, alternatives read in the same context."""
    eacute, egrave = "é".encode(), "è".encode()
    tokens = [Token(eacute[0], -0.1, ((eacute[0], -0.1),)), Token(eacute[1], -0.2, ((eacute[1], -0.2),
              (egrave[1], -1.5), (A, -2.5))), Token(A, -0.3, ())]
    shape = LogprobsShape(TEXTS, chat=False).of(tokens)
    assert shape["tokens"] == ["", "é", "a"] and shape["text_offset"] == [0, 0, 1]
    assert shape["top_logprobs"][1] == {"é": -0.2, "è": -1.5, "a": -2.5}
    euro = "€".encode()
    assert [TEXTS(t, [A, *euro[:i]]) for i, t in enumerate(euro)] == ["", "", "€"]
    assert TEXTS(euro[2], [euro[0], A, euro[1]]) == ""  # no context completes it
    assert TEXTS(A, [euro[0]]) == "a" and TEXTS(euro[1], []) == ""


def test_tokens_of_one_text_share_one_entry_with_the_last_ones_logprob_as_in_vllm():
    """Two first parts of characters both read "": one entry, in the first one's place, with the last value."""
    token = Token(0xC3, -1.0, ((0xC3, -1.0), (0xE2, -2.0), (A, -3.0)))
    assert LogprobsShape(TEXTS, chat=False).of([token])["top_logprobs"] == [{"": -2.0, "a": -3.0}]


def test_stream_chunks_carry_the_offsets_and_the_context_on():
    shape = LogprobsShape(TEXTS, chat=False)
    chunks = [shape.of([token]) for token in (*STREAM, Token(0xC3, -1.0, ()), Token(0xA9, -1.0, ()))]
    assert [c["text_offset"] for c in chunks] == [[0], [1], [2], [3], [3]]
    assert [c["tokens"] for c in chunks] == [["a"], ["b"], ["c"], [""], ["é"]]


def test_chat_logprobs_give_the_top_n_with_bytes():
    tokens = [Token(0xC3, -0.1, ((0xC3, -0.1),)), Token(0xA9, -0.2, ((0xA9, -0.2), (A, -3.0))), STREAM[1]]
    content = LogprobsShape(TEXTS, chat=True).of(tokens)["content"]
    assert content[0] == {"token": "", "logprob": -0.1, "bytes": [], "top_logprobs": [
        {"token": "", "logprob": -0.1, "bytes": []}]}
    assert content[1] == {"token": "é", "logprob": -0.2, "bytes": [0xC3, 0xA9], "top_logprobs": [
        {"token": "é", "logprob": -0.2, "bytes": [0xC3, 0xA9]}, {"token": "a", "logprob": -3.0, "bytes": [A]}]}
    assert content[2] == {"token": "b", "logprob": -2.0, "bytes": [B], "top_logprobs": [
        {"token": "c", "logprob": -0.75, "bytes": [C]}, {"token": "a", "logprob": -1.0, "bytes": [A]}]}


def test_a_token_without_its_logprob_reads_as_vllm_shows_one():
    assert LogprobsShape(TEXTS, chat=False).of([Token(A)])["top_logprobs"] == [None]
    assert LogprobsShape(TEXTS, chat=False).of([Token(A)])["token_logprobs"] == [None]
    entry = LogprobsShape(TEXTS, chat=True).of([Token(A)])["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"] == []


def test_answers_and_frames_put_logprobs_on_the_choice():
    from tests.unit.test_router_fast_path import USAGE, _payload

    logprobs = {"content": []}
    assert fmt.chat("c", "m", "hi", "stop", USAGE, logprobs)["choices"][0]["logprobs"] is logprobs
    assert fmt.completion("c", "m", "hi", "stop", USAGE)["choices"][0]["logprobs"] is None
    for chat in (False, True):
        frames = fmt.StreamFrames("c", "m", chat)
        got = _payload(frames.token("", logprobs))
        want = (fmt.chat_chunk("c", "m", "", None, logprobs=logprobs) if chat
                else fmt.completion_chunk("c", "m", "", None, logprobs))
        want["created"] = got["created"]
        assert got == want and got["choices"][0]["logprobs"] == logprobs


# -- the router: vLLM nodes ------------------------------------------------------------------------

def vllm_chunk(ids, logprobs, tops) -> bytes:
    """A chunk as vLLM 0.32 streams it with logprobs and return_tokens_as_token_ids (completion/serving.py)."""
    names = [f"token_id:{t}" for t in ids]
    choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": None, "logprobs": {
        "tokens": names, "token_logprobs": logprobs, "text_offset": [0] * len(ids),
        "top_logprobs": [{f"token_id:{t}": lp for t, lp in top} for top in tops]}}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n"


def test_the_vllm_client_asks_for_ids_and_reads_vllms_logprobs_as_our_workers_send_them():
    body = VllmClient("m").body(GenerateRequest(request_id="r", tokens=[1], sampling=SamplingParams(logprobs=2)))
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert "logprobs" not in VllmClient("m").body(GenerateRequest(request_id="r", tokens=[1],
                                                                  sampling=SamplingParams()))
    state = _StreamState(0.0, 2)
    # the sampled token among the top 2 (two entries), then outside them (three: sampled first)
    events = state.feed(vllm_chunk([5, 9], [-0.2, -3.0], [[(5, -0.2), (8, -1.9)], [(9, -3.0), (4, -0.4), (8, -0.9)]]))
    assert events == [Token(5, -0.2, ((5, -0.2), (8, -1.9))), Token(9, -3.0, ((4, -0.4), (8, -0.9)))]
    # rank 2 sampled: vLLM lists it first, our workers by logprob
    assert state.feed(vllm_chunk([8], [-0.9], [[(8, -0.9), (4, -0.4)]])) == [Token(8, -0.9, ((4, -0.4), (8, -0.9)))]
    assert _StreamState(0.0, None).feed(vllm_chunk([5], [-0.2], [[(5, -0.2)]])) == [Token(5)]


def test_vllm_logprobs_that_do_not_match_its_tokens_fail_the_request_cleanly():
    state = _StreamState(0.0, 1)
    [event] = state.feed(vllm_chunk([5, 6], [-0.2], [[(5, -0.2)]]))
    assert event.status == 502 and "do not match" in event.message
    bad_name = vllm_chunk([5], [-0.2], [[(5, -0.2)]]).replace(b"token_id:5", b"five")
    assert _StreamState(0.0, 1).feed(bad_name)[0].status == 502
