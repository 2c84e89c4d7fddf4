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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine.checkpoint import load_checkpoint  # noqa: E402
from cluster.engine.model_config import arena_shape_for, namespace_for  # noqa: E402
from cluster.engine.sampling import SamplingParams  # noqa: E402
from cluster.engine.scheduler import Engine  # noqa: E402
from store.arena import KVArena  # noqa: E402
from store.pool import BlockPool  # noqa: E402

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
    return Engine(model, BlockPool(num_blocks), arena, namespace_for(model.config, model.dtype, BLOCK_SIZE),
                  chunk_size=chunk_size, max_batch_size=max_batch_size)


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(count)]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_generate(hf, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch)
    with torch.inference_mode():
        return timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))


def hf_decode_rate(hf, batch: list[list[int]], new_tokens: int) -> float:
    return len(batch) * new_tokens / (hf_generate(hf, batch, new_tokens + 1) - hf_generate(hf, batch, 1))


def our_decode_rate(model, batch: list[list[int]], new_tokens: int) -> float:
    engine = make_engine(model, len(batch) * (DECODE_PROMPT + new_tokens + BLOCK_SIZE), 2048, len(batch))
    params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
    ids = [engine.submit(prompt, params) for prompt in batch]
    while any(engine.stats(i).num_output_tokens == 0 for i in ids):
        engine.step()
    produced, start = 0, time.perf_counter()
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def our_ttfts(model, prefix: list[int], rng: random.Random, args: argparse.Namespace) -> tuple[float, float, float]:
    """(prefill-only TTFT of the prefix, cold TTFT of prefix + new, cached TTFT of prefix + other new)."""
    engine = make_engine(model, 3 * (len(prefix) + args.new), args.chunk_size, 8)
    prefill = engine.generate(prefix, ONE_TOKEN)[1].ttft_s
    engine = make_engine(model, 3 * (len(prefix) + args.new), args.chunk_size, 8)
    cold = engine.generate(prefix + prompts(rng, 1, args.new)[0], ONE_TOKEN)[1].ttft_s
    _, cached = engine.generate(prefix + prompts(rng, 1, args.new)[0], ONE_TOKEN)
    assert cached.num_cached_tokens == len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    return prefill, cold, cached.ttft_s


def measure(hf, ours, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    rows: dict[str, list[float]] = {}
    add = lambda key, value: rows.setdefault(key, []).append(value)  # noqa: E731
    for _ in range(args.repeats):
        prefix = prompts(rng, 1, args.prompt)[0]
        add("hf_prefill", args.prompt / hf_generate(hf, [prefix], 1))
        prefill, cold, cached = our_ttfts(ours, prefix, rng, args)
        add("our_prefill", args.prompt / prefill)
        add("cold", cold)
        add("cached", cached)
        for batch in (1, args.batch):
            group = prompts(rng, batch, DECODE_PROMPT)
            add(f"hf_decode{batch}", hf_decode_rate(hf, group, args.decode_tokens))
            add(f"our_decode{batch}", our_decode_rate(ours, group, args.decode_tokens))
    return {key: statistics.median(values) for key, values in rows.items()}


def table(r: dict[str, float], args: argparse.Namespace) -> list[str]:
    b = args.batch
    lines = ["| measure | transformers | prefixpool | prefixpool / transformers | goal | met |",
             "|---|---:|---:|---:|---|---|"]
    for label, hf, ours, goal in (
            (f"prefill tok/s, {args.prompt}-token prompt", r["hf_prefill"], r["our_prefill"], 1.0),
            ("decode tok/s, batch 1", r["hf_decode1"], r["our_decode1"], None),
            (f"decode tok/s, batch {b} (transformers: one batched generate call)",
             r[f"hf_decode{b}"], r[f"our_decode{b}"], 2.0),
            (f"decode tok/s, {b} requests (transformers: a generate call per request, i.e. its batch-1 rate)",
             r["hf_decode1"], r[f"our_decode{b}"], 2.0)):
        ratio = ours / hf
        lines.append(f"| {label} | {hf:.1f} | {ours:.1f} | {ratio:.2f}x | "
                     + (f">= {goal:.1f}x | {'yes' if ratio >= goal else 'no'} |" if goal else "- | - |"))
    ratio = r["cached"] / r["cold"]
    lines.append(f"| TTFT ms, cold / cached ({args.prompt} cached + {args.new} new) | - | "
                 f"{r['cold'] * 1e3:.0f} / {r['cached'] * 1e3:.0f} | cached / cold {ratio:.3f}x | <= 0.1x | "
                 f"{'yes' if ratio <= 0.1 else 'no'} |")
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
