"""Peak extra memory of a load: how much a process's peak RSS grows while loading a state of known size.

Each measurement runs in a fresh process (``VmHWM`` of ``/proc/self/status``: the
process's own peak; ``ru_maxrss`` of a fresh child reports its parent's), which builds
the live objects, records its peak, loads, and reports ``(peak after - peak before) /
state bytes``. Compared in the same run: ``torch.load`` + ``load_state_dict`` and plain
``dcp.load`` into ``state_dict()`` (what users of those do).

Usage::

    python -m benchmarks.memory --mib 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _objects(mib: int, optimizer: bool) -> dict[str, Any]:
    side = int((mib * (1 << 20) // 4) ** 0.5)
    model = torch.nn.Linear(side, side, bias=False)
    objs: dict[str, Any] = {"model": model}
    if optimizer:  # Adam state allocated as a step would, without a gradient raising the peak
        opt = torch.optim.Adam(model.parameters())
        opt.state[model.weight] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(model.weight),
            "exp_avg_sq": torch.zeros_like(model.weight),
        }
        objs["optimizer"] = opt
    return objs


def _state_bytes(objs: dict[str, Any]) -> int:
    n = sum(t.numel() * t.element_size() for t in objs["model"].state_dict().values())
    if "optimizer" in objs:
        n += sum(
            t.numel() * t.element_size()
            for s in objs["optimizer"].state.values()
            for t in s.values()
            if torch.is_tensor(t)
        )
    return n


def child(kind: str, path: str, mib: int, optimizer: bool) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import torch.distributed.checkpoint as dcp

    import torchrl_dcp as tdcp
    import torchrl_dcp.checkpoint  # noqa: F401  (imported before measuring: imports are not the load's memory)

    objs = _objects(mib, optimizer)
    before = _peak()
    if kind == "torchrl_dcp":
        tdcp.DistributedCheckpoint(**objs).load(Path(path) / "ours")
    elif kind == "torch.load":
        state = torch.load(Path(path) / "torch.pt", weights_only=True)
        objs["model"].load_state_dict(state["model"])
        if optimizer:
            objs["optimizer"].load_state_dict(state["optimizer"])
    else:  # plain dcp.load into the module's own state_dict (DCP allocates and copies per tensor)
        dcp.load({"model": objs["model"].state_dict()}, checkpoint_id=str(Path(path) / "dcp"), no_dist=True)
    return {"kind": kind, "extra": (_peak() - before) / _state_bytes(objs), "state_bytes": _state_bytes(objs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--child", nargs=4, metavar=("KIND", "PATH", "MIB", "OPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, mib, opt = args.child
        print(json.dumps(child(kind, path, int(mib), opt == "1")))
        return
    import torch.distributed.checkpoint as dcp

    import torchrl_dcp as tdcp

    rows = []
    for optimizer in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            objs = _objects(args.mib, optimizer)
            path = Path(tmp)
            tdcp.DistributedCheckpoint(**objs).save(path / "ours")
            torch.save({k: v.state_dict() for k, v in objs.items()}, path / "torch.pt")
            dcp.save({"model": objs["model"].state_dict()}, checkpoint_id=str(path / "dcp"), no_dist=True)
            del objs
            for kind in ("torchrl_dcp", "torch.load", "dcp.load")[: 3 if not optimizer else 2]:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.memory",
                        "--child",
                        kind,
                        str(path),
                        str(args.mib),
                        str(int(optimizer)),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["state"] = "module + Adam (stepped)" if optimizer else "module"
                rows.append(row)
                print(
                    f"{row['state']:<26} {kind:<12} peak extra memory = {row['extra']:.2f} x the state ({row['state_bytes'] / 2**20:.0f} MiB)"
                )


if __name__ == "__main__":
    main()
