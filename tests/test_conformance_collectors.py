"""Conformance matrix: collectors over a single env, SerialEnv and ParallelEnv × stateful transforms.

Each case collects, saves (``Collector`` + ``RNGState``), keeps collecting, then loads into a freshly built collector
(other weights, other env seed) and compares the next batches bit for bit. ParallelEnv keeps its sub-envs in worker
processes: the documented ``UserWarning`` is checked at save and at load instead of exactness.
Multi-process collectors: the trajectory ids continue as in an uninterrupted run.
"""

from __future__ import annotations

import itertools
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
    ObservationNorm,
    ParallelEnv,
    PendulumEnv,
    RewardSum,
    SerialEnv,
    StepCounter,
    TransformedEnv,
    UnsqueezeTransform,
    VecNormV2,
)

import torchrl_dcp as tdcp
from torchrl_dcp.audit import state_differences, state_snapshot

ENVS = ["single", "serial", "serial_inner", "parallel"]  # serial_inner: the transforms inside each sub-env
TRANSFORMS = ["none", "vecnorm", "obsnorm", "rewardsum_stepcounter"]
# ParallelEnv starts and stops 2 worker processes per collector (~50 s per case on 2 cores): one representative
# case (the stateful RewardSum + StepCounter pair) is generated, the other ParallelEnv products are left out
SLOW = {("parallel", "none"), ("parallel", "obsnorm"), ("parallel", "vecnorm")}


def _base() -> PendulumEnv:
    return PendulumEnv()


#: torchrl's VecNormV2.load_state_dict rebuilds its statistics' TensorDicts with batch size [] (the tensors, of the
#: sub-envs' batch shape, are equal): metadata only, left out of the audit
VECNORM_BATCH_SIZES = ("._loc.batch_size", "._var.batch_size", "._count.batch_size")


def _ending(steps: int) -> TransformedEnv:
    """A sub-env whose episodes end every ``steps`` steps: two of them reset apart (partial resets)."""
    return TransformedEnv(_base(), StepCounter(max_steps=steps))


def make_env(kind: str, transforms: str, seed: int) -> TransformedEnv:
    if kind == "serial_inner":  # each sub-env transformed, the SerialEnv itself under an (empty) TransformedEnv
        env = TransformedEnv(SerialEnv(2, lambda: make_env("single", transforms, seed)), Compose())
        env.set_seed(seed)
        return env
    base = {
        "single": _base,
        "serial": lambda: SerialEnv(2, _base),
        "serial_ragged": lambda: SerialEnv(2, [lambda: _ending(3), lambda: _ending(5)]),
        "parallel": lambda: ParallelEnv(2, _base),
    }[kind]()
    ts = [
        UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
        CatTensors(["th", "thdot"], "observation", del_keys=False),
    ]
    if transforms == "vecnorm":
        ts.append(VecNormV2(in_keys=["observation"], decay=0.9))
    elif transforms == "obsnorm":
        ts.append(ObservationNorm(loc=torch.zeros(2) + 0.1, scale=torch.ones(2) * 2, in_keys=["observation"]))
    elif transforms == "rewardsum_stepcounter":
        ts += [StepCounter(max_steps=7), RewardSum()]
    env = TransformedEnv(base, Compose(*ts))
    env.set_seed(seed)
    return env


def make_collector(kind: str, transforms: str, seed: int) -> tuple[TensorDictModule, Collector]:
    torch.manual_seed(seed)
    policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
    collector = Collector(
        make_env(kind, transforms, seed), policy, frames_per_batch=12, total_frames=-1,
        auto_register_policy_transforms=False,
    )  # fmt: skip
    return policy, collector


def checkpoint(policy: TensorDictModule, collector: Collector) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("collector", collector)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def assert_batches_equal(expected: list, got: list) -> None:
    for i, (a, b) in enumerate(zip(expected, got)):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), f"batch {i}: {key} differs after the restore"


# serial_ragged: sub-envs whose episodes end at different steps, so that some reset while the others go on, reading
# their entries from the SerialEnv's shared buffers (lost at a load: the statistics outside drifted, silently)
CASES = [c for c in itertools.product(ENVS, TRANSFORMS) if c not in SLOW] + [("serial_ragged", "vecnorm")]


@pytest.mark.parametrize("kind, transforms", CASES, ids=["-".join(c) for c in CASES])
def test_collector_conformance(tmp_path: Path, kind: str, transforms: str) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    policy, collector = make_collector(kind, transforms, 0)
    it = iter(collector)
    for _ in range(3):
        next(it)
    with torch.no_grad():
        policy.module.weight.add_(0.25)  # a learner update after the collector was built
    ckpt = checkpoint(policy, collector)
    parallel = kind == "parallel"
    with warnings.catch_warnings(record=True) as saved_warnings:
        warnings.simplefilter("always")
        path = ckpt.save(tmp_path / "ckpt")
    saved = state_snapshot(collector, "collector")
    expected = [next(it) for _ in range(4)]
    collector.shutdown()

    policy2, collector2 = make_collector(kind, transforms, 123)  # other weights, other env seed
    with warnings.catch_warnings(record=True) as load_warnings:
        warnings.simplefilter("always")
        checkpoint(policy2, collector2).load(path)
    if not parallel:  # the whole collector audited (a ParallelEnv's sub-envs are in its workers: warned instead)
        differences = [
            d
            for d in state_differences(saved, state_snapshot(collector2, "collector"))
            if not d.path.endswith(VECNORM_BATCH_SIZES)
        ]
        assert not differences, "the restored collector differs:\n" + "\n".join(map(str, differences[:20]))
    it2 = iter(collector2)
    got = [next(it2) for _ in range(4)]
    collector2.shutdown()
    for caught, action in ((saved_warnings, "saving"), (load_warnings, "loading")):
        ours = [w for w in caught if "worker processes" in str(w.message)]
        if parallel:
            assert ours and f"'collector' ({action})" in str(ours[0].message) and "ParallelEnv" in str(ours[0].message)
        else:
            assert not ours
    if not parallel:
        assert_batches_equal(expected, got)


def test_multi_sync_collector_trajectory_ids_continue(tmp_path: Path) -> None:
    def make(seed: int) -> tuple[TensorDictModule, MultiSyncCollector]:
        torch.manual_seed(seed)
        policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
        return policy, MultiSyncCollector(
            [lambda: make_env("single", "none", 0)], policy, frames_per_batch=12,
            total_frames=-1, auto_register_policy_transforms=False,
        )  # fmt: skip

    policy, collector = make(0)
    it = iter(collector)
    for _ in range(3):
        next(it)
    path = tdcp.DistributedCheckpoint(policy=policy).register("collector", collector).save(tmp_path / "ckpt")
    expected = [next(it)["collector", "traj_ids"] for _ in range(3)]
    collector.shutdown()
    policy2, collector2 = make(5)
    tdcp.DistributedCheckpoint(policy=policy2).register("collector", collector2).load(path)
    it2 = iter(collector2)
    got = [next(it2)["collector", "traj_ids"] for _ in range(3)]
    collector2.shutdown()
    for a, b in zip(expected, got):
        assert torch.equal(a, b), f"trajectory ids differ: {a.tolist()} vs {b.tolist()}"


#: torchrl's collector classes (``torchrl.collectors``) and how a checkpoint treats them
COLLECTOR_CLASSES = {
    "Collector": "exact (the matrix above)",
    "MultiSyncCollector": "warned: workers hold the envs (test_multi_sync_collector_trajectory_ids_continue)",
    "MultiAsyncCollector": "warned: workers hold the envs (tests/test_collector_async_save.py)",
    "AsyncCollector": "warned: a MultiAsyncCollector of one worker (below)",
    "AsyncBatchedCollector": "warned: env workers and a policy thread (below)",
    "MultiCollector": "the base class of the multi-process collectors",
    "BaseCollector": "the base class",
}
_REMOTE = (
    "not built here: its workers run on other nodes (launched through {how}); taken as a multi-process collector "
    "(its state_dict, with the warning that the envs live in the workers)"
)
#: ``torchrl.collectors.distributed``: collectors whose workers are launched on other nodes
COLLECTOR_CLASSES.update(
    {
        "DistributedCollector": _REMOTE.format(how="torch.distributed"),
        "DistributedSyncCollector": _REMOTE.format(how="torch.distributed"),
        "RPCCollector": _REMOTE.format(how="torch.distributed.rpc"),
        "RayCollector": _REMOTE.format(how="Ray"),
    }
)


def test_every_collector_class_of_torchrl_is_covered() -> None:
    import inspect

    import torchrl.collectors as collectors
    import torchrl.collectors.distributed as remote

    found = {
        n for package in (collectors, remote) for n in package.__all__
        if inspect.isclass(getattr(package, n)) and issubclass(getattr(package, n), collectors.BaseCollector)
    }  # fmt: skip
    assert {"Collector", "RayCollector"} <= found
    assert found <= set(COLLECTOR_CLASSES), f"new in torchrl: {found - set(COLLECTOR_CLASSES)}"


@pytest.mark.parametrize("kind", ["AsyncCollector", "AsyncBatchedCollector"])
def test_asynchronous_collectors_save_with_a_warning_and_go_on(tmp_path: Path, kind: str) -> None:
    from torchrl.collectors import AsyncBatchedCollector, AsyncCollector

    def env() -> TransformedEnv:
        return make_env("single", "none", 0)

    policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
    if kind == "AsyncCollector":
        collector = AsyncCollector(env, policy, frames_per_batch=16, total_frames=-1)
    else:
        collector = AsyncBatchedCollector([env, env], policy=policy, frames_per_batch=16, total_frames=-1)
    try:
        it = iter(collector)
        next(it)
        with pytest.warns(tdcp.InexactResumeWarning, match=kind):
            tdcp.DistributedCheckpoint(collector=collector).save(tmp_path / "c")
        assert next(it).numel() == 16
    finally:
        collector.shutdown()
