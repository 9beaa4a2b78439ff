"""A collector over an env that wraps an external simulator (torchrl's ``_EnvWrapper``: ``GymEnv``,
``DMControlEnv``, a user's own wrapper) cannot resume exactly, since the simulator's state is not reachable: the
save and the load say so, naming the env, instead of resuming inexactly without a word. Envs whose state is in
the TensorDict (``PendulumEnv``) say nothing."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import Composite, Unbounded
from torchrl.envs import PendulumEnv, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.common import _EnvWrapper

import torchrl_dcp as tdcp


class _Simulator:
    """An external simulator: its state and generator live here, outside any TensorDict."""

    def __init__(self) -> None:
        self.rng, self.x = np.random.default_rng(0), 0.0

    def reset(self) -> float:
        self.x = float(self.rng.normal())
        return self.x

    def step(self, action: float) -> tuple[float, float, bool]:
        self.x += action
        return self.x, -abs(self.x), abs(self.x) > 5


class SimulatorEnv(_EnvWrapper):
    """How users wrap a simulator for torchrl (as ``GymWrapper`` does for gym)."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(env=_Simulator(), **kwargs)

    def _check_kwargs(self, kwargs: dict) -> None:
        pass

    def _init_env(self) -> None:
        pass

    def _build_env(self, env: _Simulator, **kwargs) -> _Simulator:  # type: ignore[no-untyped-def]
        return env

    def _make_specs(self, env: _Simulator) -> None:
        self.observation_spec = Composite(observation=Unbounded((1,)))
        self.action_spec = Unbounded((1,))
        self.reward_spec = Unbounded((1,))

    def _set_seed(self, seed: int | None) -> None:
        self._env.rng = np.random.default_rng(seed)

    def _reset(self, tensordict: TensorDict | None = None, **kwargs) -> TensorDict:  # type: ignore[no-untyped-def]
        return TensorDict({"observation": torch.tensor([self._env.reset()])}, [])

    def _step(self, tensordict: TensorDict) -> TensorDict:
        x, r, done = self._env.step(tensordict["action"].item())
        d = torch.tensor([done])
        return TensorDict(
            {"observation": torch.tensor([x]), "reward": torch.tensor([r]), "done": d, "terminated": d}, []
        )


ENVS = {
    "wrapper": (lambda: SimulatorEnv(), "env (SimulatorEnv)"),
    "transformed wrapper": (lambda: TransformedEnv(SimulatorEnv(), StepCounter()), "env.base_env (SimulatorEnv)"),
    "serial of wrappers": (lambda: SerialEnv(2, SimulatorEnv), "env._envs.0 (SimulatorEnv)"),
}


class _Scaled(torch.nn.Module):
    """A one-parameter policy: ``gain * observation`` (``unsqueeze``: of a scalar observation, like Pendulum's ``th``)."""

    def __init__(self, unsqueeze: bool) -> None:
        super().__init__()
        self.gain, self.unsqueeze = torch.nn.Parameter(torch.tensor(0.1)), unsqueeze

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return ((obs.unsqueeze(-1) if self.unsqueeze else obs) * self.gain).clamp(-2, 2)


def _collector(env, key: str = "observation") -> Collector:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    policy = TensorDictModule(_Scaled(key == "th"), in_keys=[key], out_keys=["action"])
    return Collector(env, policy, frames_per_batch=4, total_frames=-1)


def _simulator_warnings(caught: list) -> list[str]:  # type: ignore[type-arg]
    return [str(w.message) for w in caught if "external simulator" in str(w.message)]


@pytest.mark.parametrize("kind", sorted(ENVS))
def test_a_simulator_env_is_named_at_save_and_at_load(tmp_path: Path, kind: str) -> None:
    make, where = ENVS[kind]
    collector = _collector(make())
    next(iter(collector))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
    saving = _simulator_warnings(caught)
    assert len(saving) == 1 and "'collector' (saving)" in saving[0] and where in saving[0], saving
    fresh = _collector(make())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdcp.DistributedCheckpoint(collector=fresh).load(path)
    loading = _simulator_warnings(caught)
    assert len(loading) == 1 and "'collector' (loading)" in loading[0] and where in loading[0], loading
    collector.shutdown()
    fresh.shutdown()


def test_an_env_whose_state_is_in_the_tensordict_says_nothing(tmp_path: Path) -> None:
    collector = _collector(TransformedEnv(PendulumEnv(), StepCounter()), "th")
    next(iter(collector))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
        tdcp.DistributedCheckpoint(collector=_collector(TransformedEnv(PendulumEnv(), StepCounter()), "th")).load(path)
    assert not _simulator_warnings(caught) and not [w for w in caught if "worker processes" in str(w.message)]
