"""Engine benchmark: our engine against transformers' generate on the same random Llama, on this CPU.

    python scripts/bench_engine.py [--layers 8] [--hidden 1024] [--prompt 2048] [--new 128] [--batch 16]
                                   [--decode-tokens 32] [--repeats 3] [--threads 1] [--chunk-size 2048]

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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from prefixpool.engine.checkpoint import load_checkpoint
from prefixpool.engine.torch_dtype import dtype_name
from prefixpool.model.config import arena_shape_for, namespace_for
from prefixpool.engine.sampling import SamplingParams
from prefixpool.engine.scheduler import Engine
from prefixpool.engine.sequence import RequestStats
from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool

BLOCK_SIZE = 16
DECODE_PROMPT = 128
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


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


def make_engine(model, num_tokens: int, chunk_size: int, max_batch_size: int) -> Engine:
    num_blocks = num_tokens // BLOCK_SIZE + 8
    arena = KVArena(arena_shape_for(model.config, num_blocks, BLOCK_SIZE), model.dtype)
    return Engine(model, NodeBlocks(BlockPool(num_blocks)), arena,
                  namespace_for(model.config, dtype_name(model.dtype), BLOCK_SIZE),
                  chunk_size=chunk_size, max_batch_size=max_batch_size)


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(count)]


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


def our_decode_rate(model, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    engine = make_engine(model, len(batch) * (DECODE_PROMPT + new_tokens + BLOCK_SIZE), 2048, len(batch))
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


def our_ttfts(model, prefix: list[int], rng: random.Random,
              args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds to the first token: the prefix alone, cold prefix + new, cached prefix + other new."""
    prefill, _ = first_token(make_engine(model, 3 * (len(prefix) + args.new), args.chunk_size, 8), prefix)
    engine = make_engine(model, 3 * (len(prefix) + args.new), args.chunk_size, 8)
    cold, _ = first_token(engine, prefix + prompts(rng, 1, args.new)[0])
    cached, stats = first_token(engine, prefix + prompts(rng, 1, args.new)[0])
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_llama(args, Path(tmp))
        ours = load_checkpoint(tmp)
    print(f"random Llama: {args.layers} layers, hidden {args.hidden}, {ours.config.num_heads}/"
          f"{ours.config.num_kv_heads} heads, vocab 32000, llama3 rope; fp32 on {torch.get_num_threads()} "
          f"CPU thread(s); block {BLOCK_SIZE}, our chunk {args.chunk_size}; median of {args.repeats}\n")
    results = measure(hf, ours, args)
    print("\n".join(table(results, args)))
    print(f"\nload average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
