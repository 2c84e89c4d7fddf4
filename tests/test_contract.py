"""The router <-> worker wire format: sampling parameters travel as one struct and are checked on decode."""

import msgspec
import pytest

from router.contract.worker_api import GenerateRequest, SamplingError, SamplingParams, encode


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
