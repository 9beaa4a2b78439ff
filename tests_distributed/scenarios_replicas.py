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
