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
