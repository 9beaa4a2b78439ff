"""Per-rank programs: a restore that fails on one rank is rolled back on every rank."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


class Fragile:
    """Per-rank state whose ``load_state_dict`` fails on the rank told to fail (after changing itself)."""

    def __init__(self, value: float, fail_on: int | None = None) -> None:
        self.value = torch.tensor([value])
        self.fail_on = fail_on

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.copy_(state["value"])
        if self.fail_on == dist.get_rank():
            raise RuntimeError(f"injected failure on rank {dist.get_rank()}")


def _objects(seed: int, fail_on: int | None) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model,
        "optimizer": optimizer,
        "shard": {"seen": 100 * rank + seed},
        "fragile": Fragile(float(10 * rank + seed), fail_on),
    }


def _checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"], optimizer=objs["optimizer"])
    ckpt.register("shard", objs["shard"], placement="per_rank")
    ckpt.register("fragile", objs["fragile"], placement="per_rank")
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _fingerprint(objs: dict[str, Any]) -> list[Any]:
    return [
        [v.tolist() for v in objs["model"].state_dict().values()],
        [
            [t.tolist() if isinstance(t, torch.Tensor) else t for t in s.values()]
            for s in objs["optimizer"].state.values()
        ],
        dict(objs["shard"]),
        objs["fragile"].value.tolist(),
        torch.get_rng_state().tolist()[:64],
        int(np.random.get_state()[2]),
        random.getstate()[1][:4],
    ]


def restore_fails_on_one_rank(directory: str, fail_on: int) -> dict[str, Any]:
    path = _checkpoint(_objects(1, None)).save(Path(directory) / "ckpt", step=1)
    objs = _objects(2, fail_on)
    before = _fingerprint(objs)
    try:
        _checkpoint(objs).load(path)
    except tdcp.CheckpointError as err:
        return {"error": str(err), "unchanged": _fingerprint(objs) == before}
    return {"error": None, "unchanged": _fingerprint(objs) == before}
