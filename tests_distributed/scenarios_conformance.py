"""Per-rank programs for the distributed conformance slice: buffers + collector + optimizer on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
from tests.test_conformance_buffers import build, exercise, extend
from tests.test_conformance_collectors import make_collector
from torchrl_dcp.examples.sac import fingerprint


def _objects(path: str, storage: str, sampler: str, tag: str) -> tuple[Any, ...]:
    rank = dist.get_rank()
    scratch = Path(path).parent / f"scratch-{rank}"
    rb = build(storage, 1, sampler, "round_robin", False, scratch, tag)
    policy, collector = make_collector("single", "rewardsum_stepcounter", 100 + rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():  # the same policy weights on every rank (replicated), each rank its own env seed
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ckpt = tdcp.DistributedCheckpoint(policy=policy, model=model, optimizer=optimizer)  # replicated
    ckpt.register("buffer", rb)
    ckpt.register("collector", collector)
    ckpt.register("rng", tdcp.RNGState())
    return rb, collector, model, optimizer, ckpt


def _continue(rb: Any, it: Any, model: Any, optimizer: Any, sampler: str) -> list[str]:
    out = []
    for i in range(3):
        batch = next(it)
        samples = exercise(rb, 1, 3000 + 10 * i, 1, sampler.startswith("prioritized"))
        optimizer.zero_grad()
        model(samples[0]["obs"]).pow(2).mean().backward()
        for p in model.parameters():  # one replicated learner: average the ranks' gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        out.append(fingerprint(batch["observation"], samples[0]["obs"], *model.parameters()))
    return out


def save_and_continue(path: str, storage: str, sampler: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    rb, collector, model, optimizer, ckpt = _objects(path, storage, sampler, "a")
    extend(rb, 20 + 3 * rank, 100 * rank, 1)
    it = iter(collector)
    _continue(rb, it, model, optimizer, sampler)
    ckpt.save(path)
    saved_len = len(rb)
    out = {"next": _continue(rb, it, model, optimizer, sampler), "len": len(rb), "saved_len": saved_len}
    collector.shutdown()
    return out


def load_and_continue(path: str, storage: str, sampler: str, reshard: bool) -> dict[str, Any]:
    torch.manual_seed(99)
    rb, collector, model, optimizer, ckpt = _objects(path, storage, sampler, "b")
    ckpt.load(path, **({"world_size_change": "reshard"} if reshard else {}))
    out: dict[str, Any] = {"len": len(rb)}
    if not reshard:
        out["next"] = _continue(rb, iter(collector), model, optimizer, sampler)
    out["weights"] = fingerprint(*model.parameters())
    collector.shutdown()
    return out
