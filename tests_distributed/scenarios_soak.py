"""Per-rank program of the soak test: many async saves with rotation, each loaded back and checked; RSS tracked."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _state(step: int, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)  # replicated: the same on every rank
    weights = {f"w{i}": torch.randn(512, 256, generator=gen) for i in range(4)}  # 2 MiB
    gen = torch.Generator().manual_seed(1000 * step + rank)
    shard = {"buffer": torch.randint(0, 1 << 30, (131_072,), generator=gen), "step": step, "rank": rank}  # 1 MiB
    return {"weights": weights, "shard": shard}


def soak(directory: str, rounds: int, keep_last: int) -> dict[str, Any]:
    """``rounds`` async saves through a rotation; after each, every rank loads the latest and checks it."""
    rank = dist.get_rank()
    live = _state(0, rank)
    weights = {k: v.clone() for k, v in live["weights"].items()}
    shard: dict[str, Any] = {"buffer": live["shard"]["buffer"].clone(), "step": 0, "rank": rank}
    ckpt = tdcp.DistributedCheckpoint(weights=weights)
    ckpt.register("shard", shard, placement="per_rank")
    restored_w = {k: torch.zeros_like(v) for k, v in weights.items()}
    restored_s: dict[str, Any] = {"buffer": torch.zeros_like(shard["buffer"]), "step": -1, "rank": -1}
    loader = tdcp.DistributedCheckpoint(weights=restored_w)
    loader.register("shard", restored_s, placement="per_rank")
    rotation = tdcp.CheckpointRotation(directory, keep_last=keep_last)
    rss: list[int] = []
    for step in range(1, rounds + 1):
        new = _state(step, rank)  # training moves on: new values in the same tensors
        for k, v in new["weights"].items():
            weights[k].copy_(v)
        shard["buffer"].copy_(new["shard"]["buffer"])
        shard["step"] = step
        handle = ckpt.async_save(rotation.path_for(step), step=step)
        for k in weights:  # the next step overwrites the live tensors while the save is written
            weights[k].mul_(-1)
        handle.wait()
        if rank == 0:
            rotation.prune()
        dist.barrier()
        assert rotation.latest() == rotation.path_for(step)
        loader.load(rotation.latest())
        for k, v in new["weights"].items():
            assert torch.equal(restored_w[k], v), (step, k)
        assert torch.equal(restored_s["buffer"], new["shard"]["buffer"]), step
        assert restored_s["step"] == step and restored_s["rank"] == rank
        assert [e.step for e in rotation.entries()] == list(range(max(1, step - keep_last + 1), step + 1))
        gc.collect()
        rss.append(_rss_kib())
    return {"rss_kib": rss}
