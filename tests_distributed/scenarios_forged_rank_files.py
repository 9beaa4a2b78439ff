"""Per-rank programs for ``test_forged_rank_files.py`` (run through ``launch``): each rank's own state is told apart
by its values (rank ``r``'s replay buffer holds rows of ``r``, its counter ``10 + r``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrl.data import LazyTensorStorage, ReplayBuffer

import torchrl_dcp as tdcp


def _job() -> tuple[tdcp.DistributedCheckpoint, ReplayBuffer, dict[str, Any], torch.nn.Linear]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    buffer = ReplayBuffer(storage=LazyTensorStorage(50))
    buffer.extend(torch.full((20, 4), float(rank)))  # the same sizes on every rank: the files can be swapped
    counter = {"steps": torch.tensor([10 + rank])}
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("buffer", buffer)
    ckpt.register("counter", counter, placement="per_rank")
    return ckpt, buffer, counter, policy


def save(path: str) -> dict[str, Any]:
    ckpt, *_ = _job()
    ckpt.save(path, step=1)
    return {"rank": dist.get_rank()}


def load(path: str, own_copy: bool = False) -> dict[str, Any]:
    """Load into emptied state; report the error, if any, and what the rank holds after it. ``own_copy``: each rank
    loads its own copy of the checkpoint (``<path>-<rank>``), as ranks mounting one save at their own paths do."""
    ckpt, buffer, counter, policy = _job()
    if own_copy:
        path = f"{path}-{dist.get_rank()}"
    buffer.empty()
    counter["steps"] = torch.tensor([-1])
    with torch.no_grad():
        policy.weight.zero_()
    error, kind = None, None
    try:
        ckpt.load(path)
    except Exception as err:  # noqa: BLE001 - reported to the test
        error, kind = str(err), type(err).__name__
    return {
        "rank": dist.get_rank(),
        "error": error,
        "kind": kind,
        "rows": len(buffer),
        "first": buffer[:1][0].tolist() if len(buffer) else None,
        "steps": counter["steps"].tolist(),
        "policy_zero": bool((policy.weight == 0).all()),
    }
