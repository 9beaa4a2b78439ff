"""Conformance matrix of torchrl's env transforms, generated from ``torchrl.envs.transforms``.

Every public ``Transform`` class of ``torchrl.envs.transforms`` is a case. A class with a recipe below is appended to
a Pendulum env (after the keys it needs are made), collected through a ``Collector`` with a random policy, saved
with the RNG streams, collected further, then loaded into a collector built with another seed and collected again:

- a class in ``EXACT_TRANSFORMS`` must give the same batches and the state audit (:mod:`torchrl_dcp.audit`) of the
  whole collector after the restore must equal the saved one's, without an ``InexactResumeWarning``;
- a class in ``INEXACT_TRANSFORMS`` must be named by an ``InexactResumeWarning`` at save and at load.

A class without a recipe (``NO_RECIPE`` says why: images, language models, Ray, transforms of replay buffers) must
not be in ``EXACT_TRANSFORMS``: collectors holding it are warned about at save. A class torchrl adds is a failing
case until it gets a recipe or a reason. docs/components/conformance.md is generated from this matrix.
"""

from __future__ import annotations

import inspect
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.envs.transforms as T
from torchrl.collectors import Collector
from torchrl.data import Composite, Unbounded
from torchrl.envs import PendulumEnv, SerialEnv, TransformedEnv

import torchrl_dcp as tdcp
from torchrl_dcp.adapters.env_transforms import EXACT_TRANSFORMS, INEXACT_TRANSFORMS
from torchrl_dcp.audit import state_differences, state_snapshot

TRANSFORMS = sorted(n for n in T.__all__ if inspect.isclass(getattr(T, n)) and issubclass(getattr(T, n), T.Transform))

RECIPES: dict[str, Callable[[], Any]] = {
    "ActionDiscretizer": lambda: T.ActionDiscretizer(5, categorical=False),
    "ActionScaling": lambda: T.ActionScaling(loc=0.0, scale=2.0),
    "BinarizeReward": lambda: T.BinarizeReward(),
    "CatFrames": lambda: T.CatFrames(N=3, dim=-1, in_keys=["observation"], out_keys=["stacked"]),
    "CatTensors": lambda: T.CatTensors(["th", "thdot"], "cat2", del_keys=False),
    "ClipTransform": lambda: T.ClipTransform(in_keys=["observation"], low=-1.0, high=1.0),
    "Compose": lambda: T.Compose(T.StepCounter(max_steps=6), T.RewardSum()),
    "ConditionalSkip": lambda: T.ConditionalSkip(lambda td: td["step_count"] % 3 == 0),
    "DTypeCastTransform": lambda: T.DTypeCastTransform(torch.float32, torch.float64, in_keys=["observation"]),
    "DeviceCastTransform": lambda: T.DeviceCastTransform("cpu"),
    "DoubleToFloat": lambda: T.DoubleToFloat(),
    "ExcludeTransform": lambda: T.ExcludeTransform("observation"),
    "ExpandAs": lambda: T.ExpandAs("th", "observation", "th_expanded"),
    "FiniteTensorDictCheck": lambda: T.FiniteTensorDictCheck(),
    "FlattenObservation": lambda: T.FlattenObservation(-2, -1, in_keys=["obs_2d"], out_keys=["flat"]),
    "FrameSkipTransform": lambda: T.FrameSkipTransform(2),
    "InitTracker": lambda: T.InitTracker(),
    "LineariseRewards": lambda: T.LineariseRewards(in_keys=["reward"]),
    "NoopResetEnv": lambda: T.NoopResetEnv(noops=3, random=True),
    "ObservationNorm": lambda: T.ObservationNorm(loc=0.1, scale=2.0, in_keys=["observation"]),
    "PermuteTransform": lambda: T.PermuteTransform((-1, -2), in_keys=["obs_2d"]),
    "RandomTruncationTransform": lambda: T.RandomTruncationTransform(min_horizon=4, max_horizon=12, prob=0.5),
    "RemoveEmptySpecs": lambda: T.RemoveEmptySpecs(),
    "RenameTransform": lambda: T.RenameTransform(["observation"], ["obs2"], create_copy=True),
    "RewardClipping": lambda: T.RewardClipping(-1.0, 1.0),
    "RewardScaling": lambda: T.RewardScaling(0.0, 0.5),
    "RewardSum": lambda: T.RewardSum(),
    "SelectTransform": lambda: T.SelectTransform("observation", "th", "thdot", "params", "step_count"),
    "SignTransform": lambda: T.SignTransform(in_keys=["reward"]),
    "SqueezeTransform": lambda: T.SqueezeTransform(-1, in_keys=["th"], out_keys=["th_squeezed"]),
    "StepCounter": lambda: T.StepCounter(max_steps=9),
    "TargetReturn": lambda: T.TargetReturn(200.0),
    "TensorDictPrimer": lambda: T.TensorDictPrimer(Composite(memory=Unbounded(3)), default_value=0.0),
    "TerminateTransform": lambda: T.TerminateTransform(lambda td: td["thdot"].abs() > 7),
    "TimeMaxPool": lambda: T.TimeMaxPool(in_keys=["observation"], out_keys=["pooled"], T=3),
    "Timer": lambda: T.Timer(),
    "TrajCounter": lambda: T.TrajCounter(),
    "UnaryTransform": lambda: T.UnaryTransform(["th"], ["th2"], fn=lambda t: t * 2),
    "UnsqueezeTransform": lambda: T.UnsqueezeTransform(-1, in_keys=["observation"], out_keys=["obs_u"]),
    "VecNorm": lambda: T.VecNorm(in_keys=["observation"], decay=0.9),
    "VecNormV2": lambda: T.VecNormV2(in_keys=["observation"], decay=0.9),
    "gSDENoise": lambda: T.gSDENoise(state_dim=2, action_dim=1),
}
TWO_D = {"FlattenObservation", "PermuteTransform"}  # need a 2-d observation ("obs_2d")

PIXELS = "works on pixel observations (Pendulum's are vectors)"
NO_RECIPE: dict[str, str] = {
    "ActionChunkTransform": "executes chunks of actions from a vision-language-action policy",
    "ActionMask": "needs an env that writes an action mask",
    "ActionTokenizerTransform": "needs an action tokenizer (vision-language-action models)",
    "AutoResetTransform": "needs an env that resets itself",
    "BatchSizeTransform": "changes the env's batch size (needs an env built for it)",
    "BurnInTransform": "a replay-buffer transform (recurrent burn-in), not an env's",
    "CenterCrop": PIXELS,
    "ConditionalPolicySwitch": "runs a second policy inside the env (needs one built for the env)",
    "Crop": PIXELS,
    "DecodeVideoTransform": "decodes video observations",
    "DiscreteActionProjection": "needs a discrete-action env",
    "EndOfLifeTransform": "reads Atari's lives counter",
    "FlattenAction": "needs a multi-dimensional action",
    "GrayScale": PIXELS,
    "Hash": "hashes non-tensor observations",
    "MacroPrimitiveTransform": "drives a robot arm's macro primitives",
    "MeanActionSelector": "selects among sampled actions of a planning policy",
    "ModuleTransform": "runs a user module (its state is the module's, registered on its own)",
    "MultiAction": "executes several actions per step from a chunking policy",
    "MultiStepTransform": "a replay-buffer transform (saved with the buffer: tests/test_replay_buffer.py)",
    "NextObservationDelta": "compresses replay-buffer storage",
    "NextStateReconstructor": "a replay-buffer transform",
    "ObservationTransform": "a base class",
    "PinMemoryTransform": "needs CUDA",
    "PolicyAgeFilter": "a replay-buffer transform (policy versions)",
    "R3MTransform": "a pretrained vision model (downloads weights)",
    "RNDTransform": "trains its own networks (their optimiser is outside the transform)",
    "RandomCropTensorDict": "a replay-buffer transform",
    "RayTransform": "runs the transform in a Ray actor",
    "Resize": PIXELS,
    "Reward2GoTransform": "a replay-buffer transform",
    "SatelliteAttitudeTransform": "drives a satellite attitude simulator",
    "Stack": "torchrl 0.14's Collector fails on it before any checkpoint (nested-tensor unsqueeze)",
    "ToTensorImage": PIXELS,
    "SuccessReward": "needs an env that writes a success flag",
    "Tokenizer": "needs transformers",
    "Transform": "the base class",
    "URScriptPrimitiveTransform": "drives a UR robot",
    "VC1Transform": "a pretrained vision model (downloads weights)",
    "VIPRewardTransform": "a pretrained vision model (downloads weights)",
    "VIPTransform": "a pretrained vision model (downloads weights)",
    "VecGymEnvTransform": "needs gym's vectorised envs",
}


def make_env(name: str, seed: int) -> TransformedEnv:
    ts = [
        T.UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
        T.CatTensors(["th", "thdot"], "observation", del_keys=False),
        T.StepCounter(max_steps=25),
    ]
    if name in TWO_D:
        ts.append(T.UnsqueezeTransform(-1, in_keys=["observation"], out_keys=["obs_2d"]))
    env = TransformedEnv(PendulumEnv(), T.Compose(*ts))
    env.append_transform(RECIPES[name]())
    env.set_seed(seed)
    return env


def _checkpoint(collector: Collector) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("collector", collector)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _batches(it: Any, n: int) -> list:
    return [next(it).clone() for _ in range(n)]


def _inexact(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tdcp.InexactResumeWarning)]


def run_case(name: str, directory: Path, after_warm_up: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Save mid-run, continue, restore into a collector built with another seed, continue: what differs.
    ``after_warm_up``: called with the transform under test after the first batches (then one more, then the save)."""
    _seed(0)
    collector = Collector(make_env(name, 0), None, frames_per_batch=10, total_frames=-1)
    it = iter(collector)
    _batches(it, 3)
    if after_warm_up is not None:
        after_warm_up(collector.env.transform[-1])
        _batches(it, 1)
    with warnings.catch_warnings(record=True) as at_save:
        warnings.simplefilter("always")
        path = _checkpoint(collector).save(directory / name)
    saved = state_snapshot(collector, "collector")
    expected = _batches(it, 3)
    collector.shutdown()
    _seed(5)
    fresh = Collector(make_env(name, 99), None, frames_per_batch=10, total_frames=-1)
    with warnings.catch_warnings(record=True) as at_load:
        warnings.simplefilter("always")
        _checkpoint(fresh).load(path)
    restored = state_snapshot(fresh, "collector")
    got = _batches(iter(fresh), 3)
    fresh.shutdown()
    differing = sorted(
        {str(k) for a, b in zip(expected, got) for k in a.keys(True, True) if not torch.equal(a[k], b.get(k))}
    )
    return {
        "batches": differing,
        "audit": state_differences(saved, restored),
        "save_warnings": _inexact(at_save),
        "load_warnings": _inexact(at_load),
    }


def test_every_transform_class_has_a_recipe_or_a_reason() -> None:
    assert len(TRANSFORMS) > 60  # the enumeration found torchrl's transforms
    assert not set(RECIPES) & set(NO_RECIPE)
    assert set(TRANSFORMS) <= set(RECIPES) | set(NO_RECIPE), f"new: {set(TRANSFORMS) - set(RECIPES) - set(NO_RECIPE)}"
    assert EXACT_TRANSFORMS <= set(RECIPES) and set(INEXACT_TRANSFORMS) <= set(RECIPES)  # verified = tested here
    assert set(RECIPES) == EXACT_TRANSFORMS | set(INEXACT_TRANSFORMS)  # every recipe's verdict is recorded


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_transform_is_exact_or_warned_about(tmp_path: Path, name: str) -> None:
    result = run_case(name, tmp_path)
    if name in EXACT_TRANSFORMS:
        assert result["batches"] == [], f"{name}: the batches after the restore differ in {result['batches']}"
        assert result["audit"] == [], f"{name}: the restored collector differs:\n" + "\n".join(
            map(str, result["audit"][:20])
        )
        assert result["save_warnings"] == result["load_warnings"] == []
    else:
        for caught in (result["save_warnings"], result["load_warnings"]):
            assert any(name in message for message in caught), (name, caught)


@pytest.mark.parametrize("name", ["VecNorm", "VecNormV2"])
def test_a_frozen_normalisation_resumes_frozen(tmp_path: Path, name: str) -> None:
    """Probe g4: ``freeze()`` (statistics kept fixed after a warm-up) sets a plain attribute no ``state_dict``
    holds: the restored transform was unfrozen, went on updating its statistics, and the batches differed from the
    first step, silently. It is saved with the transform (``TRANSFORM_ATTRIBUTES``)."""
    result = run_case(name, tmp_path, after_warm_up=lambda transform: transform.freeze())
    assert result == {"batches": [], "audit": [], "save_warnings": [], "load_warnings": []}, result


#: transforms a ``FrameSkipTransform`` cannot follow (torchrl itself fails to step, or it is the one)
FRAME_SKIP_REFUSES = {
    "ActionDiscretizer": "its parent steps the base env with the discrete action (split_with_sizes fails)",
    "FrameSkipTransform": "the transform itself",
}


def _frame_skip_collector(name: str, seed: int) -> Collector:
    _seed(seed)
    env = make_env(name, seed)
    if name not in FRAME_SKIP_REFUSES:
        env.append_transform(T.FrameSkipTransform(2))
        env.set_seed(
            seed
        )  # (seeding reaches the transforms' parents: the copy is made now, as a user's script makes it)
    return Collector(env, None, frames_per_batch=10, total_frames=-1)


def _differing(expected: list, got: list) -> list[str]:
    return sorted(
        {str(k) for a, b in zip(expected, got) for k in a.keys(True, True) if not torch.equal(a[k], b.get(k))}
    )


def frame_skip_case(name: str, directory: Path) -> dict[str, list[str]]:
    """The transform followed by a ``FrameSkipTransform``, which steps through torchrl's cached parent env holding
    *clones* of the transforms before it (``Transform.parent``); a ``VecNormV2`` clone updates statistics of its own.
    Save mid-run, continue; load into a fresh collector (another seed) and back into the same one (a rollback), and
    continue each: which batch entries differ from those after the save."""
    collector = _frame_skip_collector(name, 0)
    it = iter(collector)
    _batches(it, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdcp.InexactResumeWarning)
        ckpt = _checkpoint(collector)
        path = ckpt.save(directory / name)
        expected = _batches(it, 3)
        fresh = _frame_skip_collector(name, 99)
        _checkpoint(fresh).load(path)
        out = {"fresh": _differing(expected, _batches(iter(fresh), 3))}
        ckpt.load(path)  # (the global RNG too: after the fresh collector's batches)
        out["live"] = _differing(expected, _batches(it, 3))
    collector.shutdown()
    fresh.shutdown()
    return out


@pytest.mark.parametrize("name", sorted(EXACT_TRANSFORMS))
def test_an_exact_transform_stays_exact_before_a_frame_skip_fresh_and_rolled_back(tmp_path: Path, name: str) -> None:
    assert frame_skip_case(name, tmp_path) == {"fresh": [], "live": []}, name


@pytest.mark.parametrize("name", sorted(NO_RECIPE))
def test_transform_without_a_recipe_is_not_called_exact(name: str) -> None:
    assert name not in EXACT_TRANSFORMS, f"{name} is called exact but the matrix never ran it"


def test_a_users_transform_is_warned_about_until_declared_exact(tmp_path: Path) -> None:
    class Doubling(T.Transform):  # (no keys: stateless, but nothing says so)
        def _apply_transform(self, obs: torch.Tensor) -> torch.Tensor:
            return obs * 2

    class MyStepCounter(T.StepCounter):  # a subclass of a verified class is not verified
        pass

    def collector() -> Collector:
        env = TransformedEnv(
            SerialEnv(2, lambda: TransformedEnv(PendulumEnv(), MyStepCounter(max_steps=5))),
            Doubling(),
        )
        return Collector(env, None, frames_per_batch=8, total_frames=-1)

    with pytest.warns(tdcp.InexactResumeWarning) as caught:
        _checkpoint(collector()).save(tmp_path / "a")
    message = str(caught[0].message)
    assert "transform (Doubling" in message and "base_env._envs.0.transform (MyStepCounter" in message
    assert "register_exact_transform" in message
    tdcp.adapters.register_exact_transform(Doubling)
    tdcp.adapters.register_exact_transform(MyStepCounter)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        _checkpoint(collector()).save(tmp_path / "b")


def test_stateless_transforms_are_exact_ones() -> None:
    from torchrl_dcp.adapters.env_transforms import STATELESS_TRANSFORMS

    assert STATELESS_TRANSFORMS <= EXACT_TRANSFORMS


def test_a_buffer_transform_holding_state_is_warned_about(tmp_path: Path) -> None:
    """A replay buffer's transforms are not saved with it (but MultiStepTransform's held items): a transform that
    may hold state (VecNormV2's statistics, a user's) is named at save and load; stateless ones are not."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    def buffer(*transforms: Any) -> ReplayBuffer:
        rb = ReplayBuffer(storage=LazyTensorStorage(16), transform=T.Compose(*transforms), batch_size=4)
        rb.extend(TensorDict({"obs": torch.randn(8, 2), "reward": torch.randn(8, 1)}, [8]))
        return rb

    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        tdcp.DistributedCheckpoint(rb=buffer(T.RewardScaling(0.0, 2.0), T.SignTransform(in_keys=["obs"]))).save(
            tmp_path / "quiet"
        )  # (MultiStepTransform's held items are saved: tests/test_replay_buffer.py)
    stateful = buffer(T.RewardScaling(0.0, 2.0), T.VecNormV2(in_keys=["obs"]))
    with pytest.warns(tdcp.InexactResumeWarning, match=r"transform\(s\) at 1 \(VecNormV2\)"):
        path = tdcp.DistributedCheckpoint(rb=stateful).save(tmp_path / "warned")
    with pytest.warns(tdcp.InexactResumeWarning, match="loading"):
        tdcp.DistributedCheckpoint(rb=buffer(T.RewardScaling(0.0, 2.0), T.VecNormV2(in_keys=["obs"]))).load(path)
