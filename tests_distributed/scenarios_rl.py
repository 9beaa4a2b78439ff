"""Per-rank programs: replay buffers and collectors saved and restored by real ranks."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import torchrl_dcp as tdcp
from torchrl_dcp.examples.sac import fingerprint, make_env


def _build(scratch: str, tag: str) -> tuple[Any, Any, Any, tdcp.DistributedCheckpoint]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
    collector = Collector(
        make_env(100 + rank, torch.device("cpu")),
        policy,
        frames_per_batch=16,
        total_frames=-1,
        auto_register_policy_transforms=False,
    )
    storage = LazyMemmapStorage(40, scratch_dir=f"{scratch}/{tag}-{rank}") if rank % 2 else LazyTensorStorage(40)
    buffer = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=8)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("collector", collector)
    ckpt.register("buffer", buffer)
    ckpt.register("rng", tdcp.RNGState())
    return policy, collector, buffer, ckpt


def _steps(collector_iter: Any, buffer: Any, n: int) -> list[str]:
    out = []
    for _ in range(n):
        batch = next(collector_iter)
        buffer.extend(batch.reshape(-1))
        sample = buffer.sample()
        sample.set("td_error", sample["observation"].abs().sum(-1))
        buffer.update_tensordict_priority(sample)
        out.append(fingerprint(batch["observation"], batch["action"], sample["index"], sample["observation"]))
    return out


def save_and_continue(path: str, scratch: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    np.random.seed(10 + rank)
    random.seed(10 + rank)
    policy, collector, buffer, ckpt = _build(scratch, "a")
    it = iter(collector)
    _steps(it, buffer, 4)  # 64 frames into a 40-slot buffer: wrapped around
    ckpt.save(path)
    return {"next": _steps(it, buffer, 3), "len": len(buffer)}


def load_and_continue(path: str, scratch: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(99)
    policy, collector, buffer, ckpt = _build(scratch, "b")
    ckpt.load(path)
    filename = buffer._storage._storage["observation"].filename if rank % 2 else None
    return {"next": _steps(iter(collector), buffer, 3), "len": len(buffer), "memmap": filename}
