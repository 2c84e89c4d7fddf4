"""An engine error fails only the request that caused it: the rest of its batch runs on, token for token.

Faults are injected by hand, after admission, past every check a worker makes: a sequence whose
ids are made invalid (the embedding raises, as it did for ids outside the vocabulary), a model
wrapper that raises for a marked token at a marked position (a kernel failing on one request's
rows), and logits no sampler can draw from. After each, the other requests' tokens equal
their solo runs, the failed one is reported once by take_failed with no traceback, and the pool
passes check_integrity with no ref_count left.
"""

import pytest
import torch

from prefixpool.engine.batch import StepOutput
from prefixpool.engine.checkpoint import random_model
from prefixpool.engine.isolation import forward_isolated
from prefixpool.engine.sampling import SamplingParams
from prefixpool.engine.scheduler import InvalidTokens
from prefixpool.model.config import preset
from tests.support.engine import assert_clean, make_engine, tokens

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = [tokens(11, 60), tokens(7, 61), tokens(13, 62)]


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=6)


@pytest.fixture(scope="module")
def solo(model):
    return [make_engine(model).generate(prompt, GREEDY)[0] for prompt in PROMPTS]


def run(engine, num_steps=None, outputs=None):
    """Step until idle (or `num_steps`), checking the pool after every step; each request's tokens."""
    outputs = {} if outputs is None else outputs
    while engine.has_work() and (num_steps is None or num_steps > 0):
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event.token)
        engine.blocks.check_integrity()
        num_steps = None if num_steps is None else num_steps - 1
    return outputs


def assert_only_culprit_failed(engine, outputs, ids, culprit, solo, kind):
    failed = engine.take_failed()
    assert [request_id for request_id, _ in failed] == [culprit]
    why = failed[0][1]
    assert kind in why and "Traceback" not in why and "\n" not in why, why
    for index, request_id in enumerate(ids):
        if request_id != culprit:
            assert outputs[request_id] == solo[index], f"request {index} changed by its neighbour's failure"
    assert engine.take_failed() == []  # reported once
    assert_clean(engine)


def test_the_engine_refuses_ids_outside_the_vocabulary_at_submit(model):
    engine = make_engine(model)
    vocab = model.config.vocab_size
    for bad in ([1, vocab], [-1, 2], [2**40]):
        with pytest.raises(InvalidTokens, match="token ids"):
            engine.submit(bad, GREEDY)
    assert_clean(engine)


@pytest.mark.parametrize("where", ["prompt", "decode"])
def test_an_invalid_id_fails_its_request_alone(model, solo, where):
    engine = make_engine(model, max_batch_size=4)
    ids = [engine.submit(prompt, GREEDY) for prompt in PROMPTS]
    culprit = ids[1]
    sequence = engine._sequences[culprit]  # the fault: past submit's check, as a bug or bit flip would
    outputs = run(engine, num_steps=2 if where == "decode" else 0)  # all prefill in step 1, then decode
    assert len(sequence.tokens) == len(PROMPTS[1]) + (2 if where == "decode" else 0)
    sequence.tokens[-1] = model.config.vocab_size + 7
    outputs = run(engine, outputs=outputs)
    assert culprit not in outputs or len(outputs[culprit]) <= 2
    assert_only_culprit_failed(engine, outputs, ids, culprit, solo, "IndexError")
    again = engine.submit(PROMPTS[1], GREEDY)  # the same prompt, valid, on the same arena and pool
    assert run(engine)[again] == solo[1]
    assert_clean(engine)


class FailOnMarkedToken:
    """Fault injector: the real model, except that a step carrying `token` at `position` raises."""

    def __init__(self, model, token: int, position: int) -> None:
        self.model, self.token, self.position = model, token, position
        self.config, self.device, self.dtype = model.config, model.device, model.dtype
        self.num_raised = 0

    def __call__(self, tokens, positions, layout, kv, logit_rows, kernels):
        if bool(((tokens == self.token) & (positions == self.position)).any()):
            self.num_raised += 1
            raise RuntimeError("injected kernel fault\nframe #0: c10::Error (a C++ trace the client must not see)")
        return self.model(tokens, positions, layout, kv, logit_rows, kernels)


def test_a_model_error_on_one_request_fails_it_alone(model, solo):
    marked = model.config.vocab_size - 1  # tokens() draws below 256: no other prompt holds it
    culprit_prompt = [*PROMPTS[1][:5], marked, *PROMPTS[1][6:]]
    engine = make_engine(FailOnMarkedToken(model, marked, 5), max_batch_size=4, chunk_size=8)
    ids = [engine.submit(prompt, GREEDY) for prompt in (PROMPTS[0], culprit_prompt, PROMPTS[2])]
    outputs = run(engine)
    assert engine.model.num_raised == 2  # the batch, then the culprit alone
    assert ids[1] not in outputs
    assert_only_culprit_failed(engine, outputs, ids, ids[1], solo, "RuntimeError: injected kernel fault")


def test_logits_no_sampler_can_draw_from_fail_only_their_request(model, solo):
    engine = make_engine(model, max_batch_size=4)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=3)
    ids = [engine.submit(PROMPTS[0], GREEDY), engine.submit(PROMPTS[1], sampled), engine.submit(PROMPTS[2], GREEDY)]
    batch = engine.schedule()
    logits = engine.forward(batch).logits.clone()
    logits[1] = float("nan")  # the fault: NaN logits for the sampled request (torch.multinomial refuses them)
    first = engine.finish(batch, StepOutput(logits))
    assert [event.request_id for event in first] == [ids[0], ids[2]]
    outputs = run(engine)
    for event in first:
        outputs[event.request_id].insert(0, event.token)
    assert_only_culprit_failed(engine, outputs, ids, ids[1], solo, "RuntimeError")


def test_a_tiny_temperature_samples_greedily_instead_of_overflowing(model, solo):
    engine = make_engine(model)
    tiny = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-300, seed=1)
    assert engine.generate(PROMPTS[0], tiny)[0] == solo[0]
    assert engine.take_failed() == []
    assert_clean(engine)


def test_a_failing_forward_of_one_span_reports_it_without_a_second_try(model):
    calls = []

    def run_batch(batch):
        calls.append(len(batch.spans))
        raise MemoryError("out of memory")

    engine = make_engine(model)
    request_id = engine.submit(PROMPTS[0], GREEDY)
    batch = engine.schedule()
    output = forward_isolated(run_batch, batch, model.config.vocab_size)
    assert calls == [1] and list(output.failed) == [request_id]
    assert output.logits.shape == (1, model.config.vocab_size) and not torch.any(output.logits)
    assert engine.finish(batch, output) == []
    assert engine.take_failed() == [(request_id, "the engine failed on this request: MemoryError: out of memory")]
    assert_clean(engine)
