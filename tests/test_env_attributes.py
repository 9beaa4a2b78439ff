"""An env that keeps state in plain attributes (``self.episode += 1``) is named at save and at load, never resumed
inexactly without a word; an env class declared exact (configuration only) says nothing."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase, PendulumEnv, SerialEnv, StepCounter, TicTacToeEnv, TransformedEnv
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv, CountingEnv

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import env_attributes
from torchrl_dcp.audit import state_differences, state_snapshot


class EpisodeEnv(EnvBase):
    """Counts its episodes in a plain attribute: each reset's observation is the episode number."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_spec = Composite(observation=Unbounded((1,)))
        self.action_spec = Bounded(-1, 1, (1,))
        self.reward_spec = Unbounded((1,))
        self.episode, self.t = 0, 0

    def _reset(self, tensordict: Any = None, **kwargs: Any) -> TensorDict:
        self.episode, self.t = self.episode + 1, 0
        return TensorDict({"observation": torch.full((1,), float(self.episode))}, [])

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self.t += 1
        done = torch.tensor([self.t >= 3])
        obs = tensordict["observation"] + 0.5
        return TensorDict({"observation": obs, "reward": torch.ones(1), "done": done, "terminated": done}, [])

    def _set_seed(self, seed: int | None) -> None:
        return None


def _attribute_warnings(caught: list) -> list[str]:  # type: ignore[type-arg]
    return [str(w.message) for w in caught if "plain attributes" in str(w.message)]


def _collect(env: EnvBase) -> Collector:
    collector = Collector(env, None, frames_per_batch=4, total_frames=-1)
    it = iter(collector)
    for _ in range(3):
        next(it)
    return collector


def test_an_env_counting_in_plain_attributes_is_named_at_save_and_at_load(tmp_path: Path) -> None:
    """The attributes were not saved and nothing was said: the batches after a restore started from episode 1 again
    (probe: observations 5.0, 5.5, 6.0, 6.0 uninterrupted against 5.0, 5.5, 6.0, 2.0 after the load)."""
    collector = _collect(TransformedEnv(EpisodeEnv(), StepCounter()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    (saving,) = _attribute_warnings(caught)
    assert "'collector' (saving): env.base_env (EpisodeEnv: episode, t)" in saving and "register_exact_env" in saving
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdcp.DistributedCheckpoint(collector=_collect(TransformedEnv(EpisodeEnv(), StepCounter()))).load(path)
    (loading,) = _attribute_warnings(caught)
    assert "'collector' (loading): env.base_env (EpisodeEnv: episode, t)" in loading
    with pytest.warns(tdcp.InexactResumeWarning, match=r"'env' \(saving\): env \(EpisodeEnv: episode, t\)"):
        tdcp.DistributedCheckpoint(env=EpisodeEnv()).save(tmp_path / "e")  # (an env registered alone: the same)


def test_torchrls_mock_env_with_counters_is_named_and_an_env_of_buffers_is_not(tmp_path: Path) -> None:
    with pytest.warns(tdcp.InexactResumeWarning, match=r"ContinuousActionVecMockEnv: counter, seed"):
        tdcp.DistributedCheckpoint(collector=_collect(ContinuousActionVecMockEnv())).save(tmp_path / "mock")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        for i, env in enumerate((PendulumEnv(), CountingEnv(), SerialEnv(2, PendulumEnv))):
            tdcp.DistributedCheckpoint(collector=_collect(env)).save(tmp_path / f"quiet-{i}")


def test_an_env_class_declared_exact_says_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Configured(EpisodeEnv):
        pass

    monkeypatch.setattr(env_attributes, "_USER_EXACT", set())
    tdcp.adapters.register_exact_env(Configured)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(collector=_collect(Configured())).save(tmp_path / "c")
    with pytest.raises(TypeError, match="takes a class"):
        tdcp.adapters.register_exact_env(Configured())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(env_attributes.EXACT_ENVS))
def test_torchrls_envs_listed_exact_resume_exactly_under_a_collector(tmp_path: Path, name: str) -> None:
    """What listing a class in ``EXACT_ENVS`` claims: its plain attributes are configuration (the audit is empty
    after a restore into an env built alike) and the next batches equal a run that never stopped."""
    build = {"CountingEnv": lambda: CountingEnv(max_steps=5), "TicTacToeEnv": TicTacToeEnv}[name]
    torch.manual_seed(0)
    collector = _collect(build())
    saved = state_snapshot(collector, "collector")
    ckpt = tdcp.DistributedCheckpoint(collector=collector)
    ckpt.register("rng", tdcp.RNGState())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        path = ckpt.save(tmp_path / "c")
    it = iter(collector)
    expected = [next(it).clone() for _ in range(3)]
    torch.manual_seed(5)
    fresh = Collector(build(), None, frames_per_batch=4, total_frames=-1)
    restore = tdcp.DistributedCheckpoint(collector=fresh)
    restore.register("rng", tdcp.RNGState())
    restore.load(path)
    assert state_differences(saved, state_snapshot(fresh, "collector")) == []
    it = iter(fresh)
    assert all((a == next(it)).all() for a in expected)


def test_a_subclass_of_an_env_listed_exact_is_told_only_of_the_attributes_it_adds(tmp_path: Path) -> None:
    """A subclass of ``CountingEnv`` was warned about for ``CountingEnv``'s own configuration (``max_steps``, ...),
    or, had the list matched subclasses, said nothing of the counter it adds."""

    class Renamed(CountingEnv):
        pass

    class Counting(CountingEnv):
        def __init__(self) -> None:
            super().__init__()
            self.resets = 0

        def _reset(self, tensordict: Any = None, **kwargs: Any) -> TensorDict:
            self.resets += 1
            return super()._reset(tensordict, **kwargs)

    assert env_attributes.plain_attributes(Renamed()) == [] and env_attributes.plain_attributes(Counting()) == [
        "resets"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(collector=_collect(Renamed())).save(tmp_path / "renamed")
    with pytest.warns(tdcp.InexactResumeWarning, match=r"Counting: resets\)"):
        tdcp.DistributedCheckpoint(collector=_collect(Counting())).save(tmp_path / "counting")
