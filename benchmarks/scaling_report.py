"""Tables and the PNG plot of a ``benchmarks/scaling.py`` report (matplotlib optional: the plot is skipped without it).

Example:
    >>> from benchmarks.scaling_report import summarize_table
    >>> summarize_table({"results": []}).startswith("| variant | ranks |")
    True
"""

from __future__ import annotations

from typing import Any

# the collective phases of a local save, in order (names as torchrl_dcp passes them to _dist)
SAVE_PHASES = {
    "encode+plan agreement": "agree:encoding the state",
    "chunk plan": "agree:planning the chunk files",
    "staging bcast": "broadcast:preparing the staging directory",
    "commit gather": "gather_to_0:collecting file records",
    "confirm": "broadcast:confirming the commit",
}


def _ev(row: dict[str, Any], kind: str, name: str) -> float:
    return row[kind]["events_slowest_rank_s"].get(name, 0.0)


def phase_split(row: dict[str, Any]) -> dict[str, float]:
    """Slowest-rank seconds of a save: in collectives (barrier waits included), writing, rank 0's manifest work."""
    coll = sum(_ev(row, "save", n) for n in SAVE_PHASES.values())
    barrier = sum(v for n, v in row["save"]["events_slowest_rank_s"].items() if n.startswith("barrier:"))
    rank0 = row["save"]["events_rank0_s"]
    return {
        "collectives": coll,
        "barriers": barrier,
        "write": _ev(row, "save", "save.write"),
        "encode": _ev(row, "save", "save.encode"),
        "rank0_manifest": rank0.get("rank0.manifest_bytes", 0.0),
    }


def _count(row: dict[str, Any], kind: str) -> str:
    c = row[kind].get("collectives_rank0")
    return f"{c['exchanges']} ({c['barriers']})" if c else "-"


def summarize_table(report: dict[str, Any]) -> str:
    """A Markdown table: one row per variant and world size."""
    lines = [
        "| variant | ranks | save s (slowest rank) | load s | raw write, 1 proc, same files s | coordination "
        "per rank ms | collectives s (of which barriers) | commit gather + manifest (rank 0) ms | confirm ms "
        "| CPU s, all ranks | manifest KiB | .metadata KiB | files | exchanges (barriers) per save | per load "
        "| load rchar per rank MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        if row.get("store"):
            continue
        split = phase_split(row)
        sizes = row["sizes"]
        commit = _ev(row, "save", SAVE_PHASES["commit gather"]) * 1e3 + split["rank0_manifest"] * 1e3
        lines.append(
            f"| {row['variant']} | {row['ranks']} | {row['save']['wall_s']:.3f} | {row['load']['wall_s']:.3f} "
            f"| {row['raw_write_rank0_alone_s']:.3f} | {row['coordination_per_rank_s'] * 1e3:.1f} "
            f"| {split['collectives']:.3f} ({split['barriers']:.3f}) | {commit:.1f} "
            f"| {_ev(row, 'save', SAVE_PHASES['confirm']) * 1e3:.1f} | {row['save']['cpu_s_all_ranks']:.2f} "
            f"| {sizes['manifest_bytes'] / 1024:.1f} | {sizes['metadata_bytes'] / 1024:.1f} | {sizes['files']} "
            f"| {_count(row, 'save')} | {_count(row, 'load')} | {row['load'].get('rchar_max_rank_bytes', 0) / 1e6:.2f} |"
        )
    stores = [r for r in report["results"] if r.get("store")]
    if stores:
        lines += [
            "",
            "| object store (moto) | ranks | save s | load s | S3 requests per save | per load |",
            "|---|---|---|---|---|---|",
        ]
        for row in stores:
            req = row.get("s3_requests", {})
            fmt = lambda d: ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()))  # noqa: E731
            lines.append(
                f"| {row['variant']} | {row['ranks']} | {row['save']['wall_s']:.3f} | {row['load']['wall_s']:.3f} "
                f"| {fmt(req.get('save', {}))} | {fmt(req.get('load', {}))} |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> bool:
    """Save time and its parts against world size, per variant; ``False`` (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    rows = [r for r in report["results"] if not r.get("store")]
    order = ["tiny", "dict", "rb", "small2000"]
    variants = sorted({r["variant"] for r in rows}, key=lambda v: order.index(v) if v in order else len(order))
    fig, axes = plt.subplots(1, len(variants) + 1, figsize=(4.2 * (len(variants) + 1), 3.8))
    for ax, variant in zip(axes, variants):
        sel = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["ranks"])
        x = [r["ranks"] for r in sel]
        ax.plot(x, [r["save"]["wall_s"] for r in sel], "o-", label="save (slowest rank)")
        ax.plot(x, [r["load"]["wall_s"] for r in sel], "s-", label="load")
        ax.plot(x, [r["raw_write_rank0_alone_s"] for r in sel], "^--", label="raw write, 1 proc, same files")
        ax.plot(x, [phase_split(r)["collectives"] for r in sel], "v:", label="in collectives (save)")
        ax.plot(x, [phase_split(r)["rank0_manifest"] for r in sel], "x:", label="rank 0 metadata + manifest")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("ranks (2 CPUs: >2 is oversubscribed)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{variant}: fixed state per rank")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for variant in variants:
        sel = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["ranks"])
        x = [r["ranks"] for r in sel]
        first = sel[0]["load"].get("rchar_max_rank_bytes") or 1
        ax.plot(x, [r["load"].get("rchar_max_rank_bytes", 0) / first for r in sel], "o-", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
    ax.axhline(1.3, color="grey", ls="--", lw=0.8, label="target 1.3x")
    ax.set_xlabel("ranks")
    ax.set_ylabel("bytes a rank reads at load / at 1 rank")
    ax.set_title("load rchar per rank, relative to 1 rank", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
    return True
