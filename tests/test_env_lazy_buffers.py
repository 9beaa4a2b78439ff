"""Envs holding uninitialised (lazy) buffers: an ``ObservationNorm`` built without ``loc``/``scale`` (torchrl's
tutorials' way: ``init_stats`` computes them) holds ``UninitializedBuffer``s until then, ``CatFrames`` its frames until
its first step.

A resume builds the same env and loads the checkpoint instead of computing the statistics again. torch's
``load_state_dict`` skips uninitialised tensors without a word, so the load reported success and left ``loc``/``scale``
uninitialised. The env adapter gives them the saved shapes and dtypes before the state is loaded: they equal the saved
ones, and the next steps (and resets) equal those of the env that never stopped, bit for bit; bare, around a
``SerialEnv`` and in its sub-envs. A checkpoint with no value for them is refused before anything changes, and a load
that fails after it materialised them leaves them uninitialised again (the same tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parameter import is_lazy
from torchrl.envs import (
    CatFrames,
    Compose,
    EnvBase,
    PendulumEnv,
    SerialEnv,
    StepCounter,
    TransformedEnv,
    UnsqueezeTransform,
)
from torchrl.envs.transforms import ObservationNorm

import torchrl_dcp as tdcp
from tests.test_env_adapter import advance, assert_same
from torchrl_dcp.adapters.env import EnvAdapter
from torchrl_dcp.audit import state_differences, state_snapshot


def _norm() -> ObservationNorm:
    return ObservationNorm(in_keys=["th"], standard_normal=True)  # no loc/scale: lazy, until init_stats


def normed() -> EnvBase:
    return TransformedEnv(PendulumEnv(), _norm())


def normed_serial() -> EnvBase:
    return TransformedEnv(SerialEnv(2, PendulumEnv), _norm())


def _framed() -> EnvBase:
    return TransformedEnv(
        PendulumEnv(),
        Compose(
            UnsqueezeTransform(-1, in_keys=["th"], out_keys=["th1"]),
            CatFrames(N=3, dim=-1, in_keys=["th1"], out_keys=["thcat"]),  # its frames: lazy until its first step
        ),
    )


def serial_of_framed() -> EnvBase:
    # (torchrl 0.14 builds no SerialEnv of sub-envs with an uninitialised ObservationNorm: it reads their specs)
    return SerialEnv(2, _framed)


ENVS: dict[str, Callable[[], EnvBase]] = {
    "observation-norm": normed,
    "observation-norm-around-serial": normed_serial,
    "cat-frames-in-serial": serial_of_framed,
}


def lazy_buffers(env: EnvBase) -> list[torch.Tensor]:
    """The buffers of ``env`` that are lazy while it is fresh: ``ObservationNorm``'s loc/scale, the frames of the
    ``CatFrames`` of a ``SerialEnv``'s sub-envs."""
    if isinstance(env, SerialEnv):
        if env.is_closed:
            env.start()
        return [t for sub in env._envs for t in lazy_buffers(sub)]
    if isinstance(env, TransformedEnv) and isinstance(env.transform, ObservationNorm):
        return [env.transform.loc, env.transform.scale]
    return [env.transform[1]._cat_buffers_th1]


def initialised(kind: str, seed: int) -> EnvBase:
    """The env as the saving run has it: seeded, its statistics computed (``init_stats``)."""
    env = ENVS[kind]()
    env.set_seed(seed)
    if kind == "observation-norm":
        env.transform.init_stats(num_iter=7)
    elif kind == "observation-norm-around-serial":
        env.transform.init_stats(num_iter=7, reduce_dim=(0, 1), cat_dim=0)
    return env


def steps(env: EnvBase, td: Any, n: int, seed: int) -> list[Any]:
    """``n`` random steps from ``td`` (actions from the seeded global RNG), then a reset (drawn from the env's
    generator): what each returned."""
    torch.manual_seed(seed)
    out = []
    for _ in range(n):
        stepped, td = env.step_and_maybe_reset(env.rand_action(td))
        out.append(stepped.clone())
    out.append(env.reset().clone())
    return out


def save(env: EnvBase, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)  # exact: nothing to warn about
        return tdcp.DistributedCheckpoint(env=env).save(path)


@pytest.mark.parametrize("kind", list(ENVS))
def test_lazy_buffers_are_restored_exactly(tmp_path: Path, kind: str) -> None:
    """The resume's env is built as the saved one was, without ``init_stats`` (or a step): after the load its lazy
    buffers are the saved ones (values, shapes, dtypes) and the next steps equal the uninterrupted env's, bit for bit."""
    env = initialised(kind, seed=0)
    td = advance(env, 5, seed=1)
    path = save(env, tmp_path / "ckpt")
    saved = [t.clone() for t in lazy_buffers(env)]
    snapshot = state_snapshot(env, "env")
    expected = steps(env, td.clone(), 8, seed=2)

    env2 = ENVS[kind]()
    env2.set_seed(123)
    assert all(is_lazy(t) for t in lazy_buffers(env2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        result = tdcp.DistributedCheckpoint(env=env2).load(path)
    assert set(result.loaded) == {"env"}
    got = lazy_buffers(env2)
    assert len(got) == len(saved) > 0
    for have, want in zip(got, saved):
        assert not is_lazy(have)
        assert (have.shape, have.dtype, have.device) == (want.shape, want.dtype, want.device)
        assert torch.equal(have, want)
    assert not state_differences(snapshot, state_snapshot(env2, "env"))
    assert_same(expected, steps(env2, td.clone(), 8, seed=2))


def test_a_failing_load_leaves_the_lazy_statistics_uninitialised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The env's restore materialises and fills ``loc``/``scale``, then the load fails: the rollback makes them
    uninitialised again (the same tensors, in the same slots), so ``init_stats`` still works; the next load (not
    failing) restores them exactly."""
    env = initialised("observation-norm", seed=0)
    path = save(env, tmp_path / "ckpt")

    original = EnvAdapter.restore

    def restore_then_fail(self: Any, obj: Any, state: Any, ctx: Any) -> Any:
        original(self, obj, state, ctx)  # (materialised and loaded)
        assert not is_lazy(obj.transform.loc)
        raise RuntimeError("injected failure after the env's restore")

    env2 = normed()
    tensors = (env2.transform.loc, env2.transform.scale)
    monkeypatch.setattr(EnvAdapter, "restore", restore_then_fail)
    with pytest.raises(tdcp.CheckpointError, match="injected failure") as info:
        tdcp.DistributedCheckpoint(env=env2).load(path)
    assert "could not roll back" not in str(info.value)
    assert (env2.transform.loc, env2.transform.scale) == tensors  # the same objects
    assert all(is_lazy(t) and type(t) is torch.nn.UninitializedBuffer for t in tensors)
    assert not env2.transform.initialized

    monkeypatch.setattr(EnvAdapter, "restore", original)
    tdcp.DistributedCheckpoint(env=env2).load(path)
    assert torch.equal(env2.transform.loc, env.transform.loc) and torch.equal(env2.transform.scale, env.transform.scale)
    assert env2.transform.loc is tensors[0]  # materialised in place, as torch's lazy modules are


def test_a_checkpoint_without_the_statistics_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A checkpoint of an env without that ``ObservationNorm`` holds no value to shape ``loc``/``scale``: refused
    naming the component and the buffer, before anything changes."""
    other = TransformedEnv(PendulumEnv(), StepCounter())
    other.set_seed(0)
    advance(other, 3, seed=1)
    path = tdcp.DistributedCheckpoint(env=other).save(tmp_path / "ckpt")

    env2 = normed()
    env2.set_seed(5)
    gen_before = env2.base_env.rng.get_state().clone()
    with pytest.raises(tdcp.CheckpointError, match=r"'env'.*transform\.loc.*not initialised"):
        tdcp.DistributedCheckpoint(env=env2).load(path)
    assert is_lazy(env2.transform.loc) and is_lazy(env2.transform.scale)
    assert torch.equal(env2.base_env.rng.get_state(), gen_before)


def test_saving_an_env_before_init_stats_says_so(tmp_path: Path) -> None:
    """The save of an env whose statistics are not computed yet is refused naming them and ``init_stats``."""
    with pytest.raises(tdcp.EncodingError, match=r"'env'.*transform\.loc.*init_stats"):
        tdcp.DistributedCheckpoint(env=normed()).save(tmp_path / "ckpt")
