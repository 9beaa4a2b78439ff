"""Storages across a world-size change: shards whose transitions cannot be joined are refused, naming why.

The per-rank programs are the functions below the test (each rank imports this module: ``launch(f"{S}:...")``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests_distributed.launch import launch

S = "tests_distributed.test_reshard_storages"


def test_a_never_written_preallocated_shard_joins_a_written_one(tmp_path: Path) -> None:
    """A pre-allocated ``TensorStorage`` counts its rows as written (torchrl: ``len`` is its size from the start),
    without the ``index`` entry a ``TensorDictReplayBuffer``'s first write adds: rank 0's never written shard and
    rank 1's written one join (docs/components/replay-buffers.md: such a storage reshards like a lazy one; the
    entry is allocated as zeros for the rows that lack it, as torchrl's first write does; probe t3)."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_preallocated", 2, path)
    (r,) = launch(f"{S}:load_preallocated", 1, path)
    assert r.value["error"] is None and r.value["len"] == 20 and r.value["changed"], r.value


# ---------------------------------------------------------------- per-rank programs
def _preallocated(capacity: int) -> Any:
    from torchrl.data import TensorDictReplayBuffer, TensorStorage

    rows = TensorDict({"obs": torch.zeros(capacity, 2)}, batch_size=[capacity])
    return TensorDictReplayBuffer(storage=TensorStorage(rows), batch_size=2)


def save_preallocated(path: str) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    rb = _preallocated(10)
    if dist.get_rank() == 1:
        rb.extend(TensorDict({"obs": torch.arange(10.0).view(5, 2)}, batch_size=[5]))
    tdcp.DistributedCheckpoint(rb=rb).save(path, step=1)
    return {}


def load_preallocated(path: str) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    rb = _preallocated(20)
    try:
        tdcp.DistributedCheckpoint(rb=rb).load(path, world_size_change="reshard")
        error = None
    except tdcp.CheckpointError as err:
        error = str(err)
    return {"error": error, "len": len(rb), "changed": bool(rb._storage._storage["obs"].any())}
