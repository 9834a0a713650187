"""Tokens/s and acceptance length against tree budget (log x axis), one line per concurrency level.

`ar` and `chain` have no tree size, so they are drawn as horizontal lines; the paper's best budgets
(256-512) are shaded.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddtree.tree_shape import AR, CHAIN, TreeShape  # noqa: E402

PAPER_RANGE = (256, 512)


def plot_sweep(rows: list[dict], path: str | Path, title: str = "ddtree bench") -> Path:
    """Write the figure to `path` (PNG) and return the path."""
    path = Path(path)
    fig, (ax_tps, ax_acc) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    concurrencies = sorted({r["concurrency"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    numeric = sorted({r["tree_budget"].budget for r in rows if r["tree_budget"].builds_tree})
    lo, hi = (min(numeric + [PAPER_RANGE[0]]), max(numeric + [PAPER_RANGE[1]]))
    for k, concurrency in enumerate(concurrencies):
        color = colors[k % len(colors)]
        group = {r["tree_budget"]: r for r in rows if r["concurrency"] == concurrency and r["completed"] > 0}
        xs = [b for b in numeric if TreeShape.best(b) in group]
        label = f"concurrency {concurrency}"
        for ax, key in ((ax_tps, "median_tokens_per_second"), (ax_acc, "mean_acceptance_length")):
            ys = [group[TreeShape.best(b)][key] for b in xs]
            points = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if points:
                ax.plot(*zip(*points), marker="o", color=color, label=f"tree, {label}")
            for name, style in ((AR, "--"), (CHAIN, ":")):
                value = group[name][key] if name in group else None
                if value is not None:
                    ax.axhline(value, linestyle=style, color=color, alpha=0.8, label=f"{name}, {label}")
    ticks = sorted(set(numeric) | set(PAPER_RANGE))
    for ax in (ax_tps, ax_acc):
        ax.set_xscale("log", base=2)
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.axvspan(*PAPER_RANGE, color="tab:green", alpha=0.12, label="paper's best budgets (256-512)")
        ax.grid(True, which="both", alpha=0.3)
    ax_tps.set_ylabel("median tokens/s per request")
    ax_acc.set_ylabel("mean acceptance length")
    ax_acc.set_ylim(bottom=min(0.9, ax_acc.get_ylim()[0]))
    ax_acc.set_xlabel("tree budget (nodes)")
    ax_tps.set_title(title)
    ax_tps.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
