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


def test_the_offline_to_online_hook_keeps_its_offline_keys_so_a_resume_draws_nothing_more(tmp_path: Path) -> None:
    """``OfflineToOnlineReplayBufferHook`` finds the offline dataset's keys lazily, with ``offline.sample(1)`` (a
    draw from the global RNG); its ``state_dict`` leaves them out, so a resumed trainer drew again and its RNG
    stream (and every later batch) differed. The adapter saves the keys: after a restore, ``extend`` draws
    nothing, as in the uninterrupted run."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, OfflineToOnlineReplayBuffer, ReplayBuffer
    from torchrl.trainers.algorithms.offline_to_online import OfflineToOnlineReplayBufferHook

    def make() -> OfflineToOnlineReplayBufferHook:
        offline = ReplayBuffer(storage=LazyTensorStorage(8))
        offline.extend(TensorDict({"obs": torch.arange(8.0).unsqueeze(-1), "reward": torch.ones(8, 1)}, [8]))
        buffer = OfflineToOnlineReplayBuffer(offline, online_capacity=16, batch_size=4)
        return OfflineToOnlineReplayBufferHook(buffer)

    def batch() -> TensorDict:
        return TensorDict({"obs": torch.ones(2, 1), "reward": torch.zeros(2, 1), "loc": torch.zeros(2, 1)}, [2])

    hook = make()
    hook.extend(batch())  # computes the offline keys (one draw)
    path = tdcp.DistributedCheckpoint(**{"trainer_module.replay_buffer": hook}).save(tmp_path / "c")
    fresh = make()
    tdcp.DistributedCheckpoint(**{"trainer_module.replay_buffer": fresh}).load(path)
    assert fresh._offline_keys == hook._offline_keys
    before = torch.get_rng_state()
    fresh.extend(batch())
    assert torch.equal(torch.get_rng_state(), before), "extend drew from the RNG after a restore"
    assert len(fresh.replay_buffer.online_buffer) == 4


def test_a_resharded_hook_keeps_its_own_env_generators() -> None:
    """After a world-size change a hook takes saved rank ``r % W``'s state but, as a collector, not the generators
    of the env it runs: two new ranks taking one saved rank's drew the same validation streams."""
    from torchrl.envs import PendulumEnv
    from torchrl.trainers.trainers import LogValidationReward

    env = PendulumEnv()
    env.set_seed(0)
    hook = LogValidationReward(record_interval=1, record_frames=4, policy_exploration=None, environment=env)
    adapter = TrainerHookAdapter()
    ctx = AdapterContext("trainer_module.recorder", rank=2, world_size=3, saved_world_size=2, source_rank=0)
    state = adapter.state(hook, ctx)
    drawn = torch.rand(3, generator=env.rng).tolist()  # the env's stream moves on
    moved = env.rng.get_state().clone()
    adapter.reshard(hook, {0: state}, ctx)
    assert torch.equal(env.rng.get_state(), moved)  # not put back to the saved rank's stream
    adapter.restore(hook, state, AdapterContext("trainer_module.recorder"))  # the same world size: put back
    assert torch.rand(3, generator=env.rng).tolist() == drawn


def test_a_buffer_generator_s_position_is_read_and_rebuilt_as_torchrl_would_go_on() -> None:
    """``iter(replay_buffer)`` not started, paused after a batch, finished: read from torchrl's generator and from the
    ones rebuilt at a load, and each rebuilt one draws as torchrl's would from there."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
    from torchrl.trainers.trainers import ReplayBufferTrainer

    from torchrl_dcp.adapters.trainer_rank_state import iterator_at, iterator_position

    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement(), batch_size=4)
    rb.extend(TensorDict({"x": torch.arange(8.0)}, [8]))
    hook = ReplayBufferTrainer(rb, batch_size=None, iterate=True)
    assert iterator_position(hook) == "fresh"
    next(hook.replay_buffer_iter)
    next(hook.replay_buffer_iter)  # (the epoch's last batch: the sampler ran out, the generator paused)
    assert iterator_position(hook) == "paused" and rb._sampler.ran_out
    for position, draws in (("paused", 0), ("fresh", 2), ("done", 0)):
        hook.replay_buffer_iter = iterator_at(rb, position)
        assert iterator_position(hook) == position
        rb._sampler.ran_out = True  # (as after the epoch's last batch)
        assert len(list(hook.replay_buffer_iter)) == draws
        assert iterator_position(hook) == "done"
    hook.replay_buffer_iter = (x for x in ())
    assert iterator_position(hook) is None  # (a generator of another kind: not saved, left as it is)
