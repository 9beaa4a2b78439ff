"""A failed load changes nothing: a failure injected into every phase leaves every registered object bit for bit.

The objects are the state of a small RL job: a policy, its Adam optimizer (with
state), an LR scheduler, a prioritized replay buffer (filled, in the middle of its
ring), a plain dict, a TensorDict, a ``torch.Generator`` and the global RNG streams.
They are saved, then changed (training continues), fingerprinted, and a load is
made to fail at each phase: opening, the manifest, planning (an incompatible
component, a buffer too small for the saved rows), verification (a damaged file),
reading, restoring each component (first, middle, last) and reading in place. After
each failure, every object must have exactly the fingerprint it had before.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import base as adapter_base
from torchrl_dcp.adapters.json import JSONAdapter
from torchrl_dcp.adapters.modules import ModuleAdapter
from torchrl_dcp.adapters.optimizer import OptimizerAdapter
from torchrl_dcp.adapters.replay_buffer import ReplayBufferAdapter
from torchrl_dcp.adapters.rng import GeneratorAdapter, RNGStateAdapter
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.adapters.tensordict import TensorDictAdapter
from torchrl_dcp.storage import reader as reader_module

CAPACITY = 24


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def make_job(seed: int, capacity: int = CAPACITY) -> dict[str, Any]:
    seed_all(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(capacity), sampler=PrioritizedSampler(capacity, alpha=0.7, beta=0.5), batch_size=4
    )
    gen = torch.Generator().manual_seed(seed)
    job = {
        "policy": policy,
        "optim": optim,
        "sched": sched,
        "buffer": rb,
        "stats": {"episodes": seed, "tag": f"run-{seed}"},
        "td": TensorDict({"obs": torch.randn(4, 3)}, [4]),
        "gen": gen,
        "rng": tdcp.RNGState(),
    }
    train(job, steps=3)
    return job


def train(job: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        data = TensorDict({"obs": torch.randn(10, 3), "reward": torch.randn(10, 1)}, [10])
        job["buffer"].extend(data)
        batch = job["buffer"].sample()
        loss = job["policy"](batch["obs"]).pow(2).mean()
        job["optim"].zero_grad()
        loss.backward()
        job["optim"].step()
        job["sched"].step()
        job["buffer"].update_priority(batch["index"], torch.rand(4) + 0.1)
        job["stats"]["episodes"] += 1
        job["td"]["obs"].add_(1)
        torch.rand(1, generator=job["gen"])
        random.random(), np.random.rand()


def checkpoint(job: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint()
    for name, value in job.items():
        ckpt.register(name, value, placement="per_rank" if name in ("buffer", "gen", "rng") else None)
    return ckpt


def fingerprint(job: dict[str, Any]) -> dict[str, Any]:
    """Bit-level copies of everything a load could change (buffer rows compared where they are filled)."""
    rb = job["buffer"]
    storage, sampler = rb._storage, rb._sampler
    n = len(rb)
    rows = storage._storage[:n].to_dict() if storage.initialized else None
    return {
        "policy": {k: v.clone() for k, v in job["policy"].state_dict().items()},
        "optim": _clone(job["optim"].state_dict()),
        "sched": _clone(job["sched"].state_dict()),
        "buffer": {
            "len": n,
            "rows": _clone(rows),
            "sum": sampler._sum_tree[torch.arange(CAPACITY)],
            "min": sampler._min_tree[torch.arange(CAPACITY)],
            "max": _clone(sampler._max_priority),
            "cursor": rb._writer._cursor,
        },
        "stats": dict(job["stats"]),
        "td": job["td"]["obs"].clone(),
        "gen": job["gen"].get_state(),
        "rng": (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()),
    }


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    return v


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads compare too)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8) if t.numel() else t


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = make_job(1)
    path = tmp_path_factory.mktemp("phases") / "ckpt"
    return checkpoint(job).save(path, step=3)


def fails_unchanged(job: dict[str, Any], load: Any) -> tdcp.CheckpointError:
    before = fingerprint(job)
    with pytest.raises(tdcp.CheckpointError) as info:
        load()
    after = fingerprint(job)
    changed = [k for k in before if not same(before[k], after[k])]
    assert not changed, f"a failed load changed {changed}: {info.value}"
    return info.value


# ---------------------------------------------------------------------- phases before restore
def test_open_a_missing_checkpoint(tmp_path: Path) -> None:
    job = make_job(2)
    fails_unchanged(job, lambda: checkpoint(job).load(tmp_path / "absent"))


def test_manifest_that_is_not_json(saved: Path, tmp_path: Path) -> None:
    import shutil

    path = Path(shutil.copytree(saved, tmp_path / "c"))
    (path / "manifest.json").write_text("{not json")
    job = make_job(2)
    fails_unchanged(job, lambda: checkpoint(job).load(path))


def test_plan_refuses_an_incompatible_component(saved: Path) -> None:
    job = make_job(2)
    job["policy"] = torch.nn.Sequential(torch.nn.Linear(3, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    err = fails_unchanged(job, lambda: checkpoint(job).load(saved))
    assert "policy" in str(err)


def test_plan_refuses_a_buffer_too_small_for_the_saved_rows(saved: Path) -> None:
    job = make_job(2, capacity=CAPACITY)
    small = TensorDictReplayBuffer(
        storage=LazyTensorStorage(8), batch_size=4
    )  # a fresh, lazy buffer: allocated by planning
    job_small = dict(job, buffer=small)
    before_init = small._storage.initialized
    with pytest.raises(tdcp.CheckpointError, match="capacity|room|sampler"):
        checkpoint(job_small).load(saved)
    assert small._storage.initialized == before_init
    fails_unchanged(job, lambda: checkpoint(dict(job, buffer=small)).load(saved))


def test_a_damaged_file_is_refused_before_anything_changes(saved: Path, tmp_path: Path) -> None:
    import shutil

    path = Path(shutil.copytree(saved, tmp_path / "c"))
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    job = make_job(2)
    fails_unchanged(job, lambda: checkpoint(job).load(path))


def test_a_read_failure_changes_nothing(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(reader_module.InPlaceFileSystemReader, "read_items", broken)
    job = make_job(2)
    fails_unchanged(job, lambda: checkpoint(job).load(saved))


# ---------------------------------------------------------------------- restore
ADAPTERS = {
    "policy": ModuleAdapter,
    "optim": OptimizerAdapter,
    "sched": StateDictAdapter,
    "stats": JSONAdapter,
    "td": TensorDictAdapter,
    "gen": GeneratorAdapter,
    "rng": RNGStateAdapter,  # restored last of all
}


IN_PLACE = {"policy", "optim", "buffer", "td"}  # read straight into the live tensors after verification


@pytest.mark.parametrize("failing", sorted(ADAPTERS))
def test_a_failing_restore_rolls_every_component_back(
    saved: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The restore of one component fails (first, middle or last): every other one is rolled back.

    Components read into fresh buffers are restored before the in-place read, so their failure leaves
    every object as it was. A component read in place (the policy, the stepped optimizer's state, the
    buffer's rows) is restored after that read: its failure leaves the tensors read in place loaded
    (documented, named in the error), and everything else rolled back.
    """
    cls = ADAPTERS[failing]
    original = cls.restore
    calls = {"n": 0}

    def restore(self: Any, obj: Any, state: Any, ctx: Any) -> Any:
        if ctx.name == failing and calls["n"] == 0:
            calls["n"] += 1
            original(self, obj, state, ctx)  # changes the object half-way, then fails
            raise RuntimeError(f"injected failure restoring {failing}")
        return original(self, obj, state, ctx)

    monkeypatch.setattr(cls, "restore", restore)
    job = make_job(2)
    before = fingerprint(job)
    with pytest.raises(tdcp.CheckpointError) as info:
        checkpoint(job).load(saved)
    assert failing in str(info.value)
    after = fingerprint(job)
    changed = {k for k in before if not same(before[k], after[k])}
    if failing in IN_PLACE:
        assert changed <= IN_PLACE and "keep the loaded values" in str(info.value), (changed, info.value)
        assert not changed - IN_PLACE
    else:
        assert changed == set(), f"a failed load changed {changed}: {info.value}"


def test_a_failing_in_place_read_rolls_the_rest_back(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final in-place read (buffer rows) fails: everything but the rows already read is rolled back."""
    from torchrl_dcp import load_engine

    original = load_engine.read
    calls = {"n": 0}

    def read(src: Any, request: Any, tensors: Any, verify: Any, result: Any, *rest: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second read is the in-place one
            raise tdcp.CheckpointError("injected I/O failure")
        original(src, request, tensors, verify, result, *rest)

    monkeypatch.setattr(load_engine, "read", read)
    job = make_job(2)
    before = fingerprint(job)
    with pytest.raises(tdcp.CheckpointError, match="partly loaded"):
        checkpoint(job).load(saved)
    after = fingerprint(job)
    before["buffer"].pop("rows"), after["buffer"].pop("rows")
    assert [k for k in before if not same(before[k], after[k])] == []


def test_a_failing_buffer_restore_rolls_back_its_settings(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = ReplayBufferAdapter.restore

    def restore(self: Any, rb: Any, state: Any, ctx: Any) -> Any:
        original(self, rb, state, ctx)
        raise RuntimeError("injected failure restoring the buffer")

    monkeypatch.setattr(ReplayBufferAdapter, "restore", restore)
    job = make_job(2)
    before = fingerprint(job)
    with pytest.raises(tdcp.CheckpointError, match="buffer"):
        checkpoint(job).load(saved)
    after = fingerprint(job)
    before["buffer"].pop("rows"), after["buffer"].pop("rows")  # read in place (documented)
    for name in ("policy", "optim", "td"):  # read in place too, before the buffer's restore failed (documented)
        before.pop(name), after.pop(name)
    assert [k for k in before if not same(before[k], after[k])] == []  # the buffer's length, trees, cursor too


def test_a_successful_load_after_failures_is_exact(saved: Path) -> None:
    """After all that, a load that succeeds restores the saved state exactly (continuation identical)."""
    reference = make_job(1)
    job = make_job(2)
    checkpoint(job).load(saved)
    seed_all(7)
    train(reference, 2)
    seed_all(7)
    train(job, 2)
    a, b = fingerprint(reference), fingerprint(job)
    assert [k for k in a if not same(a[k], b[k])] == []


def test_strict_warn_rolls_back_only_the_failing_component(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = StateDictAdapter.restore

    def restore(self: Any, obj: Any, state: Any, ctx: Any) -> Any:
        original(self, obj, state, ctx)
        raise RuntimeError("injected")

    monkeypatch.setattr(StateDictAdapter, "restore", restore)
    job = make_job(2)
    before = fingerprint(job)
    with pytest.warns(UserWarning, match="sched"):
        result = checkpoint(job).load(saved, strict="warn")
    assert "sched" in result.incompatible and "policy" in result.loaded
    assert same(fingerprint(job)["sched"], before["sched"])


def test_default_snapshot_is_a_deep_copy() -> None:
    m = torch.nn.Linear(2, 2)
    snap = adapter_base.Adapter.snapshot(ModuleAdapter(), m, tdcp.AdapterContext("m"))
    with torch.no_grad():
        m.weight.add_(1)
    assert not torch.equal(snap["weight"], m.weight)
    assert json.dumps(sorted(snap)) == '["bias", "weight"]'


def test_a_module_not_read_in_place_is_rolled_back(tmp_path: Path) -> None:
    """A module with nothing read in place (its state is extra state, handed to ``set_extra_state``) is restored
    with the fresh components, by a copy: a later failure rolls it back. (This test loaded a float64 checkpoint into
    a float32 module, copied with a cast: a load now refuses another dtype while planning, see
    tests/test_adapters_meta_dtype.py.)"""
    calls: list[str] = []

    class Counter:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def state_dict(self) -> dict[str, int]:
            return {"n": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            if self.fail:
                raise RuntimeError("injected")

    class WithStats(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stats = torch.zeros(4)

        def get_extra_state(self) -> dict[str, torch.Tensor]:
            return {"stats": self.stats.clone()}

        def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
            calls.append("set")
            self.stats = state["stats"].clone()

    source = WithStats()
    source.stats = torch.arange(4.0)
    saving = tdcp.DistributedCheckpoint(model=source)
    saving.register("counter", Counter(False))
    path = saving.save(tmp_path / "c")
    model = WithStats()
    loading = tdcp.DistributedCheckpoint(model=model)
    loading.register("counter", Counter(True))
    calls.clear()
    with pytest.raises(tdcp.CheckpointError, match="counter"):
        loading.load(path)
    assert calls == ["set", "set"]  # restored, then rolled back
    assert torch.equal(model.stats, torch.zeros(4))
    loading.unregister("counter")
    loading.load(path, components=["model"])  # and the copy works
    assert torch.equal(model.stats, torch.arange(4.0))


@pytest.mark.parametrize("mismatch", ["fewer_groups", "other_params_per_group"])
def test_an_optimizer_with_other_param_groups_is_refused_while_planning(tmp_path: Path, mismatch: str) -> None:
    """A common mistake (the optimizer rebuilt with other parameter groups) is refused before anything is read:
    the module, read in place, keeps its values, and the message says what to build."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam([{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.1}])
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = tdcp.DistributedCheckpoint(policy=net, optim=opt).save(tmp_path / "c")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in fresh.parameters()]
    if mismatch == "fewer_groups":
        other = torch.optim.Adam(fresh.parameters())
    else:
        other = torch.optim.Adam([{"params": [fresh[0].weight]}, {"params": [fresh[0].bias, *fresh[1].parameters()]}])
    with pytest.raises(tdcp.IncompatibleComponentError, match="build the optimizer|build it with") as info:
        tdcp.DistributedCheckpoint(policy=fresh, optim=other).load(path)
    assert "'optim'" in str(info.value) and "could not be restored" not in str(info.value)  # planned, not restored
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


def test_saved_components_that_nothing_is_registered_for_are_named_in_a_warning(tmp_path: Path) -> None:
    """A component registered only after the first save (IQL/CQL register their buffer lazily) would otherwise
    resume from nothing without a word; naming ``components=`` says the subset is wanted."""
    import warnings

    path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), buffer={"rows": torch.ones(3)}).save(tmp_path / "c")
    with pytest.warns(tdcp.UnrestoredComponentWarning, match=r"\['buffer'\].*register them"):
        result = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2)).load(path)
    assert result.unrequested == {"buffer"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.UnrestoredComponentWarning)
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), buffer={}).load(path, components=["policy"])
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), buffer={}).load(path)


def test_a_failed_load_leaves_the_global_random_streams_as_they_were(tmp_path) -> None:
    """A component's own load_state_dict draws random numbers, then fails: the load rolls the objects back, and the
    streams too (they are the process's state, registered or not)."""
    import random

    import numpy as np

    class Draws:
        def __init__(self) -> None:
            self.value = torch.zeros(3)

        def state_dict(self) -> dict:
            return {"value": self.value}

        def load_state_dict(self, state: dict) -> None:
            torch.rand(5), random.random(), np.random.rand()  # e.g. a re-initialisation before the check
            if not torch.equal(state["value"], state["value"].abs()):
                raise ValueError("negative values")
            self.value = state["value"]

    obj = Draws()
    obj.value = -torch.ones(3)
    path = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2), obj=obj).save(tmp_path / "c")
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2), obj=Draws())
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(tdcp.IncompatibleComponentError, match="negative values"):
        ckpt.load(path)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
