"""Per-rank programs for the replica check: replicated state that differs between ranks is never committed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def _model(rank: int, differ: str) -> torch.nn.Module:
    torch.manual_seed(0)
    outputs = 5 if differ == "shape" and rank == 1 else 4
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, outputs))
    with torch.no_grad():
        if differ == "bias" and rank == 1:
            model[1].bias[0] += 1
        if differ == "unsampled" and rank == 1:  # a byte no slice of the sample covers
            model[0].weight.view(-1)[1000] += 1
    return model


def save_differing(directory: str, differ: str, mode: str, component_mode: str | None) -> dict[str, Any]:
    """Save a model whose replicas differ as ``differ`` says; report what happened on this rank."""
    rank = dist.get_rank()
    ckpt = tdcp.DistributedCheckpoint(replica_check=mode)
    ckpt.register("model", _model(rank, differ), replica_check=component_mode)
    if differ == "dict":
        # per-rank values registered without placement, deep in a config among equal ones
        ckpt.register("counters", {"run": "a", "opt": {"betas": [0.9, 0.99], "lr": 0.1 * (1 + rank)}, "n": [1, 2]})
    path = Path(directory) / "ckpt"
    try:
        ckpt.save(path, step=1)
    except tdcp.CheckpointError as err:
        return {
            "error": str(err),
            "type": type(err).__name__,
            "exists": path.exists(),
            "left": sorted(os.listdir(directory)),
        }
    return {"error": None, "exists": path.exists()}


def save_sharded_differing(directory: str, differ: str) -> dict[str, Any]:
    """A sharded component ``{"d": DTensor, "plain": tensor, "count": int}`` whose non-DTensor parts differ on rank 1
    (``differ``: "plain", "count" or "none"); report what happened, and what a load gives back when it saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = float(rank) if differ == "plain" else 0.0
    count = rank if differ == "count" else 0
    state = {"d": distribute_tensor(torch.arange(35.0).reshape(7, 5), mesh, [Shard(0)]), "plain": torch.full((3,), plain), "count": count}  # fmt: skip
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("s", state, placement="sharded")
    path = Path(directory) / "ckpt"
    try:
        ckpt.save(path, step=1)
    except tdcp.CheckpointError as err:
        return {"error": str(err), "type": type(err).__name__, "exists": path.exists()}
    fresh = {"d": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]), "plain": torch.full((3,), -1.0), "count": -1}
    back = tdcp.DistributedCheckpoint()
    back.register("s", fresh, placement="sharded")
    back.load(path)
    return {"error": None, "plain": fresh["plain"].tolist(), "count": fresh["count"], "d": fresh["d"].full_tensor().sum().item()}  # fmt: skip


def save_with_a_key_more(directory: str, on_rank: int) -> dict[str, Any]:
    """A replicated dict holding one tensor more on ``on_rank``: the refusal names that tensor whichever rank holds
    it."""
    rank = dist.get_rank()
    value = {"a": torch.ones(3)}
    if rank == on_rank:
        value["b"] = torch.ones(3)
    try:
        tdcp.DistributedCheckpoint(x=value).save(Path(directory) / "ckpt", step=1)
    except tdcp.CheckpointError as err:
        return {"error": str(err), "type": type(err).__name__}
    return {"error": None}
