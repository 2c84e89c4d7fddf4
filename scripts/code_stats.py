"""The shape of the tree: files and lines per package folder, and function lengths.

    python scripts/code_stats.py [--long 40] [--big 250]

Prints one markdown table (folder, files, lines), the median / p90 / max function length in
lines, and the functions and modules over the given sizes, for the house-style check.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefixpool", "tests", "scripts")


def function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=40, help="list functions longer than this")
    parser.add_argument("--big", type=int, default=250, help="list modules longer than this")
    args = parser.parse_args()
    files = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    folders: dict[str, list[int]] = {}
    lengths, long, big = [], [], []
    for path in files:
        rel = path.relative_to(ROOT)
        num_lines = len(path.read_text().splitlines())
        folders.setdefault(str(rel.parent), []).append(num_lines)
        if num_lines > args.big:
            big.append(f"{rel} ({num_lines})")
        for name, length in function_lengths(path):
            lengths.append(length)
            if length > args.long:
                long.append(f"{rel}:{name} ({length})")
    print("| folder | files | lines |\n|---|---:|---:|")
    for folder, counts in sorted(folders.items()):
        print(f"| {folder}/ | {len(counts)} | {sum(counts):,} |")
    print(f"| total | {len(files)} | {sum(sum(c) for c in folders.values()):,} |\n")
    deciles = statistics.quantiles(lengths, n=10)
    print(f"functions: {len(lengths)}; length median {statistics.median(lengths):g}, p90 {deciles[-1]:g}, "
          f"max {max(lengths)} lines")
    print(f"modules over {args.big} lines: {', '.join(big) or 'none'}")
    print(f"functions over {args.long} lines: {', '.join(long) or 'none'}")


if __name__ == "__main__":
    main()
