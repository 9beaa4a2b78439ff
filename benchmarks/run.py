"""Run the benchmark suite and write ``docs/benchmarks.md`` and ``benchmarks/results/<machine>.json``.

Usage::

    python -m benchmarks.run              # reduced sizes (a few minutes on 2 CPUs)
    python -m benchmarks.run --full       # the issue's sizes (1 GiB tensors, 20,000 tensors, 1M transitions)
    python -m benchmarks.run --ranks 1 --only large,small --device cuda --out $OUT

CUDA tensors and NCCL are used when a GPU is present (``--device auto``); ranks
share the GPU over gloo when there are fewer GPUs than ranks. Times are the best
of ``--reps`` runs, each between barriers (the slowest rank's time).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks import bench

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=bench.worker, args=(r, world, free_port_cache[world], cfg, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    result = None
    deadline = time.monotonic() + cfg["timeout"]
    while result is None and time.monotonic() < deadline:
        try:
            result = queue.get(timeout=1.0)
        except Exception:
            if all(p.exitcode is not None for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if result is None:
        return {
            "backend": "?",
            "rows": [{"workload": "*", "ranks": world, "method": "(run)", "error": "no result (crash or timeout)"}],
        }
    return result


free_port_cache: dict[int, int] = {}


def _get(rows: list[dict[str, Any]], workload: str, ranks: int, method: str, field: str = "seconds") -> float | None:
    for r in rows:
        if r["workload"] == workload and r["ranks"] == ranks and r["method"] == method:
            return r.get(field)
    return None


def ratios(rows: list[dict[str, Any]], ranks: list[int]) -> list[dict[str, Any]]:
    """The issue's targets, as same-run ratios."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        out.append({"ratio": name, "value": value, "target": target, "met": ok})

    def rate(w: str, m: str, n: int = 1) -> float | None:
        return _get(rows, w, n, m, "gbps")

    def secs(w: str, m: str, n: int = 1) -> float | None:
        return _get(rows, w, n, m)

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    for w in ("large", "medium"):
        r = div(rate(w, "torchrl_dcp save"), rate(w, "raw write (1 MiB chunks + fsync)"))
        add(f"{w}: sync save / raw write", r, ">= 0.85", None if r is None else r >= 0.85)
        r = div(rate(w, "torchrl_dcp load cold"), rate(w, "raw read cold (readinto)"))
        add(f"{w}: cold load / raw readinto", r, ">= 0.85", None if r is None else r >= 0.85)
        r = rate(w, "torchrl_dcp load warm")
        add(f"{w}: warm load GB/s", r, ">= 5 GB/s", None if r is None else r >= 5)
        r = rate(w, "torchrl_dcp load warm (verify=False)")
        add(f"{w}: warm load GB/s (verify=False)", r, ">= 5 GB/s", None if r is None else r >= 5)
        r = div(rate(w, "torchrl_dcp load cold (verify=False)"), rate(w, "raw read cold (readinto)"))
        add(f"{w}: cold load (verify=False) / raw readinto", r, ">= 0.85", None if r is None else r >= 0.85)
    r = div(secs("small", "dcp.save"), secs("small", "torchrl_dcp save"))
    add("small: save speed-up over dcp.save", r, ">= 5", None if r is None else r >= 5)
    r = div(secs("small", "dcp.load warm"), secs("small", "torchrl_dcp load warm"))
    add("small: warm load speed-up over dcp.load", r, ">= 10", None if r is None else r >= 10)
    r = div(secs("small", "torch.load warm"), secs("small", "torchrl_dcp load warm"))
    add("small: warm load speed-up over torch.load", r, ">= 3", None if r is None else r >= 3)
    for w in ("large", "medium", "small", "rb_mujoco", "rb_pixels"):
        for n in ranks:
            r = div(secs(w, "torchrl_dcp async_save: blocking", n), secs(w, "torchrl_dcp save", n))
            if r is not None:
                add(f"{w} × {n}: async blocking / sync save", r, "<= 0.10", r <= 0.10)
            r = div(
                secs(w, "torchrl_dcp async_save: blocking", n),
                secs(w, "memcpy of the staged bytes (touched buffers)", n),
            )
            if r is not None:
                add(f"{w} × {n}: async blocking / memcpy of the staged bytes", r, "<= 1.2", r <= 1.2)
    for w in ("large", "medium", "small"):
        for n in ranks:
            if n > 1:
                off = secs(w, "torchrl_dcp save (replica_check=off)", n)
                r = div(secs(w, "torchrl_dcp save", n), off)
                add(f"{w} × {n}: save with the replica check / without", r, "<= 1.05", None if r is None else r <= 1.05)
                r = div(secs(w, "torchrl_dcp save (replica_check=full)", n), off)
                add(f"{w} × {n}: save with the full replica check / without", r, "(no target)", None)
    for w in ("large", "rb_pixels"):
        r = div(rate(w, "convert to archive"), rate(w, "plain copy of the checkpoint (+fsync)"))
        add(f"{w}: archive conversion / file copy", r, ">= 0.8", None if r is None else r >= 0.8)
        for temp in ("cold", "warm"):
            r = div(secs(w, f"torchrl_dcp load {temp}"), secs(w, f"torchrl_dcp load from archive {temp}"))
            add(f"{w}: archive load / directory load ({temp})", r, ">= 0.9", None if r is None else r >= 0.9)
    for w in ("rb_mujoco", "rb_pixels"):
        r = div(secs(w, "torchrl.checkpoint save (+fsync)"), secs(w, "torchrl_dcp save"))
        add(f"{w}: save speed vs torchrl.checkpoint", r, ">= 1", None if r is None else r >= 1)
        for n in ranks:
            if n > 1:
                r = div(secs(w, "torchrl_dcp save"), secs(w, "torchrl_dcp save", n))
                add(f"{w}: {n} ranks vs 1 rank (save speed-up)", r, "> 1", None if r is None else r > 1)
    return out


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    rows, ranks = report["rows"], report["config"]["ranks"]
    m = report["machine"]
    lines = [
        "# torchrl_dcp benchmarks",
        "",
        f"Produced by `{report['command']}` on {report['date']} (results also in `{report['json']}`).",
        "",
        f"Machine: {m.get('cpu', platform.processor())}, {m['cpus']} CPUs, {m.get('memory_gib')} GiB, "
        f"{m.get('gpu', 'no GPU')}; /tmp: {m.get('tmp_fs', '?')}; torch {m['torch']}, torchrl {m['torchrl']}, "
        f"tensordict {m['tensordict']}. Device: {report['config']['device']}; process groups: "
        + ", ".join(f"{n} rank(s): {b}" for n, b in report["backends"].items())
        + ".",
        "",
        f"Sizes: {'full (--full)' if report['config']['full'] else 'reduced (default; --full for the issue sizes)'}. "
        f"Each figure is the best of {report['config']['reps']} runs, timed between barriers (slowest rank). "
        "GB/s = logical tensor bytes of the whole job / seconds (10^9 B). Cold = after dropping the page cache"
        + ("" if report["cold"] else " (not permitted here: cold rows are missing)")
        + ". Noisy shared VM: compare ratios within one run.",
        "",
        "## Targets (ratios within this run)",
        "",
        "| ratio | value | target | met |",
        "|---|---|---|---|",
    ]
    for r in report["ratios"]:
        met = "—" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['ratio']} | {_fmt(r['value'])} | {r['target']} | {met} |")
    workloads = {w.name: w for w in bench.workloads(report["config"]["full"])}
    for name in [w for w in workloads if w in report["config"]["only"]]:
        w = workloads[name]
        wr = [r for r in rows if r["workload"] == name]
        if not wr:
            continue
        size = next((r["bytes"] for r in wr if r.get("bytes") and r["method"].startswith("raw write")), None)
        lines += ["", f"## {name}: {w.description}" + (f" — {size / 1e9:.3f} GB" if size else ""), ""]
        header = "| method | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}: s | GB/s" for n in ranks) + " |"
        lines += [header, "|---|" + "---|---|" * len(ranks)]
        methods: list[str] = []
        for r in wr:
            if r["method"] not in methods:
                methods.append(r["method"])
        for meth in methods:
            cells = []
            for n in ranks:
                row = next((r for r in wr if r["method"] == meth and r["ranks"] == n), None)
                if row is None:
                    cells += ["", ""]
                elif row.get("error"):
                    cells += ["error", row["error"][:60].replace("|", "/")]
                else:
                    cells += [_fmt(row["seconds"], 3), _fmt(row["gbps"])]
            lines.append(f"| {meth} | " + " | ".join(cells) + " |")
    lines += ["", report.get("notes", "").strip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the issue's sizes (needs ~16 GiB RAM, ~20 GB of disk)")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    ap.add_argument("--only", default="large,medium,small,rb_mujoco,rb_pixels", help="workloads to run")
    ap.add_argument("--reps", type=int, default=None, help="runs per measurement, best kept (default 2; 3 with --full)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--out", default=None, help="directory for the report (default: benchmarks/results/)")
    ap.add_argument("--no-extras", action="store_true", help="skip torch.save, torchrl.checkpoint and archive rows")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per world size")
    ap.add_argument("--notes", default=None, help="a markdown file whose text is appended to the report")
    args = ap.parse_args(argv)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    ranks = [int(x) for x in args.ranks.split(",") if x]
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="tdcp-bench-", dir="/tmp"))
    cfg = {
        "full": args.full, "reps": args.reps or (3 if args.full else 2), "device": device, "dir": str(scratch),
        "only": args.only.split(","), "extras": not args.no_extras, "timeout": args.timeout, "ranks": ranks,
    }  # fmt: skip
    info = bench.machine()
    host = socket.gethostname().split(".")[0] or "machine"
    tag = f"{'cuda' if device == 'cuda' else 'cpu'}-{info['cpus']}cpu" + ("-full" if args.full else "")
    if args.out:
        out_dir = Path(args.out)
        md_path, json_path = out_dir / "benchmarks.md", out_dir / f"{tag}.json"
    else:
        # (docs/benchmarks.md is the curated page of current figures: a run never writes over it)
        md_path, json_path = (
            ROOT / "benchmarks" / "results" / f"{tag}.md",
            ROOT / "benchmarks" / "results" / f"{tag}.json",
        )
    rows: list[dict[str, Any]] = []
    backends: dict[str, str] = {}
    t0 = time.perf_counter()
    for world in ranks:
        print(f"{world} rank(s) ...", flush=True)
        free_port_cache[world] = free_port()
        res = run_world(world, cfg)
        backends[str(world)] = res["backend"]
        rows += res["rows"]
    cold = any(r["method"].endswith("cold") or "cold" in r["method"] for r in rows)
    report = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host,
        "machine": info,
        "config": cfg,
        "backends": backends,
        "cold": cold,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "json": str(json_path.relative_to(ROOT)) if json_path.is_relative_to(ROOT) else json_path.name,
        "rows": rows,
    }
    report["ratios"] = ratios(rows, ranks)
    if args.notes:
        report["notes"] = Path(args.notes).read_text()
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(markdown(report))
    print(f"wrote {md_path} and {json_path} in {report['elapsed_s']}s")
    for r in report["ratios"]:
        print(f"  {r['ratio']}: {_fmt(r['value'])} (target {r['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
