"""A replay buffer of MuJoCo-like transitions saved in one process, as a user compares it (same run, medians).

The buffer holds ``--transitions`` rows of HalfCheetah-sized transitions (observation 17
floats, action 6, next observation, reward, done/terminated/truncated, trajectory id, and
the index the buffer adds: 183 bytes per row; 1M rows: 183 MB). Timed, alternately, each followed by ``os.sync()``
outside the timing so one save's writeback never lands in the next:

- ``torchrl.checkpoint`` save (no fsync: what its ``save`` returns after), and the same
  save plus ``os.sync()`` (what durability costs it: one sync of the file system);
- ``torch.save`` of the buffer's ``state_dict()`` plus ``os.fsync``;
- ``DistributedCheckpoint.save`` (durable when it returns: every file fsynced, the
  manifest committed last).

Usage::

    python -m benchmarks.buffer_save --transitions 1000000 --reps 7 --out benchmarks/results/buffer-save-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

OBS, ACT = 17, 6


def make_buffer(n: int) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), batch_size=256)
    flags = {k: torch.zeros(n, 1, dtype=torch.bool) for k in ("done", "terminated", "truncated")}
    rb.extend(
        TensorDict(
            {
                "observation": torch.randn(n, OBS),
                "action": torch.randn(n, ACT),
                "next": {"observation": torch.randn(n, OBS), "reward": torch.randn(n, 1), **flags},
                "collector": {"traj_ids": torch.arange(n) // 1000},
            },
            [n],
        )
    )
    return rb


def _timed(fn: Callable[[Path], Any], path: Path) -> float:
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def methods(rb: Any) -> dict[str, Callable[[Path], Any]]:
    from torchrl.checkpoint import Checkpoint

    import torchrl_dcp as tdcp

    ours = tdcp.DistributedCheckpoint()
    ours.register("rb", rb)

    def torchrl_sync(p: Path) -> None:
        Checkpoint(rb=rb).save(p)
        os.sync()

    def torch_save(p: Path) -> None:
        with open(p, "wb") as f:
            torch.save(rb.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    return {
        "torchrl.checkpoint": lambda p: Checkpoint(rb=rb).save(p),
        "torchrl.checkpoint + os.sync()": torchrl_sync,
        "torch.save + fsync": torch_save,
        "torchrl_dcp save": ours.save,
    }


def run(transitions: int, reps: int, root: Path) -> dict[str, Any]:
    rb = make_buffer(transitions)
    nbytes = sum(t.numel() * t.element_size() for t in rb._storage._storage.values(True, True))
    timings: dict[str, list[float]] = {}
    for name, fn in methods(rb).items():  # a warm-up of each (first allocations, page cache)
        _timed(fn, root / "warm")
        shutil.rmtree(root / "warm", ignore_errors=True)
        (root / "warm").unlink(missing_ok=True)
        timings[name] = []
    os.sync()
    for i in range(reps):
        for name, fn in methods(rb).items():
            path = root / f"{i}-{len(timings[name])}"
            timings[name].append(_timed(fn, path))
            shutil.rmtree(path, ignore_errors=True)
            path.unlink(missing_ok=True)
            os.sync()
    med = {k: statistics.median(v) for k, v in timings.items()}
    ours = med["torchrl_dcp save"]
    return {
        "transitions": transitions,
        "bytes": nbytes,
        "reps": reps,
        "seconds": timings,
        "median_seconds": med,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "speed_vs": {k: v / ours for k, v in med.items() if k != "torchrl_dcp save"},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transitions", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--out", default=None, help="JSON report (default: print only)")
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="tdcp-buffer-save-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        report = run(args.transitions, args.reps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report["command"] = "python -m benchmarks.buffer_save " + " ".join(argv if argv is not None else [])
    print(f"{report['transitions']:,} transitions, {report['bytes'] / 1e6:.0f} MB; median of {report['reps']}:")
    for name, sec in report["median_seconds"].items():
        print(f"  {name:<32} {sec:.3f} s  {report['gb_per_s'][name]:.2f} GB/s")
    for name, ratio in report["speed_vs"].items():
        print(f"  torchrl_dcp save is {ratio:.2f}x as fast as {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
