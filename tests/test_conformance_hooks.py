"""Conformance matrix of torchrl's Trainer hooks, generated from ``torchrl.trainers``.

Every ``TrainerHookBase`` subclass torchrl ships is a case. A hook with a recipe is registered on a real
``SACTrainer`` (``tests_distributed/trainer_zoo.py``, one process), trained for two batches and saved by the
Trainer's scheduled save, then a second Trainer with a fresh hook resumes (``tdcp.resume``): the
state audit (:mod:`torchrl_dcp.audit`) of the restored hook must equal the saved one's. Hooks the trainers register
themselves are covered by ``tests_distributed/test_trainer_conformance.py``; the others say why they have no recipe.
A hook class torchrl adds is a failing case until it gets a recipe or a reason.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests_distributed.trainer_zoo import build_trainer
from torchrl_dcp.audit import state_differences, state_snapshot
from torchrl_dcp.examples.sac import make_env


def hook_classes() -> dict[str, type]:
    """Every ``TrainerHookBase`` subclass defined in ``torchrl.trainers`` and its submodules, by name."""
    import torchrl.trainers as package
    from torchrl.trainers.trainers import TrainerHookBase

    modules = []
    for info in pkgutil.walk_packages(package.__path__, "torchrl.trainers."):
        if ".configs" in info.name:  # Hydra config dataclasses
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError as err:  # torchrl's Hydra helpers: optional, and they define no hooks
            assert "hydra" in str(err).lower() and ".helpers" in info.name, (info.name, err)
    found = {}
    for module in modules:
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, TrainerHookBase) and obj.__module__ == module.__name__:
                found[name] = obj
    found.pop("TrainerHookBase", None)
    return dict(sorted(found.items()))


def _hooks() -> Any:
    from torchrl.trainers import trainers

    return trainers


RECIPES: dict[str, Callable[[Any], Any]] = {
    "BatchSubSampler": lambda t: _hooks().BatchSubSampler(batch_size=8),
    "ClearCudaCache": lambda t: _hooks().ClearCudaCache(1),
    "CountFramesLog": lambda t: _hooks().CountFramesLog(frame_skip=1),
    "DefaultOptimizationStepper": lambda t: _hooks().DefaultOptimizationStepper(),
    "LRSchedulerHook": lambda t: _hooks().LRSchedulerHook(torch.optim.lr_scheduler.StepLR(t.optimizer, 2, 0.5)),
    "LogScalar": lambda t: _hooks().LogScalar(key=("next", "reward")),
    "LogValidationReward": lambda t: _hooks().LogValidationReward(
        record_interval=1, record_frames=8, policy_exploration=t.collector.policy, environment=make_env(7, "cpu")
    ),
    "MixedPrecisionOptimizationStepper": lambda t: _hooks().MixedPrecisionOptimizationStepper(t.optimizer),
    "RewardNormalizer": lambda t: _hooks().RewardNormalizer(decay=0.9),
    "UTDRHook": lambda t: _hooks().UTDRHook(t),
    "UpdateWeights": lambda t: _hooks().UpdateWeights(t.collector, 1),
}
BY_TRAINERS = "registered by torchrl's trainers themselves: covered by tests_distributed/test_trainer_conformance.py"
NO_RECIPE = {
    "OptimizerHook": BY_TRAINERS,
    "TargetNetUpdaterHook": BY_TRAINERS,
    "ValueEstimatorHook": BY_TRAINERS,
    "ReplayBufferTrainer": BY_TRAINERS,
    "OfflineToOnlineReplayBufferHook": BY_TRAINERS,
    "OfflineToOnlineAnnealHook": BY_TRAINERS,
    "TD3OptimizationStepper": BY_TRAINERS,
    "OptimizationStepper": "a base class",
    "DreamerV3OptimizationStepper": "needs DreamerV3's world model, actor and critic losses",
    "SelectKeys": "keeps the batch keys it is given; nothing else (no state)",
    "EarlyStopping": "reads a metric the Trainer logs from validation (it stops training, which this run needs)",
    "LogTiming": "logs wall-clock timings (no training state)",
}


#: what a hook refers to that is not its own state (audited where it belongs)
NOT_AUDITED = (
    "_trainer",  # the Trainer a hook is attached to (tests_distributed/test_trainer_conformance.py audits it)
    "trainer",
    "UpdateWeights.collector",  # the Trainer's collector (tests/test_conformance_collectors.py audits collectors)
    "LogValidationReward.environment",  # lazily built caches differ until it runs; its generators: _env_streams
)


def _trainer(directory: Path, name: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    trainer = build_trainer("SACTrainer", 0, directory, total_frames=32, save_every=32)
    hook = RECIPES[name](trainer)
    hook.register(trainer, name="probe") if "name" in inspect.signature(hook.register).parameters else hook.register(
        trainer
    )
    return trainer, hook


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchrl's deprecations and prototype notices
        yield


def test_every_hook_class_has_a_recipe_or_a_reason() -> None:
    found = set(hook_classes())
    assert {"CountFramesLog", "LRSchedulerHook", "UpdateWeights"} <= found
    assert not set(RECIPES) & set(NO_RECIPE)
    assert found <= set(RECIPES) | set(NO_RECIPE), f"new in torchrl: {found - set(RECIPES) - set(NO_RECIPE)}"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_hook_is_restored_exactly(tmp_path: Path, name: str) -> None:
    trainer, hook = _trainer(tmp_path / "ckpts", name)
    trainer.train()  # two batches (the hook runs where it registered), then the scheduled save at frame 32
    saved = state_snapshot(hook, "hook", skip=NOT_AUDITED)
    streams = _env_streams(hook)
    trainer.checkpoint_rotation.close()
    fresh, fresh_hook = _trainer(tmp_path / "ckpts", name)
    info = tdcp.resume(fresh.checkpoint, tmp_path / "ckpts")
    assert info is not None and info.step == 32
    differences = state_differences(saved, state_snapshot(fresh_hook, "hook", skip=NOT_AUDITED))
    assert not differences, f"{name}: the restored hook differs:\n" + "\n".join(map(str, differences[:20]))
    # the envs a hook runs (a validation env): their generators continue (they started again from the seed: other
    # validation rewards were logged after a resume)
    assert _env_streams(fresh_hook) == streams, name


def _env_streams(hook: Any) -> dict[str, str]:
    from torchrl.envs import EnvBase

    from torchrl_dcp.adapters.env import env_generators

    envs = {k: v for k, v in vars(hook).items() if isinstance(v, EnvBase)}
    return {
        f"{attr}.{path}": state_snapshot(gen.get_state() if hasattr(gen, "get_state") else gen, "g")["g"]
        for attr, env in envs.items()
        for path, gen in env_generators(env).items()
    }
