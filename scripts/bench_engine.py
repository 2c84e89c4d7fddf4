"""Engine benchmark: cold vs prefix-cached TTFT, prefill and decode throughput, on CPU.

    python scripts/bench_engine.py [--presets tiny,small] [--shared 4096] [--new 128] [--repeats 3] [--threads 1]

For each preset (seeded random weights, fp32): TTFT of `shared + new` tokens on
an empty pool (cold) and after another request computed the shared prefix
(cached), their ratio, prefill tokens/s of the cold run, and decode tokens/s
with 1 and with 8 concurrent requests. Prints one markdown table; medians of
`--repeats` runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.engine.checkpoint import random_model  # noqa: E402
from cluster.engine.scheduler import Engine  # noqa: E402
from cluster.engine.model_config import arena_shape_for, namespace_for, preset  # noqa: E402
from cluster.engine.sampling import SamplingParams  # noqa: E402
from store.arena import KVArena  # noqa: E402
from store.node_blocks import NodeBlocks  # noqa: E402
from store.pool import BlockPool  # noqa: E402

BLOCK_SIZE = 16
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def make_engine(model, num_blocks: int, chunk_size: int) -> Engine:
    arena = KVArena(arena_shape_for(model.config, num_blocks, BLOCK_SIZE), model.dtype)
    namespace = namespace_for(model.config, model.dtype, BLOCK_SIZE)
    return Engine(model, NodeBlocks(BlockPool(num_blocks)), arena, namespace, chunk_size=chunk_size)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def ttft_pair(model, shared: int, new: int, chunk_size: int, rng: random.Random) -> tuple[float, float, int]:
    """(cold TTFT, cached TTFT, cached tokens) for one shared prefix."""
    num_blocks = 2 * (shared + new) // BLOCK_SIZE + 8
    prefix = tokens(shared, rng)
    cold_engine = make_engine(model, num_blocks, chunk_size)
    _, cold = cold_engine.generate(prefix + tokens(new, rng), ONE_TOKEN)
    warm_engine = make_engine(model, num_blocks, chunk_size)
    warm_engine.generate(prefix + tokens(new, rng), ONE_TOKEN)     # another request computes the prefix
    _, cached = warm_engine.generate(prefix + tokens(new, rng), ONE_TOKEN)
    return cold.ttft_s, cached.ttft_s, cached.num_cached_tokens


def decode_rate(model, concurrency: int, prompt_len: int, num_tokens: int, rng: random.Random) -> float:
    """Output tokens per second once every request is past its prefill."""
    engine = make_engine(model, concurrency * (prompt_len + num_tokens) // BLOCK_SIZE + 8, 512)
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    for _ in range(concurrency):
        engine.submit(tokens(prompt_len, rng), params)
    while any(engine.stats(i).num_output_tokens == 0 for i in range(concurrency)):
        engine.step()
    produced, start = 0, time.perf_counter()
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def bench_preset(name: str, args: argparse.Namespace) -> dict[str, float]:
    model = random_model(preset(name), seed=0)
    rng = random.Random(0)
    ttft_pair(model, 256, 32, args.chunk_size, rng)                 # warm up kernels and allocator
    runs = [ttft_pair(model, args.shared, args.new, args.chunk_size, rng) for _ in range(args.repeats)]
    cold = statistics.median(r[0] for r in runs)
    cached = statistics.median(r[1] for r in runs)
    return {
        "cold": cold, "cached": cached, "cached_tokens": runs[0][2],
        "prefill": (args.shared + args.new) / cold,
        "decode1": decode_rate(model, 1, 128, args.decode_tokens, rng),
        "decode8": decode_rate(model, 8, 128, args.decode_tokens, rng),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--shared", type=int, default=4096)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on shared, busy cores more threads thrash)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"prompt: {args.shared} shared + {args.new} new tokens, block {BLOCK_SIZE}, chunk {args.chunk_size}, "
          f"fp32 on {torch.get_num_threads()} CPU threads, median of {args.repeats}\n")
    print("| preset | cold TTFT ms | cached TTFT ms | cached / cold | cached tokens | prefill tok/s "
          "| decode tok/s x1 | decode tok/s x8 | x8 / x1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.presets.split(","):
        r = bench_preset(name, args)
        print(f"| {name} | {r['cold'] * 1e3:.0f} | {r['cached'] * 1e3:.1f} | {r['cached'] / r['cold']:.3f}x "
              f"| {r['cached_tokens']} | {r['prefill']:.0f} | {r['decode1']:.0f} | {r['decode8']:.0f} "
              f"| {r['decode8'] / r['decode1']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
