"""Per-rank programs for archive and rotation tests (run through ``launch``)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def _objects(step: int) -> tuple[tdcp.DistributedCheckpoint, dict[str, Any]]:
    rank = dist.get_rank()
    torch.manual_seed(step)
    objs = {"model": torch.nn.Linear(8, 4), "shard": {"v": torch.tensor([100.0 * rank + step])}}
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"])
    ckpt.register("shard", objs["shard"], placement="per_rank")
    return ckpt, objs


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def rotation_saves(directory: str, steps: list[int], archive: bool, kill: str | None, kill_step: int) -> list[str]:
    """Save ``steps`` through a rotation (keep_last=2, best reward); SIGKILL one rank during ``kill_step``.

    kill="commit": rank 1 dies after writing its data, before the manifest is committed.
    kill="archive": rank 0 dies half-way through packing the committed directory into its archive.
    """
    rotation = tdcp.CheckpointRotation(directory, keep_last=2, keep_best=("reward", "max"), archive=archive)
    names = []
    for step in steps:
        ckpt, _ = _objects(step)
        if step == kill_step and kill == "commit" and dist.get_rank() == 1:
            import torchrl_dcp._dist as d

            d.gather_to_0 = lambda *a, **k: _kill_self()  # type: ignore[assignment]
        if step == kill_step and kill == "archive" and dist.get_rank() == 0:
            import dataclasses

            import torchrl_dcp.storage.copying as c

            original = c.copy_ranges

            def copy_then_die(ranges, original=original, **kwargs):  # type: ignore[no-untyped-def]
                original([dataclasses.replace(r, size=r.size // 2) for r in ranges], **kwargs)  # half of each file
                _kill_self()

            c.copy_ranges = copy_then_die
        names.append(rotation.save(ckpt, step=step, metadata={"reward": float(step % 3)}).name)
    return names


def rotation_resume(directory: str) -> dict[str, Any]:
    """Fresh objects; resume from the latest committed entry; report what was restored."""
    ckpt, objs = _objects(-1)
    info = tdcp.resume(ckpt, directory)
    if info is None:
        return {"step": None}
    torch.manual_seed(info.step)
    expected = torch.nn.Linear(8, 4)
    return {
        "step": info.step,
        "name": info.path.name,
        "model_ok": bool(torch.equal(objs["model"].weight, expected.weight)),
        "shard": objs["shard"]["v"].item(),
    }
