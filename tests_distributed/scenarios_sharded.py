"""Per-rank programs: DTensor (FSDP-style) state placed "sharded", resharded by DCP itself."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import torchrl_dcp as tdcp


def _full() -> torch.Tensor:
    return torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # 7 rows: uneven shards on 2 and 3 ranks


def save_sharded(path: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = {"w": distribute_tensor(_full(), mesh, [Shard(0)])}
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("model", weights, placement="sharded")
    ckpt.register("rng", tdcp.RNGState())
    ckpt.save(path)
    return {"local_rows": weights["w"].to_local().shape[0]}


def load_sharded(path: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = {"w": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)])}
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("model", weights, placement="sharded")
    result = ckpt.load(path, components=["model"])
    full = weights["w"].full_tensor()
    return {
        "equal": bool(torch.equal(full, _full())),
        "loaded": sorted(result.loaded),
        "local_rows": weights["w"].to_local().shape[0],
    }


def load_into_another_shape(path: str, rows: int, dtype: str) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_sharded` (plus nothing else of the model's) with ``strict="warn"``
    into a DTensor of ``rows`` rows and ``dtype``, beside a dict that loads: the DTensor's component is skipped as
    incompatible while planning, the rest loads."""
    import warnings

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = {"w": distribute_tensor(torch.zeros(rows, 5, dtype=getattr(torch, dtype)), mesh, [Shard(0)])}
    ckpt = tdcp.DistributedCheckpoint(strict="warn")
    ckpt.register("model", weights, placement="sharded")
    ckpt.register("rng", tdcp.RNGState())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ckpt.load(path)
    return {
        "loaded": sorted(result.loaded),
        "incompatible": {k: str(v) for k, v in result.incompatible.items()},
        "warned": [type(w.message).__name__ for w in caught],
        "untouched": bool(weights["w"].full_tensor().eq(0).all()),
    }


def save_drifted_replicas(path: str, shape: list[int], drift_rank: int) -> dict[str, Any]:
    """A sharded component holding a DTensor placed ``Replicate()`` along the first dimension of a mesh of
    ``shape`` (``[W]``: every rank a copy; ``[2, W // 2]``: HSDP's ``(Replicate(), Shard(0))``), whose copy on
    ``drift_rank`` differs by one bit (``-1``: none does)."""
    from torch.distributed.tensor import DTensor, Replicate

    if shape == [2, 2, 0]:  # (data-parallel copies of a tensor-parallel submesh: ``mesh["tp"]``, Shard(0))
        mesh, placements = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"], [Shard(0)]
    else:
        mesh = init_device_mesh("cpu", tuple(shape))
        placements = [Replicate()] + [Shard(0)] * (len(shape) - 1)
    full = _full()
    local = distribute_tensor(full, mesh, placements).to_local().clone()
    if dist.get_rank() == drift_rank:
        local.view(torch.int32)[0, 0] ^= 1
    weights = {
        "w": DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    }
    ckpt = tdcp.DistributedCheckpoint(replica_check="sample")
    ckpt.register("model", weights, placement="sharded")
    try:
        ckpt.save(path)
    except tdcp.CheckpointError as err:
        return {"error": str(err)}
    return {"error": None}
