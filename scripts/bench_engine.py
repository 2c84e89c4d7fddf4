"""Engine benchmark: our engine against transformers' generate on the same random Llama, on this CPU.

    python scripts/bench_engine.py [--layers 8] [--hidden 1024] [--prompt 2048] [--new 128] [--batch 16]
                                   [--decode-tokens 32] [--repeats 3] [--threads 1] [--chunk-size 2048]
    python scripts/bench_engine.py --invariance [--dtype bfloat16] [--trials 6] [--device cpu] [--preset NAME]
                                   [same flags]

transformers makes a random-weight Llama (llama3 RoPE scaling, GQA) and saves
it with save_pretrained; our engine loads that directory, so both run the same
weights in fp32. Measured, each a median of `--repeats`, the two sides
interleaved so that load from other processes hits both alike:
  prefill tok/s   a `--prompt`-token prompt to its first token (transformers: generate, 1 new token)
  decode tok/s    at batch 1 and `--batch`: 128-token prompts, `--decode-tokens` more tokens each,
                  timed after every request has its first token (transformers: one batched
                  generate call, its time for 1 token subtracted); also against transformers
                  serving the requests one generate call each, which runs at its batch-1 rate
  TTFT            cold `--prompt` + `--new` tokens, and cached: another request computed the
                  `--prompt` prefix first (ours only: transformers keeps no cache across calls)
Every measure is taken on two clocks at once: wall time, and this process's CPU
time (both sides run one torch thread in this process, so CPU seconds are the work
done, whatever other processes take of the cores meanwhile; on a shared, loaded
machine the wall ratios move by 2x between runs, the CPU ratios much less).
Prints one markdown table with the goals of issue #20 and the machine's load
average before and after. Needs transformers (the dev extra).

With --invariance, our engine against itself instead (random weights of the
same shape, or of --preset's; no transformers): the batch-invariant mode
off and on, in --dtype (default bfloat16), on --device, the same measures side
by side (prefill, decode at batch 1 and --batch, cached TTFT), and the reuse
comparison of issue #28: a --prompt-token prefix cached by one request and
reused with a new suffix (1 to --new tokens), against the same prompt computed on a
fresh engine, 16 greedy tokens; identical in X of --trials (tokens, and the
logits of every step bit for bit).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from prefixpool.engine.checkpoint import load_checkpoint, random_model
from prefixpool.engine.torch_dtype import dtype_name, torch_dtype
from prefixpool.model.config import ModelConfig, arena_shape_for, namespace_for, preset
from prefixpool.engine.sampling import SamplingParams
from prefixpool.engine.scheduler import Engine
from prefixpool.engine.sequence import RequestStats
from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool

BLOCK_SIZE = 16
DECODE_PROMPT = 128
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
REUSE_TOKENS = 16


def hf_llama(args: argparse.Namespace, directory: Path):
    import transformers
    heads = args.hidden // 64
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def bench_config(args: argparse.Namespace) -> ModelConfig:
    """--preset's shape with --layers layers, else the shape hf_llama makes (without its RoPE scaling)."""
    if args.preset:
        return replace(preset(args.preset), num_layers=args.layers)
    heads = args.hidden // 64
    return ModelConfig("llama", vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64,
                       max_position=131072, rope_theta=500000.0)


def make_engine(model, num_tokens: int, chunk_size: int, max_batch_size: int, invariant: bool = False) -> Engine:
    num_blocks = num_tokens // BLOCK_SIZE + 8
    arena = KVArena(arena_shape_for(model.config, num_blocks, BLOCK_SIZE), model.dtype, model.device)
    return Engine(model, NodeBlocks(BlockPool(num_blocks)), arena,
                  namespace_for(model.config, dtype_name(model.dtype), BLOCK_SIZE),
                  chunk_size=chunk_size, max_batch_size=max_batch_size, batch_invariant=invariant)


def prompts(rng: random.Random, count: int, length: int, vocab_size: int = 32000) -> list[list[int]]:
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class Stopwatch:
    """Seconds on every clock since start."""

    def __init__(self) -> None:
        self.start = {name: clock() for name, clock in CLOCKS.items()}

    def seconds(self) -> dict[str, float]:
        return {name: clock() - self.start[name] for name, clock in CLOCKS.items()}


def timed(fn: Callable[[], object]) -> dict[str, float]:
    watch = Stopwatch()
    fn()
    return watch.seconds()


def per_clock(fn: Callable[..., float], *times: dict[str, float]) -> dict[str, float]:
    """fn applied clock by clock: per_clock(lambda a, b: a - b, t1, t2)."""
    return {name: fn(*(t[name] for t in times)) for name in CLOCKS}


def hf_generate(hf, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    ids = torch.tensor(batch)
    with torch.inference_mode():
        return timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))


def hf_decode_rate(hf, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    return per_clock(lambda longer, one: len(batch) * new_tokens / (longer - one),
                     hf_generate(hf, batch, new_tokens + 1), hf_generate(hf, batch, 1))


def our_decode_rate(model, batch: list[list[int]], new_tokens: int, invariant: bool = False) -> dict[str, float]:
    engine = make_engine(model, len(batch) * (DECODE_PROMPT + new_tokens + BLOCK_SIZE), 2048, len(batch), invariant)
    params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
    ids = [engine.submit(prompt, params) for prompt in batch]
    while any(engine.stats(i).num_output_tokens == 0 for i in ids):
        engine.step()
    produced, watch = 0, Stopwatch()
    while engine.has_work():
        produced += len(engine.step())
    return per_clock(lambda seconds: produced / seconds, watch.seconds())


def first_token(engine: Engine, prompt: list[int]) -> tuple[dict[str, float], RequestStats]:
    watch = Stopwatch()
    stats = engine.generate(prompt, ONE_TOKEN)[1]
    return watch.seconds(), stats


def our_ttfts(model, prefix: list[int], rng: random.Random, args: argparse.Namespace,
              invariant: bool = False) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds to the first token: the prefix alone, cold prefix + new, cached prefix + other new."""
    size = 3 * (len(prefix) + args.new)
    prefill, _ = first_token(make_engine(model, size, args.chunk_size, 8, invariant), prefix)
    engine = make_engine(model, size, args.chunk_size, 8, invariant)
    vocab = model.config.vocab_size
    cold, _ = first_token(engine, prefix + prompts(rng, 1, args.new, vocab)[0])
    cached, stats = first_token(engine, prefix + prompts(rng, 1, args.new, vocab)[0])
    assert stats.num_cached_tokens == len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    return prefill, cold, cached


def measure(hf, ours, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{measure: {clock: median over the repeats}}."""
    rng = random.Random(0)
    rows: dict[str, list[dict[str, float]]] = {}
    add = lambda key, value: rows.setdefault(key, []).append(value)  # noqa: E731
    rate = lambda seconds: per_clock(lambda s: args.prompt / s, seconds)  # noqa: E731
    for _ in range(args.repeats):
        prefix = prompts(rng, 1, args.prompt)[0]
        add("hf_prefill", rate(hf_generate(hf, [prefix], 1)))
        prefill, cold, cached = our_ttfts(ours, prefix, rng, args)
        add("our_prefill", rate(prefill))
        add("cold", cold)
        add("cached", cached)
        for batch in (1, args.batch):
            group = prompts(rng, batch, DECODE_PROMPT)
            add(f"hf_decode{batch}", hf_decode_rate(hf, group, args.decode_tokens))
            add(f"our_decode{batch}", our_decode_rate(ours, group, args.decode_tokens))
    return {key: {name: statistics.median(v[name] for v in values) for name in CLOCKS} for key, values in rows.items()}


def _row(label: str, hf: str, ours: str, ratios: dict[str, float], goal: str,
         met: Callable[[float], bool] | None) -> str:
    verdict = " / ".join("yes" if met(ratios[name]) else "no" for name in CLOCKS) if met else "-"
    return (f"| {label} | {hf} | {ours} | {ratios['wall']:.3g}x | {ratios['cpu']:.3g}x | {goal} | {verdict} |")


def table(r: dict[str, dict[str, float]], args: argparse.Namespace) -> list[str]:
    b = args.batch
    both = lambda v: f"{v['wall']:.1f} ({v['cpu']:.1f})"  # noqa: E731
    lines = ["| measure: wall (CPU time) | transformers | prefixpool | ours / theirs, wall | ours / theirs, CPU "
             "| goal | met: wall / CPU |", "|---|---:|---:|---:|---:|---|---|"]
    for label, hf, ours, goal in (
            (f"prefill tok/s, {args.prompt}-token prompt", r["hf_prefill"], r["our_prefill"], 1.0),
            ("decode tok/s, batch 1", r["hf_decode1"], r["our_decode1"], None),
            (f"decode tok/s, batch {b} (transformers: one batched generate call; not the goal's reading)",
             r[f"hf_decode{b}"], r[f"our_decode{b}"], None),
            (f"decode tok/s, {b} requests (transformers: a generate call per request, i.e. its batch-1 rate)",
             r["hf_decode1"], r[f"our_decode{b}"], 2.0)):
        ratios = per_clock(lambda theirs, mine: mine / theirs, hf, ours)
        lines.append(_row(label, both(hf), both(ours), ratios, f">= {goal:.1f}x" if goal else "-",
                          (lambda x, g=goal: x >= g) if goal else None))
    ms = lambda v: f"{v['wall'] * 1e3:.0f} ({v['cpu'] * 1e3:.0f})"  # noqa: E731
    lines.append(_row(f"TTFT ms, cold / cached ({args.prompt} cached + {args.new} new; ratio cached / cold)", "-",
                      f"{ms(r['cold'])} / {ms(r['cached'])}", per_clock(lambda c, w: w / c, r["cold"], r["cached"]),
                      "<= 0.1x", lambda x: x <= 0.1))
    return lines


def generate_with_logits(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the fp32 logits each came from (the engine's steps driven here, to see the logits)."""
    request = engine.submit(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    while engine.has_work():
        batch = engine.schedule()
        output = engine.forward(batch)
        sampling = [item.seq.request_id for item in batch.spans if item.sample]
        if request in sampling:
            logits.append(output.logits[sampling.index(request)])
        tokens += [event.token for event in engine.finish(batch, output) if event.request_id == request]
    return tokens, logits


def reuse_trial(model, prefix: list[int], suffixes: list[list[int]], args: argparse.Namespace,
                invariant: bool) -> tuple[bool, bool]:
    """(tokens identical, every step's logits identical): the prefix cached by a request with suffixes[0]
    and reused with suffixes[1], against prefix + suffixes[1] on a fresh engine."""
    size = 4 * (len(prefix) + args.new + REUSE_TOKENS)
    warm = make_engine(model, size, args.chunk_size, 8, invariant)
    generate_with_logits(warm, prefix + suffixes[0], REUSE_TOKENS)
    reused = generate_with_logits(warm, prefix + suffixes[1], REUSE_TOKENS)
    cold = generate_with_logits(make_engine(model, size, args.chunk_size, 8, invariant), prefix + suffixes[1],
                                REUSE_TOKENS)
    same_logits = all(torch.equal(a, b) for a, b in zip(reused[1], cold[1], strict=True))
    return reused[0] == cold[0], reused[0] == cold[0] and same_logits


def measure_invariance(model, args: argparse.Namespace) -> tuple[dict, dict[bool, list[int]]]:
    """({(measure, mode on): {clock: median}}, {mode on: [trials with identical tokens, identical logits]})."""
    rng, vocab = random.Random(0), model.config.vocab_size
    rows: dict[tuple[str, bool], list[dict[str, float]]] = {}
    add = lambda key, value: rows.setdefault(key, []).append(value)  # noqa: E731
    rate = lambda seconds: per_clock(lambda s: args.prompt / s, seconds)  # noqa: E731
    for _ in range(args.repeats):
        prefix = prompts(rng, 1, args.prompt, vocab)[0]
        groups = {batch: prompts(rng, batch, DECODE_PROMPT, vocab) for batch in (1, args.batch)}
        seed = rng.randrange(1 << 30)
        for invariant in (False, True):  # the same prompts for both modes
            prefill, _, cached = our_ttfts(model, prefix, random.Random(seed), args, invariant)
            add(("prefill", invariant), rate(prefill))
            add(("cached", invariant), cached)
            for batch, group in groups.items():
                add((f"decode{batch}", invariant), our_decode_rate(model, group, args.decode_tokens, invariant))
    medians = {key: {name: statistics.median(v[name] for v in values) for name in CLOCKS}
               for key, values in rows.items()}
    same = {False: [0, 0], True: [0, 0]}
    for _ in range(args.trials):
        prefix = prompts(rng, 1, args.prompt, vocab)[0]
        suffixes = [prompts(rng, 1, rng.randint(1, args.new), vocab)[0] for _ in range(2)]
        for invariant in (False, True):
            same[invariant] = [a + b for a, b in zip(same[invariant], reuse_trial(model, prefix, suffixes, args,
                                                                                   invariant))]
    return medians, same


def invariance_table(r: dict, same: dict[bool, list[int]], args: argparse.Namespace) -> list[str]:
    both = lambda v: f"{v['wall']:.1f} ({v['cpu']:.1f})"  # noqa: E731
    ms = lambda v: f"{v['wall'] * 1e3:.0f} ({v['cpu'] * 1e3:.0f})"  # noqa: E731
    lines = ["| measure: wall (CPU time) | mode off | mode on | on / off, wall | on / off, CPU |",
             "|---|---:|---:|---:|---:|"]
    for label, key, show, ratio in (
            (f"prefill tok/s, {args.prompt}-token prompt", "prefill", both, lambda off, on: on / off),
            ("decode tok/s, batch 1", "decode1", both, lambda off, on: on / off),
            (f"decode tok/s, batch {args.batch}", f"decode{args.batch}", both, lambda off, on: on / off),
            (f"TTFT ms, cached ({args.prompt} cached + {args.new} new)", "cached", ms, lambda off, on: on / off)):
        ratios = per_clock(ratio, r[key, False], r[key, True])
        lines.append(f"| {label} | {show(r[key, False])} | {show(r[key, True])} | {ratios['wall']:.3g}x "
                     f"| {ratios['cpu']:.3g}x |")
    n = args.trials
    cell = lambda s: f"{s[0]}/{n} / {s[1]}/{n}"  # noqa: E731
    lines.append(f"| reuse == recompute, {args.prompt}-token prefix + 1 to {args.new} new, {REUSE_TOKENS} greedy "
                 f"tokens: identical tokens / identical logits, of {n} trials | {cell(same[False])} "
                 f"| {cell(same[True])} | - | - |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=2048, help="our prefill chunk, in tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both (1: on shared, busy cores more threads thrash)")
    parser.add_argument("--invariance", action="store_true",
                        help="our engine with the batch-invariant mode off and on, instead of against transformers")
    parser.add_argument("--dtype", default="bfloat16", help="with --invariance: the model's dtype")
    parser.add_argument("--device", default="cpu", help="with --invariance: the torch device")
    parser.add_argument("--trials", type=int, default=6, help="with --invariance: reuse == recompute trials")
    parser.add_argument("--preset", default="", help="with --invariance: a preset's shape (e.g. llama-3-8b) with "
                        "--layers layers, instead of the --hidden shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if args.invariance:  # our engine only: no transformers, weights made on the spot
        ours = random_model(bench_config(args), dtype=torch_dtype(args.dtype), device=args.device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_llama(args, Path(tmp))
            ours = load_checkpoint(tmp)
    c = ours.config
    print(f"random {c.name}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads "
          f"of {c.head_dim}, vocab {c.vocab_size}; {dtype_name(ours.dtype)} on {ours.device}, "
          f"{torch.get_num_threads()} CPU thread(s); block {BLOCK_SIZE}, our chunk {args.chunk_size}; "
          f"median of {args.repeats}\n")
    if args.invariance:
        print("\n".join(invariance_table(*measure_invariance(ours, args), args)))
    else:
        print("\n".join(table(measure(hf, ours, args), args)))
    print(f"\nload average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
