"""Conformance matrix: optimizers (Adam, AdamW, SGD with momentum) × fresh / stepped, with an LR scheduler.

Each case saves model + optimizer + scheduler, keeps training, loads into freshly built ones (never stepped) and
checks the next steps are bit for bit those of the run that never stopped. FSDP2 runs in tests_distributed/test_fsdp.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}
CASES = list(itertools.product(OPTIMIZERS, ["fresh", "stepped"]))


def build(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = OPTIMIZERS[kind](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer, scheduler=scheduler)
    return model, optimizer, scheduler, ckpt


def train(model, optimizer, scheduler, start: int, n: int) -> list[torch.Tensor]:
    out = []
    for step in range(start, start + n):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


@pytest.mark.parametrize("kind, state", CASES, ids=["-".join(c) for c in CASES])
def test_optimizer_conformance(tmp_path: Path, kind: str, state: str) -> None:
    model, optimizer, scheduler, ckpt = build(kind)
    steps = 3 if state == "stepped" else 0
    train(model, optimizer, scheduler, 0, steps)
    path = ckpt.save(tmp_path / "ckpt")
    expected = train(model, optimizer, scheduler, steps, 4)

    model2, optimizer2, scheduler2, ckpt2 = build(kind)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # the fresh model differs until loaded
    ckpt2.load(path)
    assert len(optimizer2.state) == len(optimizer.state) if state == "stepped" else not optimizer2.state
    got = train(model2, optimizer2, scheduler2, steps, 4)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {steps + i} differs after the restore"
