"""Per-rank programs: an FSDP2 (``fully_shard``) model and its optimizer saved, loaded into fresh ones, continued."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchrl_dcp as tdcp
from torchrl_dcp.examples.sac import fingerprint

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


def _build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, tdcp.DistributedCheckpoint]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # identical initial weights on every rank (fully_shard keeps each rank's shard)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    )
    fully_shard(model, mesh=mesh)
    optimizer = OPTIMIZERS[kind](model.parameters())
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("model", model, placement="sharded")
    ckpt.register("optimizer", optimizer, placement="sharded")
    return model, optimizer, ckpt


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, n: int) -> list[str]:
    out = []
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        x = torch.randn(8, 3, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        out.append(fingerprint(*(p.full_tensor() for p in model.parameters())))
    return out


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    tensors = [p.full_tensor() for p in model.parameters()]
    for s in optimizer.state.values():
        tensors += [v.full_tensor() if hasattr(v, "full_tensor") else v for _, v in sorted(s.items())]
    return fingerprint(*tensors)


def save_and_continue(path: str, kind: str, steps: int) -> dict[str, Any]:
    model, optimizer, ckpt = _build(kind)
    _train(model, optimizer, 0, steps)
    ckpt.save(path, step=steps)
    state = _full_state(model, optimizer)
    return {"state": state, "next": _train(model, optimizer, steps, 3)}


def load_and_continue(path: str, kind: str, steps: int) -> dict[str, Any]:
    model, optimizer, ckpt = _build(kind)  # freshly built: the optimizer never stepped
    result = ckpt.load(path)
    state = _full_state(model, optimizer)
    return {"loaded": sorted(result.loaded), "state": state, "next": _train(model, optimizer, steps, 3)}


def default_placement_error(path: str) -> str:
    """An FSDP2 model registered with the default (replicated) placement: the save's error message."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    fully_shard(model, mesh=mesh)
    try:
        tdcp.DistributedCheckpoint(model=model).save(path)
    except tdcp.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "saved"
