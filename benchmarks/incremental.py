"""Incremental saves of a replay buffer: time and bytes against a full save, on 1 and 2 ranks.

Each rank holds a full ``LazyTensorStorage`` buffer of ``--mib`` MiB (rows of 4 KiB
observations), saves it in full (the base), then adds ``--fractions`` of new rows and
saves again twice from the same state: in full and incrementally from the base. Reported
per rank count and fraction: median seconds of each (the slowest rank), the bytes newly
written by the incremental save as a share of the full save's, and the warm load time of
both checkpoints. ``--chunk-mib`` sweeps the chunk size (one rank).

Usage::

    python -m benchmarks.incremental --mib 1024 --ranks 1,2 --fractions 0.01,0.1 --reps 3
    python -m benchmarks.incremental --mib 1024 --ranks 1 --chunk-mib 2,4,8,16,32 --fractions 0.01

Writes a JSON report to ``--out`` (default: print only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROW_FLOATS = 1024  # 4 KiB per row


def _buffer(rows: int) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(rows), batch_size=256)
    step = 1 << 14
    for start in range(0, rows, step):
        n = min(step, rows - start)
        rb.extend(TensorDict({"obs": torch.randn(n, ROW_FLOATS), "reward": torch.randn(n)}, [n]))
    return rb


def _add(rb: Any, n: int) -> None:
    from tensordict import TensorDict

    rb.extend(TensorDict({"obs": torch.randn(n, ROW_FLOATS), "reward": torch.randn(n)}, [n]))


def _written(path: Path) -> tuple[int, int]:
    """(bytes of files this save wrote, bytes of all its files), from the manifest."""
    import torchrl_dcp as tdcp

    files = tdcp.read_manifest(path)["files"]
    total = sum(r["size"] for r in files.values())
    new = sum(r["size"] for r in files.values() if "origin" not in r)
    return new, total


def _timed(fn: Any) -> float:
    if dist.is_initialized():
        dist.barrier()
    t = time.perf_counter()
    fn()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t


def run(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import torchrl_dcp as tdcp
    from torchrl_dcp import chunking

    if cfg.get("chunk_mib"):
        chunking.CHUNK_BYTES = int(cfg["chunk_mib"] * (1 << 20))
        chunking.MIN_CHUNKED_BYTES = 2 * chunking.CHUNK_BYTES
    rows = cfg["mib"] * (1 << 20) // (ROW_FLOATS * 4)
    rb = _buffer(rows)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    root = Path(cfg["dir"])
    out: dict[str, Any] = {"ranks": world, "mib_per_rank": cfg["mib"], "chunk_mib": chunking.CHUNK_BYTES / (1 << 20)}
    for frac in cfg["fractions"]:
        full_s, inc_s, content_s, load_full, load_inc, fracs = [], [], [], [], [], []
        for rep in range(cfg["reps"]):
            tag = f"{frac}-{rep}"
            base = root / f"base-{tag}"
            ckpt.save(base)
            _add(rb, max(1, int(rows * frac)))
            inc_s.append(_timed(lambda: ckpt.save(root / f"inc-{tag}", incremental_from=base)))  # noqa: B023
            full_s.append(_timed(lambda: ckpt.save(root / f"full-{tag}")))  # noqa: B023
            # the last save was not the base: rows proven by their fingerprints (as after a resume)
            content_s.append(_timed(lambda: ckpt.save(root / f"content-{tag}", incremental_from=base)))  # noqa: B023
            if rank == 0:
                new, _ = _written(root / f"inc-{tag}")
                full_new, _ = _written(root / f"full-{tag}")
                fracs.append(new / full_new)
            fresh = tdcp.DistributedCheckpoint(buffer=_buffer_like(rb))
            load_full.append(_timed(lambda: fresh.load(root / f"full-{tag}")))  # noqa: B023
            load_inc.append(_timed(lambda: fresh.load(root / f"inc-{tag}")))  # noqa: B023
            if dist.is_initialized():
                dist.barrier()
            if rank == 0:
                for p in (base, root / f"full-{tag}", root / f"inc-{tag}", root / f"content-{tag}"):
                    shutil.rmtree(p)
        out[str(frac)] = {
            "full_save_s": statistics.median(full_s),
            "incremental_save_s": statistics.median(inc_s),
            "speedup": statistics.median(full_s) / statistics.median(inc_s),
            "incremental_by_content_s": statistics.median(content_s),
            "speedup_by_content": statistics.median(full_s) / statistics.median(content_s),
            "bytes_written_fraction": statistics.median(fracs) if fracs else None,
            "load_full_s": statistics.median(load_full),
            "load_incremental_s": statistics.median(load_inc),
        }
    return out if rank == 0 else None


def _buffer_like(rb: Any) -> Any:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    return TensorDictReplayBuffer(storage=LazyTensorStorage(rb._storage.max_size), batch_size=256)


def run_world(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    if world == 1:
        return run(0, 1, cfg)  # type: ignore[return-value]
    from benchmarks.world import spawn_world

    return spawn_world(world, run, cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="buffer size per rank (MiB)")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--fractions", default="0.01,0.1")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mib", default="", help="comma-separated chunk sizes to sweep (MiB)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = []
    sweeps = [float(c) for c in args.chunk_mib.split(",") if c] or [None]
    for world in (int(r) for r in args.ranks.split(",")):
        for chunk in sweeps:
            with tempfile.TemporaryDirectory(prefix="tdcp-bench-inc-", dir=os.environ.get("TDCP_BENCH_DIR")) as d:
                cfg = {
                    "mib": args.mib,
                    "fractions": [float(f) for f in args.fractions.split(",")],
                    "reps": args.reps,
                    "dir": d,
                    "chunk_mib": chunk,
                }
                result = run_world(world, cfg)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
