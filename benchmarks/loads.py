"""Loads side by side, one process: raw ``readinto``, ``torch.load``, ``dcp.load``, ``torchrl.checkpoint``, torchrl_dcp.

Two states: ``large`` (one float32 tensor of ``--mib`` MiB, 1 GiB by default) and
``small`` (``--small`` tensors of 1 KiB). torchrl_dcp loads them verified (the default)
as a dict component registered empty (read into fresh buffers, checksummed while read,
as ``torch.load`` returns new tensors), as a dict holding tensors of the saved shapes, an
``nn.Module`` and a generic object with ``state_dict``/``load_state_dict`` (DCP's
``Stateful``; these three read in place into the live tensors after the files were checksummed).
Cold = after ``echo 3 > /proc/sys/vm/drop_caches`` (rows skipped without root). Each
figure is the median of ``--reps`` runs (``--small-reps`` for the small state). Writes ``benchmarks/results/loads-<tag>.json``
and, with matplotlib installed, the chart (``benchmarks/chart.py``).

Usage::

    python -m benchmarks.loads --mib 1024 --small 5000 --reps 5 --chart docs/img/ratios.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench import _StateHolder, drop_caches, raw_read, tensor_views

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in state.items():
        m.register_buffer(k, v.clone())
    return m


def timed(op: Callable[[], Any], reps: int, cold: bool) -> float | None:
    """Median seconds of ``reps`` runs (page cache dropped before each when ``cold``)."""
    times = []
    for _ in range(reps):
        if cold and not drop_caches():
            return None
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, state: dict[str, torch.Tensor], root: Path, reps: int, cold_too: bool) -> dict[str, Any]:
    """Every method's median seconds on ``state`` (warm, and cold when ``cold_too``)."""
    import torch.distributed.checkpoint as dcp
    from torchrl.checkpoint import Checkpoint

    import torchrl_dcp as tdcp

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = root / name
    root.mkdir(parents=True)
    raw = root / "raw.bin"
    with open(raw, "wb") as f:
        for v in tensor_views(list(state.values())):
            f.write(v)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    views = tensor_views(list(dest.values()))
    raw_read(raw, views)  # touched once: readinto lands in memory already mapped
    torch.save(state, root / "t.pt")
    dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    Checkpoint(state=_StateHolder(state)).save(root / "trl")
    ours_dict = tdcp.DistributedCheckpoint(state=dict(state)).save(root / "ours")
    module = _module(state)
    ours_mod = tdcp.DistributedCheckpoint(state=module).save(root / "ours_module")
    stateful = _StateHolder({k: v.clone() for k, v in state.items()})  # state_dict() returns its own tensors
    ours_obj = tdcp.DistributedCheckpoint(state=stateful).save(root / "ours_stateful")
    holder = _StateHolder(dest)
    methods: dict[str, Callable[[], Any]] = {
        "raw readinto": lambda: raw_read(raw, views),
        "torch.load": lambda: torch.load(root / "t.pt", weights_only=True),
        "dcp.load": lambda: dcp.load(dest, checkpoint_id=str(root / "dcp"), no_dist=True),
        "torchrl.checkpoint load": lambda: Checkpoint(state=holder).load(root / "trl"),
        # a dict without the tensors: read into fresh buffers, checksummed while read (what torch.load returns)
        "torchrl_dcp load (dict)": lambda: tdcp.DistributedCheckpoint(state={}).load(ours_dict),
        # a dict holding tensors of the saved shapes: read into them, as dcp.load fills a state dict
        "torchrl_dcp load (dict, in place)": lambda: tdcp.DistributedCheckpoint(state=dict(dest)).load(ours_dict),
        "torchrl_dcp load (module)": lambda: tdcp.DistributedCheckpoint(state=module).load(ours_mod),
        "torchrl_dcp load (stateful)": lambda: tdcp.DistributedCheckpoint(state=stateful).load(ours_obj),
        "torchrl_dcp load (dict, verify=False)": lambda: tdcp.DistributedCheckpoint(state={}).load(
            ours_dict, verify=False
        ),
    }
    rows: dict[str, Any] = {}
    for method, op in methods.items():
        op()  # warm-up (imports, first-touch of what stays allocated)
        rows[f"{method} warm"] = timed(op, reps, cold=False)
        if cold_too:
            rows[f"{method} cold"] = timed(op, reps, cold=True)
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": nbytes, "tensors": len(state), "seconds": rows}


def ratios(results: dict[str, Any]) -> dict[str, float | None]:
    """The issue's load targets as same-run ratios (speed-ups: > 1 is faster than the baseline)."""

    def s(state: str, method: str) -> float | None:
        return results.get(state, {}).get("seconds", {}).get(method)

    def speedup(state: str, base: str, ours: str) -> float | None:
        a, b = s(state, base), s(state, ours)
        return a / b if a and b else None

    large = results.get("large", {})

    def gbps(method: str) -> float | None:
        sec = s("large", method)
        return large["bytes"] / sec / 1e9 if sec else None

    return {
        "large: verified cold load (dict) / raw readinto": speedup("large", "raw readinto cold", "torchrl_dcp load (dict) cold"),
        "large: verified cold load (dict, in place) / raw readinto": speedup("large", "raw readinto cold", "torchrl_dcp load (dict, in place) cold"),
        "large: verified cold load (module) / raw readinto": speedup("large", "raw readinto cold", "torchrl_dcp load (module) cold"),
        "large: verified cold load (stateful) / raw readinto": speedup("large", "raw readinto cold", "torchrl_dcp load (stateful) cold"),
        "large: verified warm load (dict), GB/s": gbps("torchrl_dcp load (dict) warm"),
        "large: verified warm load (module), GB/s": gbps("torchrl_dcp load (module) warm"),
        "large: verified warm load (stateful), GB/s": gbps("torchrl_dcp load (stateful) warm"),
        "large: cold load vs torch.load": speedup("large", "torch.load cold", "torchrl_dcp load (dict) cold"),
        "large: cold load vs dcp.load": speedup("large", "dcp.load cold", "torchrl_dcp load (dict) cold"),
        "large: cold load vs torchrl.checkpoint": speedup("large", "torchrl.checkpoint load cold", "torchrl_dcp load (dict) cold"),
        "small: load (dict) vs torch.load": speedup("small", "torch.load warm", "torchrl_dcp load (dict) warm"),
        "small: load (dict, in place) vs torch.load": speedup("small", "torch.load warm", "torchrl_dcp load (dict, in place) warm"),
        "small: load (module) vs torch.load": speedup("small", "torch.load warm", "torchrl_dcp load (module) warm"),
        "small: load (stateful) vs torch.load": speedup("small", "torch.load warm", "torchrl_dcp load (stateful) warm"),
        "small: load (dict) vs dcp.load": speedup("small", "dcp.load warm", "torchrl_dcp load (dict) warm"),
        "small: load (dict) vs torchrl.checkpoint": speedup("small", "torchrl.checkpoint load warm", "torchrl_dcp load (dict) warm"),
    }  # fmt: skip


TARGETS = {
    "large: verified cold load (dict) / raw readinto": 0.9,
    "large: verified cold load (module) / raw readinto": 0.9,
    "large: verified cold load (stateful) / raw readinto": 0.85,
    "large: verified warm load (dict), GB/s": 6.0,
    "large: verified warm load (stateful), GB/s": 6.0,
    "small: load (dict) vs torch.load": 4.0,
    "small: load (module) vs torch.load": 4.0,
    "small: load (stateful) vs torch.load": 4.0,
    "small: load (dict) vs dcp.load": 10.0,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the large state (MiB)")
    ap.add_argument("--small", type=int, default=5000, help="number of 1 KiB tensors of the small state")
    ap.add_argument("--reps", type=int, default=5, help="runs per figure of the large state (median)")
    ap.add_argument(
        "--small-reps", type=int, default=21, help="runs per figure of the small state (median; 5 gave +-10 %%)"
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--tag", default="cpu-2cpu-batch3")
    ap.add_argument("--chart", default=None, help="also draw the ratios into this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="tdcp-loads-", dir=args.dir))
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {
        "mib": args.mib,
        "small_tensors": args.small,
        "reps": args.reps,
        "small_reps": args.small_reps,
        "torch": torch.__version__,
    }
    try:
        large = {"w": torch.randn(args.mib * MiB // 4, generator=g)}
        results["large"] = measure("large", large, root, args.reps, cold_too=True)
        del large
        small = {f"p{i:05d}": torch.randn(256, generator=g) for i in range(args.small)}
        results["small"] = measure("small", small, root, args.small_reps, cold_too=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["ratios"] = ratios(results)
    out = ROOT / "benchmarks" / "results" / f"loads-{args.tag}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    for state in ("large", "small"):
        print(f"{state}: {results[state]['tensors']} tensor(s), {results[state]['bytes'] / 1e9:.3f} GB")
        for method, sec in results[state]["seconds"].items():
            gbps = results[state]["bytes"] / sec / 1e9 if sec else None
            print(
                f"  {method:45s} {'—' if sec is None else f'{sec:.4f} s'}  {'' if gbps is None else f'{gbps:.2f} GB/s'}"
            )
    for name, value in results["ratios"].items():
        target = TARGETS.get(name)
        print(f"{name:55s} {'—' if value is None else f'{value:.2f}'}" + (f"  (target >= {target})" if target else ""))
    print(f"results: {out.relative_to(ROOT)}")
    if args.chart:
        from benchmarks.chart import draw

        drawn = draw(results, Path(args.chart), TARGETS)
        print(
            f"chart: {args.chart}" if drawn else "chart skipped: matplotlib is not installed (pip install '.[bench]')"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
