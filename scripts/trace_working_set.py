"""How big a cache a trace slice needs: LRU hit rate against capacity, in trace blocks, no timing.

    python scripts/trace_working_set.py --limit 600 --capacities 2000,4000,6000,8000,10000,12000

Per capacity C: one LRU node of C blocks (its share of the infinite-cache bound),
and 2 nodes of C/2 blocks each, every request sent to one at random (seeds 0-2:
what round robin gets, cache-blind) against one node of C (what a router that
keeps each conversation on one node could reach with the same total cache). The
slice's working set is where one node nears the bound; vLLM instances sized at
half of it are where cache-aware routing should matter most. Uses
prefixpool.replay.simulator.hit_rate_bound.
"""

from __future__ import annotations

import argparse

from prefixpool.replay.simulator import hit_rate_bound
from prefixpool.replay.trace import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--capacities", default="2000,4000,6000,8000,10000,12000")
    args = parser.parse_args()
    records = load_trace(args.trace, args.limit)
    bound = hit_rate_bound(records)
    print(f"{args.trace}, first {len(records)} requests: {len({i for r in records for i in r.hash_ids}):,} distinct "
          f"blocks, infinite-cache bound {bound:.3f}\n")
    print("| total cache C (blocks) | one node of C | share of bound | 2 nodes of C/2 at random (seeds 0-2) |")
    print("|---:|---:|---:|---|")
    for capacity in (int(c) for c in args.capacities.split(",")):
        one = hit_rate_bound(records, capacity_blocks=capacity)
        split = ", ".join(f"{hit_rate_bound(records, 2, seed, capacity // 2):.3f}" for seed in range(3))
        print(f"| {capacity:,} | {one:.3f} | {one / bound:.0%} | {split} |")


if __name__ == "__main__":
    main()
