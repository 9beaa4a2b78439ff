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


class _FailsOnRank1(tdcp.Adapter):
    """A component whose restore fails on rank 1 (after the buffer's reshard wrote its rows)."""

    adapter_id = "tests.fails_on_rank_1"
    version = 1
    default_placement = "replicated"

    def state(self, obj: Any, ctx: Any) -> Any:
        return {"v": obj["v"]}

    def restore(self, obj: Any, state: Any, ctx: Any) -> Any:
        if ctx.rank == 1 and obj.get("fail"):
            raise RuntimeError("injected failure")
        obj["v"] = state["v"]
        return None


def _ids_buffer(ids: list[int]) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=2)
    rb.extend(TensorDict({"id": torch.tensor(ids)}, [len(ids)]))
    return rb


def reshard_fails_after_the_buffer(directory: str, phase: str) -> dict[str, Any]:
    """``save`` (one rank: rows 0..7), then ``load`` on two ranks resharding into buffers that hold rows of their
    own, a later component failing on rank 1: each buffer's rows as they were before the load."""
    path = str(Path(directory) / "ckpt")
    ckpt = tdcp.DistributedCheckpoint()
    if phase == "save":
        ckpt.register("buffer", _ids_buffer(list(range(8))))
        ckpt.register("flaky", {"v": 1}, adapter=_FailsOnRank1())
        ckpt.save(path)
        return {}
    before = list(range(9000 + 100 * dist.get_rank(), 9006 + 100 * dist.get_rank()))
    rb = _ids_buffer(before)
    ckpt.register("buffer", rb)
    ckpt.register("flaky", {"v": 0, "fail": True}, adapter=_FailsOnRank1())
    try:
        ckpt.load(path, world_size_change="reshard")
        error = None
    except tdcp.CheckpointError as err:
        error = str(err)
    return {"error": error, "before": before, "rows": rb._storage._storage["id"][: len(rb)].tolist()}
