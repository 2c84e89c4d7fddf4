"""The batch-invariant mode (Engine(batch_invariant=True)): in bfloat16, a prompt's K,V bytes in the arena,
the logits of every step it samples from and its greedy tokens are bit-identical whether it is computed
cold in one chunk, in chunks of any size, on a prefix an earlier request left in the pool, or in steps
shared with other requests of any length. With the mode off the same comparisons are counted and printed
(a measurement, not a failure: bf16 rounds differently for different shapes). The mode computes the same
function: fp32 agrees with the standard kernels to rounding, bf16 closely. On PREFIXPOOL_TEST_DEVICE."""

import argparse
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from prefixpool.deploy import worker_cli
from prefixpool.deploy.settings import from_args
from prefixpool.deploy.worker_settings import WorkerSettings
from prefixpool.engine.checkpoint import random_model
from prefixpool.engine.kernels import STANDARD
from prefixpool.engine.invariant import BY_DEVICE, InvariantKernels
from prefixpool.engine.sampling import SamplingParams
from prefixpool.model.config import preset
from prefixpool.store.keys import chain
from tests.support.engine import DEVICE, assert_clean, make_engine, tokens

SPLIT = InvariantKernels.for_device(torch.device(DEVICE)).splits.keys
NEW_TOKENS = 4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
BASE = tokens(SPLIT * 2 + 40, 11)  # prompts are prefixes of it: long enough for three key splits
NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def bf16():
    return random_model(preset("small"), seed=7, dtype=torch.bfloat16, device=DEVICE)


@dataclass
class Run:
    logits: list[torch.Tensor]  # fp32 logits of every step the target sampled from
    output: list[int]
    kv: torch.Tensor            # the arena bytes of every block the target computed or reused, in order

    def same(self, other: "Run") -> bool:
        return (self.output == other.output and torch.equal(self.kv, other.kv)
                and all(torch.equal(a, b) for a, b in zip(self.logits, other.logits, strict=True)))


@dataclass(frozen=True)
class Scenario:
    prompt_len: int
    chunk_size: int
    cached_len: int                          # tokens of the prompt an earlier request computed (0: none)
    neighbours: tuple[tuple[int, int, bool], ...]  # (prompt length, new tokens, submitted before the target)


def run(model, scenario: Scenario, batch_invariant: bool, kernels: InvariantKernels | None = None) -> Run:
    """The target prompt through one engine as the scenario says; its logits, tokens and K,V bytes."""
    engine = make_engine(model, NUM_BLOCKS, scenario.chunk_size, max_batch_size=8, batch_invariant=batch_invariant)
    if kernels is not None:  # another device type's constants, on this device
        engine.kernels = kernels
    prompt = BASE[:scenario.prompt_len]
    if scenario.cached_len:
        engine.generate(prompt[:scenario.cached_len] + tokens(9, 12), GREEDY)
    before = [n for n in scenario.neighbours if n[2]]
    after = [n for n in scenario.neighbours if not n[2]]
    for i, (length, new, _) in enumerate(before):
        engine.submit(tokens(length, 20 + i), SamplingParams(max_tokens=new, ignore_eos=True))
    target = engine.submit(prompt, GREEDY)
    for i, (length, new, _) in enumerate(after):
        engine.submit(tokens(length, 40 + i), SamplingParams(max_tokens=new, ignore_eos=True))
    logits, output = [], []
    while engine.has_work():
        batch = engine.schedule()
        step = engine.forward(batch)
        rows = [item.seq.request_id for item in batch.spans if item.sample]
        if target in rows:
            logits.append(step.logits[rows.index(target)].clone())
        output += [event.token for event in engine.finish(batch, step) if event.request_id == target]
    assert_clean(engine)
    keys = chain(prompt + output[:-1], engine.namespace)  # the last token is sampled, never computed
    block_ids = [engine.blocks.lookup(key) for key in keys]
    assert None not in block_ids
    return Run(logits, output, engine.arena.tensor[torch.tensor(block_ids, device=engine.arena.device)].cpu())


def scenarios():
    neighbour = st.tuples(st.integers(1, 300), st.integers(1, 6), st.booleans())
    return st.builds(
        lambda length, chunk, cached_share, neighbours: Scenario(length, chunk, int(cached_share * length),
                                                                 tuple(neighbours)),
        st.integers(1, len(BASE)), st.integers(8, 640), st.sampled_from([0, 0, 0.3, 0.7, 1.0]),
        st.lists(neighbour, max_size=3))


def test_bits_do_not_depend_on_chunking_cache_or_batch_in_bf16(bf16):
    references: dict[tuple[int, bool], Run] = {}
    differ = {True: 0, False: 0}
    drawn: list[Scenario] = []

    def reference(length: int, invariant: bool) -> Run:
        if (length, invariant) not in references:
            references[length, invariant] = run(bf16, Scenario(length, 4096, 0, ()), invariant)
        return references[length, invariant]

    @settings(max_examples=15, deadline=None, database=None)
    @given(scenario=scenarios())
    def check(scenario: Scenario):
        drawn.append(scenario)
        same = {invariant: run(bf16, scenario, invariant).same(reference(scenario.prompt_len, invariant))
                for invariant in (True, False)}
        differ[False] += not same[False]
        assert same[True], f"mode on: {scenario} differs from the prompt computed cold in one chunk"

    check()
    print(f"\nbf16, {len(drawn)} drawn scenarios against one cold chunk: mode on {differ[True]} differ, "
          f"mode off {differ[False]} differ (K,V bytes, step logits or tokens)")


def test_reuse_equals_recompute_with_the_mode_on_and_is_counted_with_it_off(bf16):
    """The issue's measurement, small: a cached prefix plus a new suffix against the same prompt cold."""
    same = {True: 0, False: 0}
    trials = [Scenario(prefix + suffix, 512, prefix, ()) for prefix, suffix in
              [(300, 17), (257, 40), (SPLIT * 2, 1), (120, 64), (533, 9), (16, 300)]]
    for invariant in (True, False):
        for trial in trials:
            cold = run(bf16, replace(trial, cached_len=0), invariant)
            same[invariant] += run(bf16, trial, invariant).same(cold)
    print(f"\nbf16 reuse == recompute: mode on {same[True]}/{len(trials)}, mode off {same[False]}/{len(trials)}")
    assert same[True] == len(trials)


@pytest.mark.parametrize("device_type", sorted(BY_DEVICE))
def test_every_device_types_constants_give_equal_bits_here(bf16, device_type):
    """The tile and split sizes of each device type (a GPU's: 128-row tiles, 16 pairs a call) on this device."""
    kernels = BY_DEVICE[device_type]
    for scenario in [Scenario(SPLIT + 30, 64, 100, ((40, 3, True), (SPLIT + 5, 2, False))),
                     Scenario(2 * SPLIT + 3, 200, 2 * SPLIT, ((1, 5, True),))]:
        cold = run(bf16, Scenario(scenario.prompt_len, 4096, 0, ()), True, kernels)
        assert run(bf16, scenario, True, kernels).same(cold), scenario


@pytest.mark.parametrize("window", [None, 40])
def test_the_mode_computes_the_same_function_in_fp32(window):
    config = preset("small")
    if window is not None:
        config = replace(config, sliding_window=window, sliding_layers=(1, 3))
    model = random_model(config, seed=5, device=DEVICE)
    scenario = Scenario(SPLIT + 90, 100, 64, ((30, 3, True), (200, 2, False)))
    on, off = run(model, scenario, True), run(model, scenario, False)
    assert on.output == off.output
    for a, b in zip(on.logits, off.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(on.kv, off.kv, rtol=1e-5, atol=1e-5)


def test_the_mode_stays_close_to_the_standard_kernels_in_bf16(bf16):
    agree = 0
    lengths = [5, 64, 200, SPLIT + 1, 400, len(BASE)]
    for length in lengths:
        on, off = (run(bf16, Scenario(length, 512, 0, ()), invariant) for invariant in (True, False))
        agree += on.output == off.output
        torch.testing.assert_close(on.logits[0], off.logits[0], rtol=0.05, atol=0.1)
    assert agree >= len(lengths) - 1, f"greedy tokens agree for {agree} of {len(lengths)} prompts only"


def matmul_shapes(model, scenario: Scenario) -> set[tuple]:
    """Shapes of every matrix multiply the target's steps ran, with the mode on (CPU profiler)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run(model, scenario, True)
    names = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}
    return {(e.name, tuple(tuple(s) for s in e.input_shapes[:3])) for e in prof.events()
            if e.name in names and e.input_shapes[0][:1] != [0]}  # no rows: nothing computed


@pytest.mark.skipif(DEVICE != "cpu", reason="the profiler's CPU events are the ops' own on the CPU only")
def test_every_matrix_multiply_has_a_shape_fixed_by_the_weights_alone(bf16):
    """A CPU whose bf16 matmul happens to round alike for all row counts would pass the bit tests
    without tiles; the shapes show the tiles are there: a different mix of steps makes no new shape."""
    tile = InvariantKernels.for_device(torch.device(DEVICE)).tile_rows
    one = matmul_shapes(bf16, Scenario(300, 512, 0, ()))
    other = matmul_shapes(bf16, Scenario(90, 37, 40, ((250, 5, True), (3, 2, False))))
    assert one == other
    rows = {shapes[0][0] for name, shapes in one if name in ("aten::mm", "aten::addmm", "aten::linear")}
    assert rows == {tile}, rows


def test_the_worker_flag_and_environment_reach_the_engine():
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    setting = lambda argv, env: from_args(WorkerSettings, parser.parse_args(argv), env).batch_invariant  # noqa: E731
    assert setting([], {}) is False
    assert setting(["--batch-invariant"], {}) is True
    assert setting([], {"PREFIXPOOL_BATCH_INVARIANT": "1"}) is True
    assert setting(["--batch-invariant", "false"], {"PREFIXPOOL_BATCH_INVARIANT": "1"}) is False  # flags win
    argv = ["--num-blocks", "16", "--device", "cpu", "--cpu-threads", "0"]  # 0: this process's threads as they are
    on = worker_cli.build_engine(from_args(WorkerSettings, parser.parse_args(argv + ["--batch-invariant"]), {}))
    off = worker_cli.build_engine(from_args(WorkerSettings, parser.parse_args(argv), {}))
    assert on.kernels == InvariantKernels.for_device(torch.device("cpu")) and off.kernels is STANDARD
