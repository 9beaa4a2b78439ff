"""Collectors: the next batches after a restore equal those of a collector that never stopped."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs import (
    CatTensors,
    Compose,
    InitTracker,
    ObservationNorm,
    PendulumEnv,
    RewardSum,
    StepCounter,
    TransformedEnv,
    UnsqueezeTransform,
    VecNormV2,
)

import torchrl_dcp as tdcp


def make_env(norm: str | None = None, seed: int = 0) -> TransformedEnv:
    transforms = [
        UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
        CatTensors(["th", "thdot"], "observation", del_keys=False),
        StepCounter(max_steps=15),
        RewardSum(),
    ]
    if norm == "vecnorm":
        transforms.append(VecNormV2(in_keys=["observation"], decay=0.9))
    elif norm == "obsnorm":
        transforms.append(ObservationNorm(loc=torch.zeros(2), scale=torch.ones(2), in_keys=["observation"]))
    env = TransformedEnv(PendulumEnv(), Compose(*transforms))
    env.set_seed(seed)
    return env


def make_policy(seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])


def make_collector(norm, seed):
    policy = make_policy(seed)
    collector = Collector(
        make_env(norm, seed), policy, frames_per_batch=10, total_frames=-1, auto_register_policy_transforms=False
    )
    return policy, collector


def assert_same_batches(expected: list, got: list) -> None:
    """Every entry of every expected batch equals the other run's, bit for bit."""
    for a, b in zip(expected, got):
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), key


def checkpoint(policy, collector) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("collector", collector)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


@pytest.mark.parametrize("norm", [None, "vecnorm", "obsnorm"])
def test_next_batches_are_identical_after_restore(tmp_path: Path, norm) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    policy, collector = make_collector(norm, 0)
    it = iter(collector)
    for _ in range(4):  # crosses an episode boundary (max_steps=15): the carrier is mid-episode
        next(it)
    with torch.no_grad():
        policy.module.weight.add_(0.5)  # learner update after the collector was built
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    expected = [next(it) for _ in range(4)]
    expected_env_state = collector.env.transform.state_dict()
    collector.shutdown()

    policy2, collector2 = make_collector(norm, 123)  # other weights, other env seed
    checkpoint(policy2, collector2).load(path)
    it2 = iter(collector2)
    got = [next(it2) for _ in range(4)]
    got_env_state = collector2.env.transform.state_dict()
    collector2.shutdown()
    for a, b in zip(expected, got):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), key
    assert_same(expected_env_state, got_env_state)


def test_collector_policy_weights_are_stored_once(tmp_path: Path) -> None:
    policy, collector = make_collector(None, 0)
    next(iter(collector))
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    manifest = tdcp.read_manifest(path)
    text = str(manifest["components"]["collector"]["ranks"]["0"]["state"])
    assert "'xref'" in text and "'policy'" in text  # references the policy component's tensors
    collector.shutdown()


def test_multi_sync_collector_restores_what_is_reachable(tmp_path: Path) -> None:
    def make(seed):
        policy = make_policy(seed)
        return policy, MultiSyncCollector(
            [lambda: make_env("vecnorm", 0)],
            policy,
            frames_per_batch=10,
            total_frames=-1,
            auto_register_policy_transforms=False,
        )

    policy, collector = make(0)
    it = iter(collector)
    next(it)
    next(it)
    sd = collector.state_dict()
    with pytest.warns(tdcp.InexactResumeWarning, match=r"'collector' \(saving\): MultiSyncCollector keeps"):
        path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    collector.shutdown()
    policy2, collector2 = make(5)
    with pytest.warns(tdcp.InexactResumeWarning, match=r"'collector' \(loading\)"):
        checkpoint(policy2, collector2).load(path)
    sd2 = collector2.state_dict()
    collector2.shutdown()
    assert sd2["worker0"]["frames"] == sd["worker0"]["frames"] and sd2["worker0"]["iter"] == sd["worker0"]["iter"]
    for k, v in sd["worker0"]["policy_state_dict"].items():
        assert torch.equal(v, sd2["worker0"]["policy_state_dict"][k])
    assert_same(sd["worker0"]["env_state_dict"], sd2["worker0"]["env_state_dict"])
    assert sd["worker0"]["env_state_dict"], "VecNormV2 statistics are part of the worker's state"


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("policy", ["none", "random"])
def test_a_collector_whose_policy_holds_no_state_resumes_exactly(tmp_path: Path, policy: str) -> None:
    """``Collector(env, None)`` (a random policy drawing from the action spec) and an explicit ``RandomPolicy``:
    torchrl's strict ``load_state_dict`` demanded a policy state that its ``state_dict`` never writes, so these
    saved but could never load; now the next batches after a restore equal those of a run that never stopped."""
    from torchrl.envs.utils import RandomPolicy

    def build(seed: int) -> Collector:
        env = make_env("vecnorm", seed)
        actor = None if policy == "none" else RandomPolicy(env.action_spec)
        return Collector(env, actor, frames_per_batch=10, total_frames=-1)

    torch.manual_seed(0)
    collector = build(0)
    it = iter(collector)
    for _ in range(3):
        next(it)
    ckpt = tdcp.DistributedCheckpoint(collector=collector, rng=tdcp.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    expected = [next(it) for _ in range(3)]
    collector.shutdown()
    torch.manual_seed(7)
    fresh = build(5)
    tdcp.DistributedCheckpoint(collector=fresh, rng=tdcp.RNGState()).load(path)
    it2 = iter(fresh)
    got = [next(it2) for _ in range(3)]
    fresh.shutdown()
    for a, b in zip(expected, got):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), key


def test_a_traj_counter_inside_a_compose_continues_its_ids_after_a_restore(tmp_path: Path) -> None:
    """``Compose.state_dict()`` drops ``TrajCounter``'s own ``state_dict`` (its count is a shared counter, not a
    buffer: a torchrl 0.14 gap), so trajectory ids restarted; the adapter saves it: the next batches, trajectory ids
    included, equal those of a run that never stopped."""
    from torchrl.envs import TrajCounter

    def build(seed: int) -> tuple[TensorDictModule, Collector]:
        env = make_env(None, seed)
        env.append_transform(TrajCounter())
        policy = make_policy(seed)
        return policy, Collector(
            env, policy, frames_per_batch=10, total_frames=-1, auto_register_policy_transforms=False
        )

    policy, collector = build(0)
    it = iter(collector)
    for _ in range(4):  # 40 steps of 15-step episodes: the third trajectory is in flight
        next(it)
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    expected = [next(it) for _ in range(4)]
    collector.shutdown()
    assert int(expected[-1]["next", "traj_count"].max()) >= 4
    policy2, collector2 = build(3)
    checkpoint(policy2, collector2).load(path)
    it2 = iter(collector2)
    got = [next(it2) for _ in range(4)]
    collector2.shutdown()
    assert_same_batches(expected, got)


@pytest.mark.parametrize("wrapped", [False, True], ids=["serial", "transformed-serial"])
def test_traj_counters_inside_a_serial_envs_sub_envs_continue_their_ids(tmp_path: Path, wrapped: bool) -> None:
    """The same torchrl gap inside each sub-env of a ``SerialEnv`` (whose ``state_dict`` is its sub-envs'): the
    counts were lost there, silently; the next batches, trajectory counts included, equal an uninterrupted run's."""
    from torchrl.collectors import Collector
    from torchrl.envs import Compose, PendulumEnv, SerialEnv, StepCounter, TrajCounter

    def build(seed: int) -> Collector:
        torch.manual_seed(seed)
        env = SerialEnv(2, lambda: TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=4), TrajCounter())))
        if wrapped:
            env = TransformedEnv(env, RewardSum())
        env.set_seed(seed)
        return Collector(env, None, frames_per_batch=8, total_frames=-1)

    collector = build(0)
    it = iter(collector)
    for _ in range(3):
        next(it)
    ckpt = tdcp.DistributedCheckpoint(collector=collector, rng=tdcp.RNGState())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        path = ckpt.save(tmp_path / "ckpt")
    expected = [next(it) for _ in range(2)]
    collector.shutdown()
    assert int(expected[-1]["next", "traj_count"].max()) >= 4
    collector2 = build(1)
    next(iter(collector2))  # its counters moved on: the load must put them back
    tdcp.DistributedCheckpoint(collector=collector2, rng=tdcp.RNGState()).load(path)
    it2 = iter(collector2)
    got = [next(it2) for _ in range(2)]
    collector2.shutdown()
    assert_same_batches(expected, got)


def test_a_shut_down_collector_is_refused_saying_why(tmp_path: Path) -> None:
    """``Trainer.train()`` shuts its collector down when it ends: a save after that said only "no attribute env"."""
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    collector = Collector(PendulumEnv(), None, frames_per_batch=4, total_frames=-1)
    next(iter(collector))
    collector.shutdown()
    with pytest.raises(tdcp.CheckpointError, match=r"the collector was shut down .*save before the shutdown"):
        tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_collector_load_refused_while_restoring_leaves_its_carrier_as_it_was(tmp_path: Path) -> None:
    """A collector over an env built otherwise (nested ``TransformedEnv``s, no ``StepCounter``) is refused while
    restoring (no generator at the saved path) after the carrier was updated: the rollback must also remove the
    carrier entries the update added (``step_count``, ``truncated``); the state audit finds no difference."""
    from torchrl._utils import set_auto_unwrap_transformed_env
    from torchrl.envs import PendulumEnv

    env = TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=10)))
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=8, total_frames=-1)
    next(iter(collector))
    path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "ckpt")
    with set_auto_unwrap_transformed_env(False):
        other = TransformedEnv(TransformedEnv(PendulumEnv(), RewardSum()), Compose())
    other.set_seed(1)
    live = Collector(other, None, frames_per_batch=8, total_frames=-1)
    next(iter(live))
    before = tdcp.state_snapshot(live, "collector")
    keys = set(live._carrier.keys(True, True))
    with pytest.raises(tdcp.IncompatibleComponentError):
        tdcp.DistributedCheckpoint(collector=live).load(path)
    assert set(live._carrier.keys(True, True)) == keys
    assert not tdcp.state_differences(before, tdcp.state_snapshot(live, "collector"))


def _trajectory_collector(seed: int, **kwargs):
    env = make_env(None, seed)
    env.append_transform(StepCounter(max_steps=7))  # episodes of 7 steps, polled by 5 frames: steps are held back
    policy = make_policy(seed)
    kwargs.setdefault("trajs_per_batch", 2)
    collector = Collector(
        env, policy, frames_per_batch=5, total_frames=-1, auto_register_policy_transforms=False, **kwargs
    )
    return policy, collector


@pytest.mark.parametrize("traj_format", ["padded", "cat"])
@pytest.mark.parametrize("into", ["fresh", "running", "running, then a new iterator"])
def test_a_collector_assembling_trajectories_resumes_with_the_steps_it_held(tmp_path: Path, traj_format, into) -> None:
    """``trajs_per_batch``: the steps of in-flight episodes (and complete ones not yet yielded) are state; a fresh
    collector gets them before its first batch, a running one has its generator's held steps replaced, and a new
    iterator of it (a loop started again after the load) takes them on (they were lost: a new generator starts
    with empty containers)."""
    policy, collector = _trajectory_collector(0, traj_format=traj_format)
    it = iter(collector)
    next(it)
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    assert collector._traj_assembly[0], "the test needs steps held back"
    expected = [next(it) for _ in range(3)]
    if into.startswith("running"):  # the same collector, three batches later: its generator's held steps replaced
        checkpoint(policy, collector).load(path)
        if into != "running":
            it = iter(collector)
        got = [next(it) for _ in range(3)]
    else:
        policy2, collector2 = _trajectory_collector(123, traj_format=traj_format)
        checkpoint(policy2, collector2).load(path)
        it2 = iter(collector2)
        got = [next(it2) for _ in range(3)]
        collector2.shutdown()
    collector.shutdown()
    for a, b in zip(expected, got):
        assert a.batch_size == b.batch_size
        assert set(a.keys(True, True)) == set(b.keys(True, True))
    assert_same_batches(expected, got)


def test_a_collector_writing_trajectories_into_a_buffer_resumes_with_the_steps_it_held(tmp_path: Path) -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    def build(seed):
        rb = ReplayBuffer(storage=LazyTensorStorage(200))
        policy, collector = _trajectory_collector(seed, replay_buffer=rb, trajs_per_write=1)
        ckpt = checkpoint(policy, collector)
        ckpt.register("rb", rb)
        return rb, collector, ckpt

    rb, collector, ckpt = build(0)
    it = iter(collector)
    for _ in range(2):
        next(it)
    path = ckpt.save(tmp_path / "ckpt")
    assert collector._traj_assembly[0]
    for _ in range(3):
        next(it)
    rb2, collector2, ckpt2 = build(5)
    ckpt2.load(path)
    it2 = iter(collector2)
    for _ in range(3):
        next(it2)
    collector.shutdown()
    collector2.shutdown()
    assert len(rb) == len(rb2)
    expected, got = rb[: len(rb)], rb2[: len(rb2)]
    for key in expected.keys(True, True):
        assert torch.equal(expected[key], got[key]), key


def test_held_trajectory_steps_are_refused_by_a_collector_that_assembles_none(tmp_path: Path) -> None:
    policy, collector = _trajectory_collector(0, traj_format="cat")
    it = iter(collector)
    next(it)
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    collector.shutdown()
    policy2, collector2 = _trajectory_collector(1, trajs_per_batch=None)
    with pytest.raises(tdcp.IncompatibleComponentError, match="trajs_per_batch"):
        checkpoint(policy2, collector2).load(path)
    collector2.shutdown()


def test_a_policy_less_collector_built_with_other_transforms_is_refused(tmp_path: Path) -> None:
    """``Collector(env, None)`` loads non-strict (torchrl demands policy state otherwise), which skipped the env's
    keys too: saved VecNormV2 statistics were dropped into an env built with ObservationNorm, without a word."""
    saved = Collector(make_env("vecnorm"), None, frames_per_batch=10, total_frames=-1)
    next(iter(saved))
    path = tdcp.DistributedCheckpoint(collector=saved).save(tmp_path / "c")
    saved.shutdown()
    other = Collector(make_env("obsnorm"), None, frames_per_batch=10, total_frames=-1)
    with pytest.raises(tdcp.IncompatibleComponentError, match="other transform state"):
        tdcp.DistributedCheckpoint(collector=other).load(path)
    other.shutdown()
    same = Collector(make_env("vecnorm", 3), None, frames_per_batch=10, total_frames=-1)
    assert tdcp.DistributedCheckpoint(collector=same).load(path).loaded == {"collector"}
    same.shutdown()


class _Refusing:
    """Restored after the components registered before it: refuses its state."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("refused on purpose")


def _reward_vecnorm_env(seed: int) -> TransformedEnv:
    from torchrl.envs import VecNorm

    env = TransformedEnv(
        PendulumEnv(),
        Compose(
            UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
            CatTensors(["th", "thdot"], "observation", del_keys=False),
            StepCounter(max_steps=7),
            VecNorm(in_keys=["observation", "reward"], decay=0.99),
        ),
    )
    env.set_seed(seed)
    return env


def _serial_vecnorm_collector(in_keys: list[str]) -> Collector:
    from torchrl.envs import InitTracker, SerialEnv, VecNorm

    env = SerialEnv(2, lambda: TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=5), RewardSum())))
    env = TransformedEnv(env, Compose(InitTracker(), VecNorm(in_keys=in_keys, decay=0.9)))
    env.set_seed(1)
    return Collector(env, None, frames_per_batch=6, total_frames=-1)


@pytest.mark.parametrize("live_keys", [["reward"], ["observation", "reward"]])
def test_vecnorm_statistics_of_other_keys_are_refused_and_the_collector_is_unchanged(
    tmp_path: Path, live_keys: list[str]
) -> None:
    """A collector whose ``VecNorm`` normalizes other keys than the saved one's (``["thdot"]``, then
    ``["reward"]``): the load took the saved statistics as they were, said nothing, and the next batch failed inside
    torchrl ("Cannot modify locked TensorDict"). Refused while restoring, rolled back: the collector collects on."""
    warnings.simplefilter("ignore")
    saved = _serial_vecnorm_collector(["thdot"])
    it = iter(saved)
    next(it), next(it)
    path = tdcp.DistributedCheckpoint(collector=saved, no_dist=True).save(tmp_path / "c")
    saved.shutdown()
    live = _serial_vecnorm_collector(live_keys)
    it = iter(live)
    next(it)
    stats = live.env.transform[1]._td.clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"VecNorm normalizing .* statistics of \['thdot'\]"):
        tdcp.DistributedCheckpoint(collector=live, no_dist=True).load(path)
    after = live.env.transform[1]._td
    assert set(after.keys()) == set(stats.keys()) and all(torch.equal(after[k], stats[k]) for k in stats.keys())
    next(it)  # collects on
    live.shutdown()
    same = _serial_vecnorm_collector(["thdot"])  # the saved keys: loaded
    tdcp.DistributedCheckpoint(collector=same, no_dist=True).load(path)
    next(iter(same))
    same.shutdown()


@pytest.mark.parametrize("with_policy", [True, False])
def test_vecnorm_statistics_built_at_the_first_step_are_restored_into_a_fresh_collector(
    tmp_path: Path, with_policy: bool
) -> None:
    """``VecNorm`` builds its reward statistics at the first step (the observation's at reset), and its
    ``set_extra_state`` fills only the keys it holds: a fresh collector (reset, not stepped) silently dropped the
    saved reward statistics (with a policy), or refused its own honest checkpoint (``policy=None``). A load
    refused later rolls the statistics back to the keys they had."""
    warnings.simplefilter("ignore")
    saved = Collector(
        _reward_vecnorm_env(0), make_policy(3) if with_policy else None, frames_per_batch=10, total_frames=-1
    )
    it = iter(saved)
    next(it)
    path = tdcp.DistributedCheckpoint(collector=saved, rng=tdcp.RNGState()).save(tmp_path / "c")
    tdcp.DistributedCheckpoint(collector=saved, rng=tdcp.RNGState(), z=_Refusing()).save(tmp_path / "c2")
    stats = saved.env.transform[3]._td.clone()
    expected = [next(it).clone() for _ in range(2)]
    saved.shutdown()
    fresh = Collector(
        _reward_vecnorm_env(1), make_policy(3) if with_policy else None, frames_per_batch=10, total_frames=-1
    )
    before = set(fresh.env.transform[3]._td.keys())
    assert "reward_sum" not in before
    with pytest.raises(tdcp.CheckpointError, match="refused on purpose"):  # restored after the collector, refused
        tdcp.DistributedCheckpoint(collector=fresh, rng=tdcp.RNGState(), z=_Refusing()).load(tmp_path / "c2")
    assert set(fresh.env.transform[3]._td.keys()) == before
    tdcp.DistributedCheckpoint(collector=fresh, rng=tdcp.RNGState()).load(path)
    restored = fresh.env.transform[3]._td
    assert set(restored.keys()) == set(stats.keys()) and all(torch.equal(restored[k], stats[k]) for k in stats.keys())
    it = iter(fresh)
    assert_same_batches(expected, [next(it).clone() for _ in range(2)])
    fresh.shutdown()


def test_a_policy_less_collector_over_sub_envs_with_lazily_built_buffers_loads_its_checkpoint(tmp_path: Path) -> None:
    """``ActionDiscretizer`` registers its buffers when its specs are first computed: a fresh ``SerialEnv``'s
    sub-envs had not, and a policy-less collector refused its own checkpoint."""
    from torchrl.envs import ActionDiscretizer, SerialEnv

    def sub() -> TransformedEnv:
        return TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=7), ActionDiscretizer(5, categorical=False)))

    def make(seed: int) -> SerialEnv:
        env = SerialEnv(2, sub)
        env.set_seed(seed)
        return env

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    saved = Collector(make(0), None, frames_per_batch=10, total_frames=-1)
    it = iter(saved)
    next(it)
    path = tdcp.DistributedCheckpoint(collector=saved, rng=tdcp.RNGState()).save(tmp_path / "c")
    expected = [next(it).clone() for _ in range(2)]
    saved.shutdown()
    fresh = Collector(make(1), None, frames_per_batch=10, total_frames=-1)
    tdcp.DistributedCheckpoint(collector=fresh, rng=tdcp.RNGState()).load(path)
    it = iter(fresh)
    assert_same_batches(expected, [next(it).clone() for _ in range(2)])
    fresh.shutdown()


def test_multi_sync_collector_with_a_stateless_policy_loads_what_it_saved(tmp_path: Path) -> None:
    """``policy=None`` (torchrl's RandomPolicy): the workers hold no policy state, and torchrl's strict worker load
    refused their own state (the worker died, the load raised a bare ``EOFError`` and could not roll back)."""

    def make() -> MultiSyncCollector:
        return MultiSyncCollector(
            [lambda: make_env("vecnorm", 0)], None, frames_per_batch=10, total_frames=-1, env_device="cpu"
        )

    collector = make()
    it = iter(collector)
    next(it)
    next(it)
    sd = collector.state_dict()
    with pytest.warns(tdcp.InexactResumeWarning):
        path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "ckpt")
    collector.shutdown()
    collector2 = make()
    try:
        with pytest.warns(tdcp.InexactResumeWarning) as heard:
            tdcp.DistributedCheckpoint(collector=collector2).load(path)
        # the load's rollback snapshot takes the state too: said once, as a load (it said "(saving)" first)
        assert [str(w.message).split(":")[0] for w in heard] == ["component 'collector' (loading)"]
        assert "a TrajCounter's count, is not" in str(heard[0].message)
        sd2 = collector2.state_dict()
        assert all(p.is_alive() for p in collector2.procs)
        next(iter(collector2))  # the workers go on collecting
    finally:
        collector2.shutdown()
    assert "policy_state_dict" not in sd["worker0"]
    assert (sd2["worker0"]["frames"], sd2["worker0"]["iter"]) == (sd["worker0"]["frames"], sd["worker0"]["iter"])
    assert_same(sd["worker0"]["env_state_dict"], sd2["worker0"]["env_state_dict"])


def test_an_env_with_another_transform_is_refused_while_planning(tmp_path: Path) -> None:
    """A transform without state (a second ``StepCounter``) adds no key to the env's state dict, but its entry to
    every step: the restored carrier lacked it and the next collection failed inside torchrl."""
    policy, collector = make_collector(None, 0)
    next(iter(collector))
    path = checkpoint(policy, collector).save(tmp_path / "ckpt")
    collector.shutdown()
    policy2 = make_policy(1)
    env = make_env(None, 1)
    env.append_transform(StepCounter(step_count_key="sc2"))
    collector2 = Collector(env, policy2, frames_per_batch=10, total_frames=-1, auto_register_policy_transforms=False)
    held = collector2._carrier
    before = held.clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"declares entries the checkpoint's carrier lacks"):
        checkpoint(policy2, collector2).load(path)
    assert collector2._carrier is held and (collector2._carrier == before).all()
    next(iter(collector2))  # it still collects
    collector2.shutdown()


@pytest.mark.parametrize("env_name", ["CountingEnvWithString", "EnvWithMetadata", "HeterogeneousCountingEnv"])
def test_collectors_over_torchrls_unusual_envs_load_their_own_checkpoints(tmp_path: Path, env_name: str) -> None:
    """Non-tensor observations (declared by the env's specs, never held by torchrl's carrier: the carrier check
    refused them) and a lazily stacked env of other shapes per env (the restore failed reading an entry no single
    tensor holds, and so did its rollback): each loads what it saved, and its next batch is an uninterrupted run's
    (the counting envs keep their counter in a buffer of the base env, which a collector's state leaves out: it
    restarted from 0)."""
    from torchrl.testing import mocking_classes

    def make() -> Collector:
        torch.manual_seed(0)
        env = getattr(mocking_classes, env_name)()
        env.set_seed(0)
        return Collector(env, None, frames_per_batch=4, total_frames=-1)

    ((expected,), (got,)) = _batches_around_a_resume(make, tmp_path, 1)
    assert got.batch_size == expected.batch_size
    _assert_equal_leaves(expected, got)


@pytest.mark.parametrize("noise", ["ornstein_uhlenbeck", "additive_gaussian"])
def test_a_collectors_exploration_noise_resumes_mid_trajectory_with_its_annealing(tmp_path: Path, noise: str) -> None:
    """The noise modules' annealed scale is the policy's (a buffer); an OU process's running noise and step count
    live in the tensordict it writes, which the collector's carrier holds mid-trajectory."""
    from tensordict.nn import TensorDictSequential
    from torchrl.modules import AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule

    def build(seed: int):
        env = make_env(seed=seed)
        env.append_transform(InitTracker())  # (an OU process resets its noise where a trajectory starts)
        torch.manual_seed(seed)
        actor = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
        kind = OrnsteinUhlenbeckProcessModule if noise == "ornstein_uhlenbeck" else AdditiveGaussianModule
        explore = kind(spec=env.action_spec, annealing_num_steps=50)
        policy = TensorDictSequential(actor, explore)
        collector = Collector(env, policy, frames_per_batch=7, total_frames=-1, auto_register_policy_transforms=False)
        return explore, policy, collector

    def ckpt(policy, collector) -> tdcp.DistributedCheckpoint:
        return tdcp.DistributedCheckpoint(policy=policy, collector=collector, rng=tdcp.RNGState())

    explore, policy, collector = build(0)
    it = iter(collector)
    for _ in range(3):  # 21 steps: the carrier is mid-episode (max_steps=15), the noise annealed three times
        next(it)
        explore.step(frames=7)
    path = ckpt(policy, collector).save(tmp_path / "c")
    expected = []
    for _ in range(4):
        expected.append(next(it))
        explore.step(frames=7)
    collector.shutdown()
    explore2, policy2, collector2 = build(5)
    ckpt(policy2, collector2).load(path)
    it2 = iter(collector2)
    got = []
    for _ in range(4):
        got.append(next(it2))
        explore2.step(frames=7)
    collector2.shutdown()
    assert_same(explore.state_dict(), explore2.state_dict())  # (the annealed scale, after the same steps)
    for a, b in zip(expected, got):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        _assert_equal_leaves(a, b)


def _batches_around_a_resume(make, tmp_path: Path, n: int) -> tuple[list, list]:
    """The ``n`` batches after a save (with the RNG) of a collector that went on, and those of a new one loaded from
    it."""
    collector = make()
    it = iter(collector)
    next(it)
    path = tdcp.DistributedCheckpoint(collector=collector, rng=tdcp.RNGState()).save(tmp_path / "c")
    expected = [next(it) for _ in range(n)]
    collector.shutdown()
    collector2 = make()
    tdcp.DistributedCheckpoint(collector=collector2, rng=tdcp.RNGState()).load(path)
    it2 = iter(collector2)
    got = [next(it2) for _ in range(n)]
    collector2.shutdown()
    return expected, got


def _assert_equal_leaves(expected, got) -> None:
    """Every tensor leaf equal; entries of other shapes per element (a lazy stack's) compared element by element."""
    for key in expected.keys(include_nested=True, leaves_only=True):
        try:
            a, b = [expected.get(key)], [got.get(key)]
        except RuntimeError:  # (no one tensor holds it: each stacked TensorDict's)
            key = key if isinstance(key, tuple) else (key,)
            a, b = ([t.get(key[-1]) for t in td.get(key[:-1]).tensordicts] for td in (expected, got))
        for x, y in zip(a, b, strict=True):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), key


def _counting_env(kind: str):
    """torchrl's ``CountingEnv`` (its step count in a buffer of the base env) alone, wrapped, and in a
    ``SerialEnv`` of wrapped sub-envs."""
    from torchrl.envs import SerialEnv
    from torchrl.testing.mocking_classes import CountingEnv

    if kind == "plain":
        return CountingEnv(max_steps=50)
    if kind == "transformed":
        return TransformedEnv(CountingEnv(max_steps=50), StepCounter())
    sub = lambda: TransformedEnv(CountingEnv(max_steps=50), StepCounter())  # noqa: E731
    return TransformedEnv(SerialEnv(2, sub), StepCounter(step_count_key="outer"))


@pytest.mark.parametrize("kind", ["plain", "transformed", "serial"])
def test_a_collector_resumes_the_state_its_base_env_keeps_in_buffers(tmp_path: Path, kind: str) -> None:
    """``Collector.state_dict()`` holds nothing of a plain env and only the transforms of a ``TransformedEnv``: a
    base env's own buffers (``CountingEnv``'s step count) were lost and the resumed run counted from 0 without a
    warning. Saved beside it, the next batch is an uninterrupted run's."""

    def make() -> Collector:
        torch.manual_seed(0)
        env = _counting_env(kind)
        env.set_seed(0)
        return Collector(env, None, frames_per_batch=4, total_frames=-1)

    assert_same_batches(*_batches_around_a_resume(make, tmp_path, 2))


@pytest.mark.parametrize("kind", ["transformed", "serial"])
def test_an_env_registered_alone_resumes_its_base_envs_buffers(tmp_path: Path, kind: str) -> None:
    """A ``TransformedEnv``'s ``state_dict()`` holds its transforms only: its base env's buffers (a step count) are
    saved beside it, and the next step after a restore is the one the env would have taken."""

    def step(env, td):
        td = td.clone()
        td["action"] = torch.ones_like(td["action"])
        return env.step(td)

    env = _counting_env(kind)
    td = env.rand_action(env.reset())
    for _ in range(3):
        td = env.rand_action(step(env, td)["next"].clone())
    path = tdcp.DistributedCheckpoint(env=env).save(tmp_path / "e")
    expected = step(env, td)["next", "observation"]
    env2 = _counting_env(kind)
    env2.reset()
    tdcp.DistributedCheckpoint(env=env2).load(path)
    assert torch.equal(step(env2, td)["next", "observation"], expected)
    assert int(expected.min()) == 4


def test_a_base_env_built_otherwise_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A saved base env's buffers that the live env does not hold (another base env) are refused naming the
    component, and the collector is left as it was."""
    from torchrl.testing.mocking_classes import CountingEnv

    collector = Collector(TransformedEnv(CountingEnv(max_steps=50), StepCounter()), None, frames_per_batch=4,
                          total_frames=-1)  # fmt: skip
    next(iter(collector))
    path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    collector.shutdown()
    other = CountingEnv(max_steps=50)
    other.register_buffer("extra", torch.zeros(2))
    collector2 = Collector(TransformedEnv(other, StepCounter()), None, frames_per_batch=4, total_frames=-1)
    next(iter(collector2))
    before = other.count.clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"base env at base_env .*keys \['extra'\]"):
        tdcp.DistributedCheckpoint(collector=collector2).load(path)
    assert torch.equal(other.count, before)
    collector2.shutdown()


@pytest.mark.parametrize("other", ["transform", "buffer"])
def test_a_policy_less_collector_over_sub_envs_built_otherwise_is_refused(tmp_path: Path, other: str) -> None:
    """Without policy state the collector loads non-strict; its env's keys were compared at the top level only,
    which for a ``SerialEnv`` are ``worker0``, ``worker1``...: sub-envs with other transforms (their statistics
    dropped) or another base env's buffers loaded silently. Compared key by key, nested ones too."""
    from torchrl.envs import SerialEnv
    from torchrl.testing.mocking_classes import CountingEnv

    class Counting2(CountingEnv):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.register_buffer("extra", torch.zeros(1))

    def make(variant: bool) -> Collector:
        if other == "transform":
            sub = lambda: TransformedEnv(PendulumEnv(), VecNormV2(in_keys=["th"]) if variant else StepCounter())  # noqa: E731
        else:
            sub = Counting2 if variant else CountingEnv  # noqa: E731
        return Collector(SerialEnv(2, sub), None, frames_per_batch=4, total_frames=-1)

    collector = make(False)
    next(iter(collector))
    path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    collector.shutdown()
    collector2 = make(True)
    next(iter(collector2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tdcp.IncompatibleComponentError, match=r"other transform state than the checkpoint's"):
            tdcp.DistributedCheckpoint(collector=collector2).load(path)
    collector2.shutdown()


def test_the_generators_of_a_deeply_nested_env_are_saved(tmp_path: Path) -> None:
    """``PendulumEnv.rng`` under three ``TransformedEnv(SerialEnv(...))`` wrappers (seven modules deep): the walk for
    generators stopped at six and the resumed batches differed, without a warning."""
    from torchrl.envs import SerialEnv

    def wrap(inner, i: int):
        return lambda: TransformedEnv(SerialEnv(1, inner), StepCounter(step_count_key=f"s{i}"))

    def build(seed: int) -> Collector:
        make = lambda: TransformedEnv(PendulumEnv(), StepCounter(max_steps=4))  # noqa: E731
        for i in range(3):
            make = wrap(make, i)
        env = make()
        env.set_seed(seed)
        return Collector(env, None, frames_per_batch=6, total_frames=-1)

    torch.manual_seed(0)
    collector = build(0)
    it = iter(collector)
    next(it)
    path = tdcp.DistributedCheckpoint(collector=collector, rng=tdcp.RNGState()).save(tmp_path / "c")
    expected = [next(it) for _ in range(2)]
    collector.shutdown()
    collector2 = build(1)
    tdcp.DistributedCheckpoint(collector=collector2, rng=tdcp.RNGState()).load(path)
    it2 = iter(collector2)
    assert_same_batches(expected, [next(it2) for _ in range(2)])
    collector2.shutdown()


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_collector_collecting_in_its_background_thread_is_paused_for_a_save(tmp_path: Path, how: str) -> None:
    """Probe m8: a ``Collector`` started with ``collector.start()`` (torchrl's async collection) was saved while its
    thread stepped the env and wrote the buffer: no warning, and the checkpoint was torn (refused by its own load
    in half the runs: the writer's cursor past the rows). The thread is paused at a batch boundary for the save,
    started again, and the save warns that async collection does not resume exactly."""
    import time

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    def build(seed: int) -> tuple[Collector, ReplayBuffer]:
        rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
        return Collector(make_env(None, seed), None, frames_per_batch=10, total_frames=-1, replay_buffer=rb), rb

    collector, rb = build(0)
    collector.start()
    try:
        while rb.write_count < 30:
            time.sleep(0.01)
        ckpt = tdcp.DistributedCheckpoint(collector=collector, rb=rb)
        with pytest.warns(tdcp.InexactResumeWarning, match=r"\['collector'\]: collecting in a background thread"):
            saved = getattr(ckpt, how)(tmp_path / "c")
        if how == "async_save":
            saved.wait()
        assert collector._thread.is_alive()  # (collecting again)
        written = rb.write_count
        while rb.write_count == written:
            time.sleep(0.01)
    finally:
        collector.async_shutdown()
    fresh, fresh_rb = build(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.DistributedCheckpoint(collector=fresh, rb=fresh_rb).load(tmp_path / "c")
    assert fresh._frames == len(fresh_rb) == fresh_rb.write_count and len(fresh_rb) % 10 == 0
    fresh.shutdown()


def test_a_load_into_a_collector_collecting_in_its_background_thread_pauses_it(tmp_path: Path) -> None:
    """Probe m9: a load into a ``Collector`` whose thread collected restored it under the thread: counters and buffer
    torn, or the thread killed by a bare AttributeError, or a refusal that could not roll back. The thread is
    paused for the load too, and started again from the restored state."""
    import time

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    collector = Collector(make_env(None, 0), None, frames_per_batch=10, total_frames=-1, replay_buffer=rb)
    ckpt = tdcp.DistributedCheckpoint(collector=collector, rb=rb)
    for _ in range(3):
        next(iter(collector))
    ckpt.save(tmp_path / "c")
    collector.start()
    try:
        while rb.write_count < 100:
            time.sleep(0.01)
        with pytest.warns(tdcp.InexactResumeWarning, match=r"paused at a batch boundary for this load"):
            ckpt.load(tmp_path / "c")
        assert collector._thread.is_alive()
        collector._stop = True  # (the next batch boundary: then compare)
        collector._thread.join()
        assert collector._frames == len(rb) == rb.write_count >= 30
    finally:
        collector.async_shutdown()


def test_a_load_into_a_collector_that_was_shut_down_says_so(tmp_path: Path) -> None:
    """Probe m10: a load into a shut-down collector (``Trainer.train()`` shuts its collector down when it ends) raised
    a wrapped AttributeError saying it could not roll back; the save says what happened, and so does the load now,
    while planning: nothing restored."""
    collector = Collector(make_env(None, 0), None, frames_per_batch=10, total_frames=-1)
    next(iter(collector))
    ckpt = tdcp.DistributedCheckpoint(collector=collector)
    ckpt.save(tmp_path / "c")
    collector.shutdown()
    with pytest.raises(tdcp.CheckpointError, match="the collector was shut down.*nothing was restored"):
        ckpt.load(tmp_path / "c")
