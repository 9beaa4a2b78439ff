"""Per-rank programs: every rank of a job imports one torchrl.checkpoint checkpoint (written by one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

import torchrl_dcp as tdcp
from tests_distributed.scenarios_rollback import Fragile


def _objects(seed: int, fail_on: int | None) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16), sampler=PrioritizedSampler(16, 0.6, 0.4), batch_size=4)
    rb.extend(TensorDict({"obs": torch.randn(5 + seed, 2)}, [5 + seed]))
    return {"model": model, "optimizer": optimizer, "rb": rb, "fragile": Fragile(float(seed), fail_on)}


def _fingerprint(objs: dict[str, Any]) -> list[Any]:
    rb = objs["rb"]
    return [
        [v.tolist() for v in objs["model"].state_dict().values()],
        [t.tolist() for s in objs["optimizer"].state.values() for t in s.values()],
        len(rb),
        rb[: len(rb)]["obs"].tolist() if len(rb) else [],
        objs["fragile"].value.tolist(),
    ]


def import_on_every_rank(directory: str, fail_on: int | None) -> dict[str, Any]:
    path = Path(directory) / "torchrl-ckpt"
    if dist.get_rank() == 0:
        Checkpoint(**_objects(1, None)).save(path, metadata={"step": 7})
    dist.barrier()
    expected = _fingerprint(_objects(1, None))
    objs = _objects(2 + dist.get_rank(), fail_on)
    before = _fingerprint(objs)
    ckpt = tdcp.DistributedCheckpoint(model=objs["model"], optimizer=objs["optimizer"])
    ckpt.register("rb", objs["rb"], placement="per_rank")
    ckpt.register("fragile", objs["fragile"], placement="per_rank")
    try:
        result = ckpt.load(path)
    except tdcp.CheckpointError as err:
        return {"error": str(err), "unchanged": _fingerprint(objs) == before}
    return {"error": None, "step": result.step, "restored": _fingerprint(objs) == expected}
