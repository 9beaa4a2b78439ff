"""Peak extra memory of a load: how much a process's peak RSS grows while loading a state of known size.

Each measurement runs in a fresh process (``VmHWM`` of ``/proc/self/status``: the
process's own peak; ``ru_maxrss`` of a fresh child reports its parent's), which builds
the live objects, restarts its peak from what is resident (``/proc/self/clear_refs``,
where writable: filling a replay buffer peaks above its state), loads, and reports
``(peak after - peak before) / state bytes``: a process's first load, one-off costs
included. Compared in the same run: ``torch.load`` + ``load_state_dict`` and plain
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


def _objects(mib: int, what: str) -> dict[str, Any]:
    if what == "buffer":  # a prioritized replay buffer of ``mib`` MiB of rows, filled
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

        rows = mib * (1 << 20) // (4 * 1024)
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(rows), sampler=PrioritizedSampler(rows, alpha=0.7, beta=0.5), batch_size=32
        )
        rb.update_priority(rb.extend(TensorDict({"obs": torch.randn(rows, 1024)}, [rows])), torch.rand(rows) + 0.1)
        return {"buffer": rb}
    optimizer = what == "module + Adam (stepped)"
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
    if "buffer" in objs:
        return sum(t.numel() * t.element_size() for t in objs["buffer"].storage._storage.values(True, True))
    n = sum(t.numel() * t.element_size() for t in objs["model"].state_dict().values())
    if "optimizer" in objs:
        n += sum(
            t.numel() * t.element_size()
            for s in objs["optimizer"].state.values()
            for t in s.values()
            if torch.is_tensor(t)
        )
    return n


def _restart_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak of building the objects stays in "before"
        pass


def child(kind: str, path: str, mib: int, what: str) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import torch.distributed.checkpoint as dcp

    import torchrl_dcp as tdcp
    import torchrl_dcp.checkpoint  # noqa: F401  (imported before measuring: imports are not the load's memory)

    objs = _objects(mib, what)
    _restart_peak()
    before = _peak()
    if kind == "torchrl_dcp":
        tdcp.DistributedCheckpoint(**objs).load(Path(path) / "ours")
    elif kind == "torch.load":
        # a replay buffer's state_dict holds Python objects that ``weights_only=True`` refuses
        state = torch.load(Path(path) / "torch.pt", weights_only=what != "buffer")
        for name, obj in objs.items():
            obj.load_state_dict(state[name])
    else:  # plain dcp.load into the module's own state_dict (DCP allocates and copies per tensor)
        dcp.load({"model": objs["model"].state_dict()}, checkpoint_id=str(Path(path) / "dcp"), no_dist=True)
    return {"kind": kind, "extra": (_peak() - before) / _state_bytes(objs), "state_bytes": _state_bytes(objs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--child", nargs=4, metavar=("KIND", "PATH", "MIB", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, mib, what = args.child
        print(json.dumps(child(kind, path, int(mib), what)))
        return
    import torch.distributed.checkpoint as dcp

    import torchrl_dcp as tdcp

    rows = []
    for what in ("module", "module + Adam (stepped)", "buffer"):
        with tempfile.TemporaryDirectory() as tmp:
            objs = _objects(args.mib, what)
            path = Path(tmp)
            tdcp.DistributedCheckpoint(**objs).save(path / "ours")
            torch.save({k: v.state_dict() for k, v in objs.items()}, path / "torch.pt")
            if what == "module":
                dcp.save({"model": objs["model"].state_dict()}, checkpoint_id=str(path / "dcp"), no_dist=True)
            del objs
            for kind in ("torchrl_dcp", "torch.load", "dcp.load")[: 3 if what == "module" else 2]:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.memory",
                        "--child",
                        kind,
                        str(path),
                        str(args.mib),
                        what,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["state"] = what
                rows.append(row)
                print(
                    f"{row['state']:<26} {kind:<12} peak extra memory = {row['extra']:.2f} x the state ({row['state_bytes'] / 2**20:.0f} MiB)"
                )


if __name__ == "__main__":
    main()
