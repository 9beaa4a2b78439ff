"""Trainer-registered names: placements by name and component, hooks and loggers that reshard (single process)."""

from __future__ import annotations

from pathlib import Path

import torch
from torchrl.record.loggers import CSVLogger
from torchrl.trainers.trainers import CountFramesLog, LRSchedulerHook, RewardNormalizer

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import AdapterContext, resolve_adapter
from torchrl_dcp.adapters.trainer import TrainerHookAdapter, trainer_placement


def _scheduler_hook() -> LRSchedulerHook:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return LRSchedulerHook(torch.optim.lr_scheduler.StepLR(opt, step_size=2))


def test_placements_follow_what_the_hook_holds(tmp_path: Path) -> None:
    assert trainer_placement("policy") is None and trainer_placement("trainer_state") is None
    assert trainer_placement("trainer_module.lr_scheduler", _scheduler_hook()) == "replicated"
    assert trainer_placement("trainer_module.count_frames_log", CountFramesLog(frame_skip=1)) == "per_rank"
    assert trainer_placement("trainer_module.reward_normalizer", RewardNormalizer()) == "per_rank"
    assert trainer_placement("logger", CSVLogger("x", log_dir=str(tmp_path))) == "per_rank"
    assert trainer_placement("trainer_module.anything") == "per_rank"  # by name alone: per rank (always safe)


def test_hooks_and_loggers_resolve_to_a_resharding_adapter(tmp_path: Path) -> None:
    for obj in (CountFramesLog(frame_skip=1), _scheduler_hook(), CSVLogger("x", log_dir=str(tmp_path))):
        adapter = resolve_adapter(obj)
        assert isinstance(adapter, TrainerHookAdapter) and adapter.can_reshard
        assert adapter.adapter_id == "torchrl_dcp.state_dict"  # payload unchanged: older checkpoints load


def test_reshard_takes_rank_modulo_saved_world() -> None:
    adapter = TrainerHookAdapter()
    ctx = AdapterContext("trainer_module.count_frames_log", rank=2, world_size=3, saved_world_size=2)
    assert adapter.reshard_sources({0: {}, 1: {}}, ctx) == [0]
    hook = CountFramesLog(frame_skip=1)
    adapter.reshard(hook, {0: {"frame_count": 64}}, ctx)
    assert hook.frame_count == 64


def test_hook_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    hook = CountFramesLog(frame_skip=1)
    hook.frame_count = 96
    path = tdcp.DistributedCheckpoint().register("trainer_module.count_frames_log", hook).save(tmp_path / "c")
    fresh = CountFramesLog(frame_skip=1)
    tdcp.DistributedCheckpoint().register("trainer_module.count_frames_log", fresh).load(path)
    assert fresh.frame_count == 96
