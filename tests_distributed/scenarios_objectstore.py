"""Per-rank programs for object-store saves with real ranks (run through ``launch``; S3 from fsspec's config)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def _objects(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    return {
        "model": torch.nn.Linear(256, 1024),  # replicated: its tensors' writes spread over the ranks
        "big": {f"w{i}": torch.full((1_500_000,), float(seed + i)) for i in range(4)},
        "shard": {"values": torch.arange(200_000, dtype=torch.float64) + 1000 * rank + seed},
    }


def _checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"], big=objs["big"])
    ckpt.register("shard", objs["shard"], placement="per_rank")
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _summary(objs: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": float(sum(p.double().sum() for p in objs["model"].parameters())),
        "big": [float(objs["big"][f"w{i}"].sum()) for i in range(4)],
        "shard": float(objs["shard"]["values"].sum()),
        "rng": float(torch.rand(1)),
    }


def save(url: str, seed: int, use_async: bool) -> dict[str, Any]:
    """Save on every rank; report what was saved (and the next random number, to check RNG restore)."""
    objs = _objects(seed)
    ckpt = _checkpoint(objs)
    path = ckpt.async_save(url, step=seed).wait() if use_async else ckpt.save(url, step=seed)
    state = torch.get_rng_state()
    out = {"path": str(path), **_summary(objs)}
    torch.set_rng_state(state)
    return out


def load(url: str, seed: int) -> dict[str, Any]:
    """Load into fresh objects (other values) on every rank; report what was restored."""
    objs = _objects(seed + 100)
    result = _checkpoint(objs).load(url)
    return {"step": result.step, **_summary(objs)}


def load_counting_lists(url: str, seed: int) -> dict[str, Any]:
    """:func:`load`, counting the listings of the prefix this rank makes."""
    import torchrl_dcp.storage.objectstore as objectstore

    listed = []
    list_objects = objectstore.list_objects

    def counted(path: Any) -> Any:
        listed.append(str(path))
        return list_objects(path)

    objectstore.list_objects = counted
    try:
        loaded = load(url, seed)
    finally:
        objectstore.list_objects = list_objects
    return {**loaded, "lists": len(listed)}


def load_refused(url: str, seed: int) -> dict[str, Any]:
    """Load into fresh objects; report the error and whether every object (and the RNG) is as it was before."""
    objs = _objects(seed + 100)
    before, rng = {k: v for k, v in _summary(objs).items() if k != "rng"}, torch.get_rng_state()
    try:
        _checkpoint(objs).load(url)
    except tdcp.CheckpointError as err:
        same_rng = torch.equal(torch.get_rng_state(), rng)  # (before _summary draws from it)
        after = {k: v for k, v in _summary(objs).items() if k != "rng"}
        return {"error": f"{type(err).__name__}: {err}", "unchanged": after == before and same_rng}
    return {"error": None}


def save_to_a_store_of_each_process(seed: int) -> dict[str, Any]:
    """Each rank saves to ``memory://`` (one store per process: rank 0 cannot see rank 1's objects)."""
    ckpt = _checkpoint(_objects(seed))
    try:
        ckpt.save(f"memory://tdcp-apart-{seed}/run/step-1", step=1)
    except tdcp.CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}
