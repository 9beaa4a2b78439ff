"""Draw the main load ratios of a ``benchmarks.loads`` run as a PNG (matplotlib: optional, ``pip install '.[bench]'``).

Usage::

    python -m benchmarks.chart benchmarks/results/loads-cpu-2cpu-batch3.json docs/img/ratios.png

Without matplotlib the chart is skipped (a message, exit status 0).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def draw(results: Mapping[str, Any], out: Path, targets: Mapping[str, float]) -> bool:
    """Draw ``results["ratios"]`` (one bar each, its target as a tick) into ``out``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    items = [(name, value) for name, value in results["ratios"].items() if value is not None]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(items) + 1.4))
    names = [n for n, _ in items]
    values = [v for _, v in items]
    colors = ["#999999" if n not in targets else ("#2a9d8f" if v >= targets[n] else "#e76f51") for n, v in items]
    ys = list(range(len(items)))[::-1]
    ax.barh(ys, values, color=colors)
    for y, (name, value) in zip(ys, items):
        ax.text(max(value, targets.get(name, 0.0)) * 1.02, y, f" {value:.2f}", va="center", fontsize=8)
        if name in targets:
            ax.plot([targets[name]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xscale("log")
    ticks = [0.5, 1, 2, 3, 5, 10, 20]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlim(min(0.4, min(values) / 1.3), max(20.0, max(values) * 1.4))
    ax.axvline(1.0, color="#555555", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ratio (log scale; speed-ups over the baseline, GB/s for the warm load; black tick: target)")
    ax.set_title(
        f"torchrl_dcp loads, one process: {results.get('mib')} MiB state and {results.get('small_tensors'):,} × 1 KiB "
        f"(median of {results.get('reps')})",
        fontsize=9,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__)
        return 2
    from benchmarks.loads import TARGETS

    results = json.loads(Path(args[0]).read_text())
    if not draw(results, Path(args[1]), TARGETS):
        print("chart skipped: matplotlib is not installed (pip install '.[bench]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
