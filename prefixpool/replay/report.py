"""Tables and plots for trace replays: markdown text and matplotlib PNGs.

Knows nothing of how the results were produced (simulated or live).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixpool.replay.simulator import SimResult


def run_table(results: list[tuple[int, SimResult]], block_bytes: int) -> str:
    """Hit rate and fetched blocks per run granularity N, against N = 1 of the same policy."""
    base = {r.policy: r for n, r in results if n == 1}
    lines = ["| policy | run blocks N | hit rate | vs N=1 | TTFT mean s | p99 | blocks fetched | vs N=1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in results:
        ref = base.get(r.policy)
        fetched = r.bytes_transferred // block_bytes
        hit = f"{(r.hit_rate / ref.hit_rate - 1) * 100:+.2f}%" if ref and ref.hit_rate else "-"
        moved = (f"{(r.bytes_transferred / ref.bytes_transferred - 1) * 100:+.1f}%"
                 if ref and ref.bytes_transferred else "-")
        lines.append(f"| {r.policy} | {n} | {r.hit_rate:.4f} | {hit} | {r.ttft_s.mean():.2f} | {r.quantile(.99):.2f} | "
                     f"{fetched:,} | {moved} |")
    return "\n".join(lines)


def policy_table(results: list[SimResult], slo_s: float) -> str:
    base = {r.policy: r for r in results}
    ref = base.get("cost")
    lines = [
        f"| policy | hit rate | TTFT mean s | p50 | p90 | p99 | > SLO {slo_s:g}s | GB moved | imbalance | "
        "hit frac p50 / p90 / p99 | mean vs cost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        q = np.quantile(r.hit_fractions, [0.5, 0.9, 0.99])
        ratio = f"{r.ttft_s.mean() / ref.ttft_s.mean():.2f}x" if ref else "-"
        lines.append(
            f"| {r.policy} | {r.hit_rate:.3f} | {r.ttft_s.mean():.2f} | {r.quantile(.5):.2f} | {r.quantile(.9):.2f} | "
            f"{r.quantile(.99):.2f} | {r.slo_violations} | {r.bytes_transferred / 1e9:.1f} | {r.imbalance:.2f} | "
            f"{q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} | {ratio} |")
    return "\n".join(lines)


def sweep_table(sweep: list[tuple[int, SimResult, SimResult]], block_tokens: int) -> str:
    lines = ["| capacity per node (blocks) | tokens | global hit | local-only hit | global/local hit | "
             "global TTFT mean | local TTFT mean |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for capacity, glob, local in sweep:
        gain = glob.hit_rate / local.hit_rate if local.hit_rate else float("inf")
        lines.append(f"| {capacity:,} | {capacity * block_tokens / 1e6:.1f}M | {glob.hit_rate:.3f} | "
                     f"{local.hit_rate:.3f} | {gain:.2f}x | {glob.ttft_s.mean():.2f} | {local.ttft_s.mean():.2f} |")
    return "\n".join(lines)


def plot(results: list[SimResult], sweep: list[tuple[int, SimResult, SimResult]], out_dir: Path,
         name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        values = np.sort(r.ttft_s)
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=r.policy)
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title=f"{name}: TTFT CDF per policy")
    ax.legend()
    paths.append(_save(fig, out_dir / f"replay_{name}_ttft_cdf.png"))

    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        caps = [c for c, _, _ in sweep]
        ax.plot(caps, [g.hit_rate for _, g, _ in sweep], marker="o", label="global pool (cost)")
        ax.plot(caps, [loc.hit_rate for _, _, loc in sweep], marker="o", label="local only (cost_local)")
        ax.set(xscale="log", xlabel="capacity per node (blocks)", ylabel="hit rate (input tokens)",
               title=f"{name}: hit rate vs capacity")
        ax.legend()
        paths.append(_save(fig, out_dir / f"replay_{name}_hit_vs_capacity.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ax.bar(np.arange(len(r.node_busy_s)) + i * width, r.node_busy_s, width, label=r.policy)
    ax.set(xlabel="node", ylabel="prefill busy seconds", title=f"{name}: per-node load")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir / f"replay_{name}_node_load.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
