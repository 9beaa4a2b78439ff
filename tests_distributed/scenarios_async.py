"""Per-rank programs for the async-save multi-process tests (run through ``launch``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
import torchrl_dcp.storage.writer as storage_writer


def _objects(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    return {
        "model": torch.nn.Linear(32, 32),
        "big": {f"w{i}": torch.full((300_000,), float(seed + i)) for i in range(4)},  # replicated, > 1 MiB each
        "shard": {"values": torch.arange(1000, dtype=torch.float64) + 1000 * rank + seed},
    }


def _checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"], big=objs["big"])
    ckpt.register("shard", objs["shard"], placement="per_rank")
    return ckpt


def _summary(objs: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": float(sum(p.double().sum() for p in objs["model"].parameters())),
        "big": [float(objs["big"][f"w{i}"].sum()) for i in range(4)],
        "shard": float(objs["shard"]["values"].sum()),
        "rank": dist.get_rank(),
    }


def sync_then_async(sync_path: str, async_path: str, seed: int) -> dict[str, Any]:
    """Save the same state sync and async; mutate right after async_save returns; report the saved state."""
    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    ckpt.save(sync_path, step=1)
    expected = _summary(objs)
    handle = ckpt.async_save(async_path, step=1)
    with torch.no_grad():
        for p in objs["model"].parameters():
            p.add_(1.0)
        objs["shard"]["values"].add_(1.0)
        objs["big"]["w0"].add_(1.0)
    handle.wait()
    return {"expected": expected, "staged_keys": len(ckpt._async._buffers)}


def load_summary(path: str, seed: int) -> dict[str, Any]:
    objs = _objects(seed + 1000)
    _checkpoint(objs).load(path)
    return _summary(objs)


def fail_in_background(path: str, seed: int, where: str) -> dict[str, Any]:
    """Rank 1's background write fails; every rank must see a CheckpointError at ``where``."""
    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    ckpt.save(path, step=1)
    if dist.get_rank() == 1:

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        storage_writer.write_share = fail
    handle = ckpt.async_save(path, step=2)
    out: dict[str, Any] = {"error": None}
    try:
        if where == "wait":
            handle.wait()
        else:
            ckpt.async_save(path, step=3)
    except tdcp.CheckpointError as err:
        out = {"error": type(err).__name__, "message": str(err)}
    dist.barrier()
    return out
