"""The router's tokenizing of prompts that share a long beginning: chunked (as the router does) against whole.

    python scripts/bench_tokenize.py [--requests 200] [--out benchmarks/tokenize.md]

For each kind of shared text (English, JSON tool definitions, code, Russian, Greek, Hindi, and the
random-token text vLLM's benchmark datasets decode), `--requests` prompts of that text plus a short
distinct question are encoded in turn by a fresh FileTokenizer over the tiny Llama's byte-level BPE
(GPT-2's regex: the pre-tokenizer's regex split is what costs), chunked (encode_array, what the router
calls) and whole (one encode_batch_fast call); the ids are checked equal. The first 10 prompts are
not counted (the first one fills the chunk cache). Prints a markdown table; nothing is started.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from prefixpool.model.chunked_encoding import cuts
from prefixpool.model.tokenizer import FileTokenizer
from prefixpool.testing.tiny_llama import train_tokenizer

WORDS = {
    "English": "the model answers every request from the cache of shared prompt blocks quickly and well".split(),
    "Russian": "данные модель запрос ответ кэш префикс сервер узел быстро медленно".split(),
    "Greek": "λόγος δεδομένα μοντέλο αίτημα απάντηση γρήγορα".split(),
    "Hindi": "डेटा मॉडल अनुरोध उत्तर सर्वर तेज़".split(),
}


def shared_texts(rng: random.Random, vocab_size: int, decode) -> dict[str, str]:
    """About 4-10k characters of each kind."""
    texts = {name: " ".join(rng.choice(words) for _ in range(700)) + "." for name, words in WORDS.items()}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Look up item {i}.",
              "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "n": {"type": "integer",
                             "minimum": 1}}, "required": ["id"]}}} for i in range(40)]
    texts["JSON tools"] = json.dumps(tools)
    texts["code"] = "def handler(event, context):\n    x = event.get('a', 0) + 1\n    return {'s': 200, 'b': x}\n" * 60
    texts["random tokens (vLLM datasets)"] = decode([rng.randrange(3, vocab_size) for _ in range(2048)])
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        train_tokenizer(384).save(str(path))
        probe = FileTokenizer(path)
        rng = random.Random(0)
        lines = ["| shared text | characters | cuts | tokens | whole p50 ms | chunked p50 ms | whole / chunked |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for name, shared in shared_texts(rng, probe.vocab_size, probe.decode).items():
            tokenizer = FileTokenizer(path)  # a fresh chunk cache per kind
            whole_s, chunked_s = [], []
            for i in range(args.requests + 10):
                prompt = f"{shared} question {i}: {rng.random()}?"
                start = time.perf_counter()
                chunked = tokenizer.encode_array(prompt)
                mid = time.perf_counter()
                whole = tokenizer._encode_batch([prompt])[0]
                end = time.perf_counter()
                assert chunked.tolist() == whole, name
                if i >= 10:
                    chunked_s.append(mid - start)
                    whole_s.append(end - mid)
            w, c = float(np.median(whole_s)) * 1e3, float(np.median(chunked_s)) * 1e3
            lines.append(f"| {name} | {len(shared)} | {len(cuts(shared))} | {len(whole)} | {w:.3f} | {c:.3f} | "
                         f"{w / c:.1f}x |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(f"`python scripts/bench_tokenize.py --requests {args.requests}`\n\n"
                                  + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
