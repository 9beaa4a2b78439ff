"""A torchrl env registered on its own (``tdcp.DistributedCheckpoint(env=env)``): saved as a collector's env is.

Each exactness case steps an env, saves it, keeps stepping (with resets, which draw from the env's own generator),
then loads into a freshly built env (another seed, already stepped) and replays the same steps from the saved
in-flight TensorDict: every entry equal, bit for bit. The restored env is also audited (``tdcp.state_snapshot``).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import (
    CatTensors,
    Compose,
    EnvBase,
    ParallelEnv,
    PendulumEnv,
    RewardSum,
    SerialEnv,
    StepCounter,
    TrajCounter,
    TransformedEnv,
    UnsqueezeTransform,
    VecNormV2,
)

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import resolve_adapter
from torchrl_dcp.audit import state_differences, state_snapshot

#: torchrl's VecNormV2.load_state_dict rebuilds its statistics' TensorDicts with batch size [] (metadata only)
VECNORM_BATCH_SIZES = ("._loc.batch_size", "._var.batch_size", "._count.batch_size")


def pendulum(seed: int) -> EnvBase:
    env = PendulumEnv()
    env.set_seed(seed)
    return env


def transformed(seed: int) -> EnvBase:
    env = TransformedEnv(
        PendulumEnv(),
        Compose(
            UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
            CatTensors(["th", "thdot"], "observation", del_keys=False),
            StepCounter(max_steps=5),
            RewardSum(),
            VecNormV2(in_keys=["observation"], decay=0.9),
            TrajCounter(),
        ),
    )
    env.set_seed(seed)
    return env


def _sub_env() -> EnvBase:
    return TransformedEnv(PendulumEnv(), Compose(StepCounter(max_steps=4), TrajCounter()))


def serial(seed: int) -> EnvBase:
    env = SerialEnv(2, _sub_env)
    env.set_seed(seed)
    return env


def transformed_serial(seed: int) -> EnvBase:
    env = TransformedEnv(SerialEnv(2, _sub_env), RewardSum())
    env.set_seed(seed)
    return env


ENVS: dict[str, Callable[[int], EnvBase]] = {
    "pendulum": pendulum,
    "transformed": transformed,
    "serial": serial,
    "transformed-serial": transformed_serial,
}


def steps(env: EnvBase, td: Any, n: int, seed: int) -> list[Any]:
    """``n`` random steps from ``td`` (actions from the seeded global torch RNG), finished episodes reset, then a
    reset of every env: what each step and the reset returned (every reset draws from the env's generators)."""
    torch.manual_seed(seed)
    out = []
    for _ in range(n):
        td = env.rand_action(td)
        stepped, td = env.step_and_maybe_reset(td)
        out.append(stepped.clone())
    out.append(env.reset().clone())
    return out


def assert_same(expected: list[Any], got: list[Any]) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert set(a.keys(True, True)) == set(b.keys(True, True)), i
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), f"step {i}: {key} differs after the restore"


def assert_same_values(a: Any, b: Any, where: str = "") -> None:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif hasattr(a, "items"):
        assert set(a.keys()) == set(b.keys()), where
        for key in a.keys():
            assert_same_values(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


def advance(env: EnvBase, n: int, seed: int) -> Any:
    """Reset, then ``n`` random steps: the in-flight TensorDict after them."""
    torch.manual_seed(seed)
    td = env.reset()
    for _ in range(n):
        _, td = env.step_and_maybe_reset(env.rand_action(td))
    return td


@pytest.mark.parametrize("kind", list(ENVS))
def test_an_env_resumes_exactly(tmp_path: Path, kind: str) -> None:
    """After a load, the steps (and the resets, which draw from ``PendulumEnv.rng``, and ``TrajCounter``'s ids,
    ``VecNormV2``'s statistics, the sub-envs of a ``SerialEnv``) equal those of an env that never stopped."""
    env = ENVS[kind](0)
    td = advance(env, 11, seed=1)  # crosses episode ends (max_steps 4 and 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)  # exact: nothing to warn about
        path = tdcp.DistributedCheckpoint(env=env).save(tmp_path / "ckpt")
    saved = state_snapshot(env, "env")
    expected = steps(env, td.clone(), 12, seed=2)

    env2 = ENVS[kind](123)  # another seed, and stepped: its generators, counters and statistics moved on
    advance(env2, 3, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        result = tdcp.DistributedCheckpoint(env=env2).load(path)
    assert set(result.loaded) == {"env"}
    differences = [
        d for d in state_differences(saved, state_snapshot(env2, "env")) if not d.path.endswith(VECNORM_BATCH_SIZES)
    ]
    assert not differences, "the restored env differs:\n" + "\n".join(map(str, differences[:20]))
    got = steps(env2, td.clone(), 12, seed=2)
    assert_same(expected, got)
    if kind != "pendulum":  # the trajectory counts went on from the saved ones (several episodes ended)
        assert int(expected[-2]["next", "traj_count"].max()) >= 3


def test_envs_are_placed_per_rank_by_their_own_adapter() -> None:
    """An env is an ``nn.Module``; the env adapter is matched first, for every kind of env, and places it per rank
    (each rank steps its own env, seeded apart)."""
    for make in (pendulum, transformed, serial):
        adapter = resolve_adapter(make(0))
        assert (adapter.adapter_id, adapter.default_placement) == ("torchrl_dcp.env", "per_rank")
    assert tdcp.DistributedCheckpoint(env=transformed(0)).placement("env") == "per_rank"


def test_a_serial_env_saves_and_resumes_exactly_under_any_name(tmp_path: Path) -> None:
    """The probe's case: ``SerialEnv.state_dict()`` takes no ``keep_vars``; it saved through the module adapter's
    call and failed with a ``TypeError`` naming no component. It saves, and the next reset is the uninterrupted one."""
    env = SerialEnv(2, PendulumEnv)
    env.set_seed(0)
    env.reset()
    path = tdcp.DistributedCheckpoint(my_serial_env=env).save(tmp_path / "c")
    expected = env.reset()
    env2 = SerialEnv(2, PendulumEnv)
    env2.set_seed(1)
    tdcp.DistributedCheckpoint(my_serial_env=env2).load(path)
    assert_same([expected], [env2.reset()])


def test_an_env_whose_state_dict_fails_is_refused_naming_the_component(tmp_path: Path) -> None:
    class Broken(PendulumEnv):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("no state here")

    with pytest.raises(tdcp.CheckpointError, match=r"component 'sim'.*Broken\.state_dict\(\) failed.*adapter="):
        tdcp.DistributedCheckpoint(sim=Broken()).save(tmp_path / "c")


def test_a_load_into_an_env_built_otherwise_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A checkpoint of a ``SerialEnv`` of 2 into one of 3: refused naming the component; the env is as it was."""
    env = serial(0)
    env.reset()
    path = tdcp.DistributedCheckpoint(env=env).save(tmp_path / "c")
    other = SerialEnv(3, _sub_env)
    other.set_seed(5)
    other.reset()
    before = state_snapshot(other, "env")
    with pytest.raises(tdcp.CheckpointError, match="'env'"):
        tdcp.DistributedCheckpoint(env=other).load(path)
    assert not state_differences(before, state_snapshot(other, "env"))


def test_an_env_reshards_its_transform_statistics_not_its_generators(tmp_path: Path) -> None:
    """After a world-size change (``world_size_change='reshard'``), as a collector's env: ``state_dict()`` of saved
    rank ``r % W`` (``VecNormV2`` statistics), the generator stays the new env's own."""
    from torchrl_dcp.adapters.base import AdapterContext
    from torchrl_dcp.adapters.env import EnvAdapter

    env = transformed(0)
    advance(env, 6, seed=1)
    adapter = EnvAdapter()
    state = adapter.state(env, AdapterContext("env"))
    env2 = transformed(7)
    gen_before = env2.base_env.rng.get_state().clone()
    ctx = AdapterContext("env", rank=1, world_size=2, saved_world_size=1)
    assert adapter.reshard_sources({0: state}, ctx) == [0]
    adapter.reshard(env2, {0: state}, ctx)
    assert_same_values(env.state_dict(), env2.state_dict())
    assert torch.equal(env2.base_env.rng.get_state(), gen_before)


def test_a_parallel_env_warns_that_its_workers_state_is_not_restored(tmp_path: Path) -> None:
    """A ``ParallelEnv``'s sub-envs and their generators live in worker processes: saved (its ``state_dict()``)
    with an ``InexactResumeWarning`` naming it, at save and at load."""
    env = ParallelEnv(1, PendulumEnv)  # one worker (each start costs seconds); loaded into itself, for the same reason
    try:
        env.set_seed(0)
        env.reset()
        with pytest.warns(tdcp.InexactResumeWarning, match=r"'env' \(saving\): env \(ParallelEnv of 1 workers\)"):
            path = tdcp.DistributedCheckpoint(env=env).save(tmp_path / "c")
        with pytest.warns(tdcp.InexactResumeWarning, match=r"'env' \(loading\).*ParallelEnv"):
            result = tdcp.DistributedCheckpoint(env=env).load(path)
        assert set(result.loaded) == {"env"}
    finally:
        env.close()


def test_a_serial_env_whose_sub_envs_reset_apart_resumes_exactly_and_a_changed_one_is_refused(tmp_path: Path) -> None:
    """Sub-envs ending their episodes at different steps: at a partial reset the ones going on read their entries from
    the SerialEnv's shared buffers, which a load left at the fresh env's first reset; the VecNormV2 outside it then
    updated from other values, silently. The buffers are saved and written back."""
    from torchrl.envs import CatTensors, Compose, PendulumEnv, SerialEnv, StepCounter, UnsqueezeTransform, VecNormV2

    def sub(steps: int) -> TransformedEnv:
        return TransformedEnv(
            PendulumEnv(),
            Compose(
                UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
                CatTensors(["th", "thdot"], "observation", del_keys=False),
                StepCounter(max_steps=steps),
            ),
        )

    def make(seed: int, last: int = 5) -> TransformedEnv:
        env = TransformedEnv(SerialEnv(2, [lambda: sub(3), lambda: sub(last)]), VecNormV2(["observation"], decay=0.9))
        env.set_seed(seed)
        return env

    def run(env: Any, td: Any, n: int) -> list:
        out = []
        for _ in range(n):
            td["action"] = env.action_spec.rand()
            step, td = env.step_and_maybe_reset(td)
            out.append(step.clone())
        return out

    torch.manual_seed(0)
    env = make(0)
    td = env.step_mdp(run(env, env.reset(), 8)[-1])
    path = tdcp.DistributedCheckpoint(no_dist=True, env=env, td=td, rng=tdcp.RNGState()).save(tmp_path / "c")
    expected = run(env, td, 10)
    again, td2 = make(5), TensorDict()
    tdcp.DistributedCheckpoint(no_dist=True, env=again, td=td2, rng=tdcp.RNGState()).load(path)
    got = run(again, td2, 10)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, got) for k in a.keys(True, True))
    other = TransformedEnv(SerialEnv(2, PendulumEnv), VecNormV2(["th"], decay=0.9))  # other buffers: refused
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(no_dist=True, env=other, td=TensorDict(), rng=tdcp.RNGState()).load(path)


class _PythonRandomEnv(EnvBase):
    """A user's env drawing from a ``random.Random`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_spec = Composite(obs=Unbounded((1,)))
        self.action_spec = Bounded(-1, 1, (1,))
        self.reward_spec = Unbounded((1,))
        self.prng = random.Random(0)

    def _reset(self, td: Any) -> TensorDict:
        return TensorDict({"obs": torch.tensor([self.prng.random()])}, [])

    def _step(self, td: Any) -> TensorDict:
        obs = td["obs"] + td["action"] + self.prng.gauss(0.0, 1.0)  # (gauss: a cached second draw, kept too)
        done = torch.tensor([False])
        return TensorDict({"obs": obs, "reward": obs.clone(), "done": done, "terminated": done}, [])

    def _set_seed(self, seed: int | None) -> None:
        self.prng.seed(seed)


def test_an_envs_python_random_generator_resumes_exactly(tmp_path: Path) -> None:
    """A ``random.Random`` held by a user's env was neither saved nor warned about: the next batches differed,
    silently (only torch and NumPy generators were found). It is saved with the env's generators."""
    from torchrl.collectors import Collector

    def build(seed: int) -> Collector:
        env = TransformedEnv(_PythonRandomEnv(), StepCounter(max_steps=4))
        env.set_seed(seed)
        return Collector(env, None, frames_per_batch=5, total_frames=-1)

    live = build(0)
    batches = iter(live)
    next(batches)
    path = tdcp.DistributedCheckpoint(no_dist=True, collector=live, rng=tdcp.RNGState()).save(tmp_path / "c")
    expected = [next(batches)["next", "obs"] for _ in range(2)]
    fresh = build(123)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(no_dist=True, collector=fresh, rng=tdcp.RNGState()).load(path)
    got = iter(fresh)  # (random actions: the global torch stream, restored by RNGState)
    assert all(torch.equal(e, next(got)["next", "obs"]) for e in expected)
    live.shutdown()
    fresh.shutdown()
