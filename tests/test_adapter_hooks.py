"""A user's own adapter, registered on one checkpoint as api.md documents: its checks run at load as a global
registration's do, a refused load leaves its object untouched (no ``restore`` called), and ``check_values`` reads
the saved value of a tensor the load receives in place."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging


class Box:
    def __init__(self, n: int, t: torch.Tensor) -> None:
        self.n, self.t = n, t


class BoxAdapter(tdcp.Adapter):
    """``n`` counts the used entries of ``t`` (read in place): a state with ``n`` past them is none a save writes,
    and neither is a ``t`` holding a negative entry (its values)."""

    adapter_id = "tests.box"
    version = 1

    def __init__(self) -> None:
        self.calls: list[str] = []

    def state(self, obj: Box, ctx: tdcp.AdapterContext) -> Any:
        return {"n": obj.n, "t": obj.t}

    def restore(self, obj: Box, state: Any, ctx: tdcp.AdapterContext) -> Any:
        self.calls.append("restore")
        obj.n = state["n"]
        if state["t"] is not obj.t:
            obj.t = state["t"]
        return None

    def destinations(self, obj: Box, saved: Any, ctx: tdcp.AdapterContext) -> dict[str, torch.Tensor] | None:
        return {saved["t"].key: obj.t} if tuple(obj.t.shape) == saved["t"].shape else None

    def check_saved(self, saved: Any) -> None:
        self.calls.append("check_saved")
        if not 0 <= saved["n"] <= saved["t"].shape[0]:
            raise ValueError(f"n={saved['n']} outside 0..{saved['t'].shape[0]}")

    def check_values(self, saved: Any, read: Any) -> None:
        self.calls.append("check_values")
        if (read(saved["t"]) < 0).any():
            raise ValueError("a negative entry")


def _saved(tmp_path: Path) -> Path:
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("box", Box(2, torch.arange(4.0)), adapter=BoxAdapter())
    return ckpt.save(tmp_path / "c")


def test_checks_of_an_adapter_registered_on_one_checkpoint_run_at_load(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    forging.edit(path, lambda m: m["components"]["box"]["state"]["items"][0].__setitem__(1, 99))
    adapter, box = BoxAdapter(), Box(1, torch.full((4,), 7.0))
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("box", box, adapter=adapter)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="n=99 outside 0..4"):
        ckpt.load(path)
    assert "check_saved" in adapter.calls and "restore" not in adapter.calls
    assert box.n == 1 and torch.equal(box.t, torch.full((4,), 7.0))


def test_a_load_refused_while_planning_never_restores_the_other_components(tmp_path: Path) -> None:
    adapter, box = BoxAdapter(), Box(1, torch.full((4,), 7.0))
    saved = tdcp.DistributedCheckpoint()
    saved.register("box", Box(2, torch.arange(4.0)), adapter=BoxAdapter())
    saved.register("model", torch.nn.Linear(2, 3))
    path = saved.save(tmp_path / "c")
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 5))  # another shape: refused while planning
    ckpt.register("box", box, adapter=adapter)
    held = box.t
    with pytest.raises(tdcp.CheckpointError):
        ckpt.load(path)
    assert "restore" not in adapter.calls  # nothing changed it: nothing to roll back
    assert box.t is held and torch.equal(box.t, torch.full((4,), 7.0))


def test_check_values_reads_the_saved_value_of_a_tensor_read_in_place(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    adapter, box = BoxAdapter(), Box(1, torch.full((4,), -1.0))  # its live values would fail the check
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("box", box, adapter=adapter)
    held = box.t
    ckpt.load(path)
    assert adapter.calls.index("check_values") < adapter.calls.index("restore")
    assert box.t is held and torch.equal(box.t, torch.arange(4.0)) and box.n == 2

    forged = tmp_path / "forged"
    shutil.copytree(path, forged)
    m = forging.read_parts(forged)
    (entry,) = m["index"]["entries"]
    data = bytearray((forged / entry[1]).read_bytes())
    at = entry[2] + bytes(data[entry[2] : entry[2] + entry[3]]).index(torch.arange(4.0).numpy().tobytes())
    data[at : at + 4] = torch.tensor([-5.0]).numpy().tobytes()
    (forged / entry[1]).write_bytes(bytes(data))
    forging.reseal(forged, entry[1])
    box2 = Box(1, torch.full((4,), 7.0))
    ckpt2 = tdcp.DistributedCheckpoint()
    ckpt2.register("box", box2, adapter=BoxAdapter())
    with pytest.raises(tdcp.CheckpointIntegrityError, match="a negative entry"):
        ckpt2.load(forged)
    assert torch.equal(box2.t, torch.full((4,), 7.0)) and box2.n == 1  # refused before the in-place read


class Refuses:
    """An object whose ``load_state_dict`` raises: the load fails while restoring."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": torch.ones(2)}

    def load_state_dict(self, state: Any) -> None:
        raise RuntimeError("refusing this state")


def test_a_load_failing_while_restoring_rolls_back_a_storage_allocated_while_planning(tmp_path: Path) -> None:
    """A lazy buffer's storage is allocated from the saved shapes while the load is planned: a restore failure
    of another component (before the buffer's turn) put it back uninitialised, and the sampler's trees stayed the
    same objects on a load refused earlier."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    def buffer() -> TensorDictPrioritizedReplayBuffer:
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=2)

    rb = buffer()
    rb.extend(TensorDict({"obs": torch.arange(8.0).reshape(4, 2)}, [4]))
    path = tdcp.DistributedCheckpoint(rb=rb, other=Refuses()).save(tmp_path / "c")
    live = buffer()
    trees = (live._sampler._sum_tree, live._sampler._min_tree)
    with pytest.raises(tdcp.CheckpointError, match="refusing this state"):
        tdcp.DistributedCheckpoint(rb=live, other=Refuses()).load(path)
    assert not live._storage.initialized and len(live) == 0
    assert (live._sampler._sum_tree, live._sampler._min_tree) == trees  # (the same objects)

    wrong = torch.nn.Linear(2, 5)  # refused while planning (another shape): the trees stay the same objects
    tdcp.DistributedCheckpoint(rb=rb, m=torch.nn.Linear(2, 3)).save(tmp_path / "d")
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(rb=live, m=wrong).load(tmp_path / "d")
    assert not live._storage.initialized
    assert live._sampler._sum_tree is trees[0] and live._sampler._min_tree is trees[1]


def test_a_load_refused_part_way_through_planning_rolls_back_what_was_allocated(tmp_path: Path) -> None:
    """A component refused while planning (here a forged inventory) after a lazy buffer was planned: the buffer's
    storage, allocated from the saved shapes, stayed allocated (the plan was never returned to be rolled back)."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    rb.extend(TensorDict({"obs": torch.arange(6.0).reshape(3, 2)}, [3]))
    path = tdcp.DistributedCheckpoint(a_rb=rb, z={"w": torch.ones(3)}).save(tmp_path / "c")

    def forge(m: dict[str, Any]) -> None:
        m["components"]["z"]["inventory"]["replicated/z/w"]["dtype"] = "float64"

    forging.edit(path, forge)
    live = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    with pytest.raises(tdcp.CheckpointError, match="forged|inconsistent"):
        tdcp.DistributedCheckpoint(a_rb=live, z={"w": torch.zeros(3)}).load(path)
    assert not live._storage.initialized


def test_a_refused_load_removes_the_memmap_files_its_planning_made(tmp_path: Path) -> None:
    """A lazy memmap storage with a ``scratch_dir`` is allocated from the saved shapes while planning: a refused load
    left its files there, and torchrl never writes over them, so every later load into that buffer was refused."""
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyMemmapStorage(8, scratch_dir=tmp_path / "src"), batch_size=2)
    rb.extend(TensorDict({"obs": torch.arange(6.0).reshape(3, 2)}, [3]))
    path = tdcp.DistributedCheckpoint(rb=rb, extra={"x": 1}).save(tmp_path / "c")
    scratch = tmp_path / "dst"
    scratch.mkdir()
    (scratch / "notes.txt").write_text("the user's")
    live = ReplayBuffer(storage=LazyMemmapStorage(8, scratch_dir=scratch), batch_size=2)
    with pytest.raises(tdcp.CheckpointError, match="missing"):
        tdcp.DistributedCheckpoint(rb=live, extra={}, missing=torch.nn.Linear(1, 1)).load(path)
    assert not live._storage.initialized
    assert sorted(p.name for p in scratch.iterdir()) == ["notes.txt"]  # what was there stays
    tdcp.DistributedCheckpoint(rb=live, extra={}).load(path)  # a retry loads
    assert torch.equal(live[:]["obs"], rb[:]["obs"])


class AllocatingBoxAdapter(BoxAdapter):
    """Planning changes its object (``allocates_when_planned``, as a lazily built storage's) and its rollback fails."""

    allocates_when_planned = True

    def __init__(self, refuse_in: str) -> None:
        super().__init__()
        self.refuse_in = refuse_in

    def destinations(self, obj: Box, saved: Any, ctx: tdcp.AdapterContext) -> dict[str, torch.Tensor] | None:
        obj.n = -1  # what planning changed (after the snapshot)
        if self.refuse_in == "destinations":
            raise tdcp.IncompatibleComponentError("refused while planning")
        return super().destinations(obj, saved, ctx)

    def check_values(self, saved: Any, read: Any) -> None:
        if self.refuse_in == "check_values":
            raise ValueError("refused after planning")

    def rollback(self, obj: Box, snapshot: Any, ctx: tdcp.AdapterContext) -> None:
        raise OSError("the rollback failed too")


@pytest.mark.parametrize("refuse_in", ["destinations", "check_values"])
def test_a_rollback_that_fails_after_a_refused_plan_is_reported(tmp_path: Path, refuse_in: str) -> None:
    """A load refused while planning (or checking values read into fresh buffers) rolls back what planning changed;
    a rollback that itself fails is named in the error, as the restore's failures are, never passed over."""
    path = _saved(tmp_path)
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("box", Box(1, torch.full((4,), 7.0)), adapter=AllocatingBoxAdapter(refuse_in))
    with pytest.raises(tdcp.CheckpointError, match=r"could not roll back 'box' \(OSError: the rollback failed too\)"):
        ckpt.load(path)


class HalfwayBoxAdapter(BoxAdapter):
    """A restore that fails half-way, and a rollback that fails too."""

    def restore(self, obj: Box, state: Any, ctx: tdcp.AdapterContext) -> Any:
        obj.n = 12345
        raise AttributeError("restore failed halfway")

    def rollback(self, obj: Box, snapshot: Any, ctx: tdcp.AdapterContext) -> None:
        raise RuntimeError("the rollback failed too")


@pytest.mark.parametrize("strict", ["warn", "ignore"])
def test_a_rollback_that_fails_under_strict_warn_or_ignore_is_reported(tmp_path: Path, strict: str) -> None:
    """Only ``strict="error"`` named a failed rollback: under ``"warn"`` and ``"ignore"`` the result said "could not
    be restored", and the object was left half-restored without a word."""
    import warnings

    path = _saved(tmp_path)
    ckpt = tdcp.DistributedCheckpoint(strict=strict)
    box = Box(1, torch.full((4,), 7.0))
    ckpt.register("box", box, adapter=HalfwayBoxAdapter())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ckpt.load(path)
    said = "could not roll back 'box' (RuntimeError: the rollback failed too)"
    assert said in result.incompatible["box"], result.incompatible
    assert (strict == "warn") == any(said in str(w.message) for w in caught)


class CheckFailingBoxAdapter(BoxAdapter):
    adapter_id = "tests.check_failing_box"

    def check_saved(self, saved: Any) -> None:
        raise RuntimeError("adapter bug")


def test_an_adapter_whose_check_of_the_saved_state_fails_is_named(tmp_path: Path) -> None:
    """A ``check_saved`` raising anything but ``ValueError``/``TypeError``/``KeyError`` gave "validating the
    checkpoint failed: RuntimeError: adapter bug", naming no checkpoint and no component."""
    ckpt = tdcp.DistributedCheckpoint(no_dist=True)
    box = Box(1, torch.full((4,), 7.0))
    ckpt.register("box", box, adapter=CheckFailingBoxAdapter())
    path = ckpt.save(tmp_path / "c")
    expected = r"component 'box': its adapter \(tests.check_failing_box\) failed checking the saved state"
    with pytest.raises(tdcp.CheckpointError, match=expected + r" \(RuntimeError: adapter bug\)") as err:
        ckpt.load(path)
    assert err.value.path == str(path) and box.n == 1
