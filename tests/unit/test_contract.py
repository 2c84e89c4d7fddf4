"""The router <-> worker wire format: sampling parameters travel as one struct and are checked on decode."""

import msgspec
import numpy as np
import pytest

from prefixpool.contract.worker_api import (MSGPACK, GenerateRequest, SamplingError, SamplingParams, decode_request,
                                            encode, encode_request)
from prefixpool.router.vllm_client import VllmClient
from prefixpool.store.keys import TOKEN_DTYPE, Namespace, chain


def test_sampling_round_trips_as_one_struct():
    request = GenerateRequest(request_id="r", tokens=[1, 2], sampling=SamplingParams(max_tokens=3, top_p=0.5, seed=7))
    decoded = msgspec.json.decode(encode(request), type=GenerateRequest)
    assert decoded == request and decoded.sampling.seed == 7


@pytest.mark.parametrize("bad, field", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                        ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_sampling_is_refused_by_construction_and_by_decode(bad, field):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**bad)
    wire = msgspec.json.encode({"request_id": "r", "tokens": [1], "sampling": bad})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(wire, type=GenerateRequest)


def test_packed_tokens_travel_as_one_bin_and_read_back_as_the_ids():
    ids = np.array([0, 1, 255, 70_000, 2**31 - 1], dtype=TOKEN_DTYPE)
    request = GenerateRequest(request_id="r", tokens=ids.tobytes(), sampling=SamplingParams())
    wire = encode_request(request)
    empty = encode_request(msgspec.structs.replace(request, tokens=b""))
    assert len(wire) - len(empty) <= 4 * len(ids) + 4  # one bin of the ids as they are, not an int per id
    decoded = decode_request(wire, MSGPACK)
    assert decoded.token_list() == ids.tolist() and decoded.num_tokens == len(ids)
    listed = GenerateRequest(request_id="r", tokens=ids.tolist(), sampling=SamplingParams())
    assert listed.token_list() == decoded.token_list() and listed.num_tokens == decoded.num_tokens
    assert chain(decoded.tokens, Namespace("m")) == chain(listed.tokens, Namespace("m"))  # the same block keys


def test_ragged_packed_tokens_are_refused_on_decode():
    wire = msgspec.msgpack.encode({"request_id": "r", "tokens": b"\x01\x00\x00", "sampling": {}})
    with pytest.raises(msgspec.ValidationError, match="4-byte ids"):
        decode_request(wire, MSGPACK)


def test_the_vllm_client_sends_packed_ids_as_the_json_list_vllm_reads():
    ids = np.array([5, 300, 128_000], dtype=TOKEN_DTYPE)
    request = GenerateRequest(request_id="r", tokens=ids.tobytes(), sampling=SamplingParams())
    body = VllmClient("m").body(request)
    assert body["prompt"] == [5, 300, 128_000] and all(type(t) is int for t in body["prompt"])
    assert msgspec.json.decode(msgspec.json.encode(body))["prompt"] == [5, 300, 128_000]
