"""States honest runs produce that the checks of forged ones must not refuse (each was refused by a first version of
those checks: ``adapters/state_kinds.py``, ``adapters/optimizer.py``, the collector's carrier): the load succeeds
and the object continues as one that never stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchrl_dcp as tdcp


class Stats:
    """A user object whose statistics change kind as it runs (a number that becomes a tensor, a NumPy array)."""

    def __init__(self) -> None:
        self.best: Any = float("-inf")
        self.mean: Any = 0.0
        self.window = np.zeros(3)

    def update(self, x: torch.Tensor) -> None:
        self.best = max(self.best, x.max())
        self.mean = 0.9 * self.mean + 0.1 * x.mean()
        self.window = self.window + 0.1

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "mean": self.mean, "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.mean, self.window = state["best"], state["mean"], np.asarray(state["window"])


def _stats(updated: bool) -> dict[str, Any]:
    stats = Stats()
    if updated:
        stats.update(torch.arange(4.0))
    return {"stats": stats}


def _optimizer(kind: str, steps: int, dtype: torch.dtype = torch.float32, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    objs = {"model": model, "optimizer": getattr(torch.optim, kind)(model.parameters(), **options)}
    _train(objs, steps, dtype)
    return objs


def _train(objs: dict[str, Any], steps: int, dtype: torch.dtype = torch.float32) -> None:
    """``steps`` optimizer steps (and scheduler steps, when ``objs`` holds one) on a constant input."""
    for _ in range(steps):
        objs["optimizer"].zero_grad()
        objs["model"](torch.ones(1, 3, dtype=dtype)).sum().backward()
        objs["optimizer"].step()
        if "scheduler" in objs:
            objs["scheduler"].step()


def _warm_up(steps: int) -> dict[str, Any]:
    """A hand-written warm-up that writes a 0-d tensor learning rate (Adam on CPU takes it)."""
    objs = _optimizer("Adam", 0)
    for i in range(steps):
        objs["optimizer"].param_groups[0]["lr"] = 1e-3 * torch.clamp(torch.tensor((i + 1) / 10), max=1.0)
        objs["model"](torch.ones(1, 3)).sum().backward()
        objs["optimizer"].step()
    return objs


def _resumed_twice(kind: str) -> Callable[[int], dict[str, Any]]:
    """NAdam's ``mu_product`` / ASGD's ``eta`` (float32 scalars) are cast by torch's ``load_state_dict`` to a float64
    parameter's dtype: the second resume holds a float64 scalar (it was refused)."""

    def build(steps: int) -> dict[str, Any]:
        objs = _optimizer(kind, steps, torch.float64)
        if steps:
            objs["optimizer"].load_state_dict(objs["optimizer"].state_dict())  # (what a first resume leaves)
        return objs

    return build


CASES: dict[str, tuple[Callable[[int], dict[str, Any]], int]] = {
    "a statistic that became a tensor, a NumPy array": (lambda steps: _stats(steps > 0), 1),
    "NAdam over float64 parameters, resumed twice": (_resumed_twice("NAdam"), 2),
    "ASGD over float64 parameters, resumed twice": (_resumed_twice("ASGD"), 2),
    "a NumPy learning rate": (lambda steps: _optimizer("Adam", steps, lr=np.float32(3e-4)), 2),
    "a NumPy integer learning rate and weight decay": (
        lambda steps: _optimizer("SGD", steps, lr=np.int64(1), weight_decay=np.float32(0.01)),
        2,
    ),
    "a warm-up writing a tensor learning rate": (_warm_up, 3),
}


@pytest.mark.parametrize("name", CASES)
def test_an_honest_state_loads_into_a_fresh_object(tmp_path: Path, name: str) -> None:
    build, steps = CASES[name]
    saved = build(steps)
    path = tdcp.DistributedCheckpoint(**saved).save(tmp_path / "c")
    tdcp.verify(path)
    fresh = build(0)
    tdcp.DistributedCheckpoint(**fresh).load(path)
    for key, obj in saved.items():
        assert not tdcp.state_differences(tdcp.state_snapshot(obj), tdcp.state_snapshot(fresh[key])), key


def test_a_carrier_whose_dtypes_change_after_the_first_step_resumes_exactly(tmp_path: Path) -> None:
    """A float64 policy makes Pendulum's ``th`` float64 after the first step, where a new collector's reset holds
    float32: the saved carrier is taken as saved (it was refused, and before that cast to float32)."""
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    def make() -> Collector:
        env = PendulumEnv()
        env.set_seed(0)
        torch.manual_seed(0)
        policy = TensorDictModule(lambda th: torch.zeros_like(th, dtype=torch.float64), ["th"], ["action"])
        return Collector(env, policy, frames_per_batch=4, total_frames=-1)

    collector = make()
    it = iter(collector)
    next(it)
    path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    expected = next(it)
    collector.shutdown()
    other = make()
    tdcp.DistributedCheckpoint(collector=other).load(path)
    got = next(iter(other))
    other.shutdown()
    for key in expected.keys(True, True):
        assert torch.equal(expected[key], got[key]) and expected[key].dtype == got[key].dtype, key


@pytest.mark.parametrize("kind", ["NAdam", "ASGD"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_optimizer_scalars_torch_keeps_in_float32_resume_as_saved(
    tmp_path: Path, kind: str, dtype: torch.dtype
) -> None:
    """NAdam's ``mu_product`` and ASGD's ``eta``/``mu`` stay float32 whatever the parameters' dtype; torch's
    ``load_state_dict`` cast them to the parameters' (float64: NAdam's weights were 5.9e-12 off 27 steps later)."""

    straight = _optimizer(kind, 30, dtype)
    saved = _optimizer(kind, 3, dtype)
    path = tdcp.DistributedCheckpoint(**saved).save(tmp_path / "c")
    fresh = _optimizer(kind, 0, dtype)
    tdcp.DistributedCheckpoint(**fresh).load(path)
    dtypes = {k: v.dtype for k, v in next(iter(saved["optimizer"].state.values())).items()}
    assert {k: v.dtype for k, v in next(iter(fresh["optimizer"].state.values())).items()} == dtypes
    _train(fresh, 27, dtype)
    for a, b in zip(straight["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)


def test_a_counter_comes_back_a_counter(tmp_path: Path) -> None:
    """``MultiStepLR``'s milestones are a ``Counter``; they came back a dict, and a resumed ``SequentialLR`` crashed at
    its milestone (``step(0)`` calls ``milestones.elements()``)."""

    def build() -> dict[str, Any]:
        objs = _optimizer("SGD", 0, lr=1.0)
        first = torch.optim.lr_scheduler.LinearLR(objs["optimizer"], start_factor=0.5, total_iters=4)
        second = torch.optim.lr_scheduler.MultiStepLR(objs["optimizer"], milestones=[2, 5], gamma=0.5)
        objs["scheduler"] = torch.optim.lr_scheduler.SequentialLR(objs["optimizer"], [first, second], milestones=[4])
        return objs

    def step(objs: dict[str, Any], n: int) -> None:
        for _ in range(n):
            objs["optimizer"].step()
            objs["scheduler"].step()

    straight, saved = build(), build()
    step(straight, 8)
    step(saved, 2)
    path = tdcp.DistributedCheckpoint(**saved).save(tmp_path / "c")
    fresh = build()
    tdcp.DistributedCheckpoint(**fresh).load(path)
    assert type(fresh["scheduler"]._schedulers[1].milestones) is type(saved["scheduler"]._schedulers[1].milestones)
    step(fresh, 6)
    assert fresh["optimizer"].param_groups[0]["lr"] == straight["optimizer"].param_groups[0]["lr"]


def test_a_learning_rate_tensor_the_param_groups_share_resumes_shared(tmp_path: Path) -> None:
    """torch gives every param group the constructor's ``lr`` tensor (one object): every save was refused ("holds
    one tensor twice"). Groups may share a hyperparameter tensor (restored shared: a scheduler's ``fill_`` moves
    them all), never a state tensor."""

    def build() -> dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        optimizer = torch.optim.Adam(
            [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=torch.tensor(0.01)
        )
        return {"model": model, "optimizer": optimizer, "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}

    straight, saved = build(), build()
    _train(straight, 7)
    _train(saved, 3)
    path = tdcp.DistributedCheckpoint(**saved).save(tmp_path / "c")
    fresh = build()
    tdcp.DistributedCheckpoint(**fresh).load(path)
    groups = fresh["optimizer"].param_groups
    assert groups[0]["lr"] is groups[1]["lr"]
    _train(fresh, 4)
    for a, b in zip(straight["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)


def test_an_enabled_grad_scaler_into_a_disabled_one_says_it_is_disabled(tmp_path: Path) -> None:
    """Torch's own load into a disabled scaler drops the state without a word; the refusal says why, not 'forged'."""
    path = tdcp.DistributedCheckpoint(scaler=torch.amp.GradScaler("cpu", enabled=True)).save(tmp_path / "s")
    with pytest.raises(tdcp.IncompatibleComponentError, match="GradScaler is disabled .* build it enabled") as err:
        tdcp.DistributedCheckpoint(scaler=torch.amp.GradScaler("cpu", enabled=False)).load(path)
    assert "forged" not in str(err.value)
    live = torch.amp.GradScaler("cpu", enabled=True, init_scale=2.0)
    tdcp.DistributedCheckpoint(scaler=live).load(path)
    assert live.get_scale() == torch.amp.GradScaler("cpu").get_scale()
