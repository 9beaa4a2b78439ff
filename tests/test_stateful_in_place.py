"""Objects with ``state_dict``/``load_state_dict`` (the generic adapter, DCP's ``Stateful``) are read in place.

A load reads the saved bytes straight into the tensors ``state_dict()`` returns where that leaves the object as a
restore from fresh tensors would (``torchrl_dcp/adapters/state_dict.py``); elsewhere it reads into fresh tensors.
Each test compares with what ``load_state_dict`` of the saved state does, and checks which tensors it was given.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import AdapterContext, StateDictAdapter
from torchrl_dcp.adapters.json import JSONAdapter
from torchrl_dcp.format.codec import TensorSpec


class Holder:
    """``state_dict()`` returns its own tensors (and values); ``load_state_dict`` copies into them, strictly."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.received: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.keys() != self.state.keys():
            raise KeyError(f"keys differ: {sorted(sd)} vs {sorted(self.state)}")
        self.received = dict(sd)
        for k, v in sd.items():
            if isinstance(self.state[k], torch.Tensor):
                self.state[k].copy_(v)
            else:
                self.state[k] = v


class Copies(Holder):
    """``state_dict()`` returns copies of its tensors."""

    def state_dict(self) -> dict[str, Any]:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.state.items()}


class Assigns:
    """``load_state_dict`` keeps the tensors it is given; nested state with lists and non-tensor values."""

    def __init__(self) -> None:
        self.inner = {"w": torch.zeros(3), "hist": [torch.zeros(2, dtype=torch.int32), 0], "name": "a"}
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner, "count": self.count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner, self.count = sd["inner"], sd["count"]


def mixed_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(4, 3, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "bf16": torch.randn(6, generator=g).to(torch.bfloat16),
        "i32": torch.randint(0, 100, (7,), generator=g, dtype=torch.int32),
        "mask": torch.rand(8, generator=g) > 0.5,
        "steps": seed,
        "tag": f"run-{seed}",
    }


def saved_and_fresh(tmp_path: Path, make: Any) -> tuple[Path, Any, Any]:
    saved = make(1)
    path = tdcp.DistributedCheckpoint(obj=saved).save(tmp_path / "c")
    return path, saved, make(2)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and torch.equal(v, w)):
                return False
        elif v != w:
            return False
    return True


def test_own_tensors_are_read_in_place(tmp_path: Path) -> None:
    path, saved, obj = saved_and_fresh(tmp_path, lambda s: Holder(mixed_state(s)))
    own = {k: v for k, v in obj.state.items() if isinstance(v, torch.Tensor)}
    result = tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert result.loaded == {"obj"}
    assert same_state(obj.state, saved.state)
    for k, t in own.items():  # load_state_dict was given the object's own tensors, filled in place
        assert obj.received[k] is t and obj.state[k] is t
    assert obj.received["steps"] == 1 and obj.received["tag"] == "run-1"


def test_copies_are_read_fresh_and_loaded(tmp_path: Path) -> None:
    path, saved, obj = saved_and_fresh(tmp_path, lambda s: Copies(mixed_state(s)))
    own = obj.state["f32"]
    tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert same_state(obj.state, saved.state) and obj.state["f32"] is own


def test_a_failing_object_returning_copies_leaves_the_modules_read_in_place_unchanged(tmp_path: Path) -> None:
    """Its restore runs before the in-place read (as every component read into fresh tensors): when it fails, the
    module's weights, which would be read in place after it, are still as they were."""

    class Fails(Copies):
        def load_state_dict(self, sd: dict[str, Any]) -> None:
            super().load_state_dict(sd)
            raise RuntimeError("injected")

    policy = torch.nn.Linear(300, 300)
    path = tdcp.DistributedCheckpoint(obj=Copies(mixed_state(1)), policy=policy).save(tmp_path / "c")
    fresh = torch.nn.Linear(300, 300)
    obj = Fails(mixed_state(2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(tdcp.CheckpointError, match="injected"):
        tdcp.DistributedCheckpoint(obj=obj, policy=fresh).load(path)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert obj.state["steps"] == 2


def test_nested_state_and_an_assigning_load_state_dict(tmp_path: Path) -> None:
    saved = Assigns()
    saved.inner = {"w": torch.arange(3.0), "hist": [torch.tensor([4, 5], dtype=torch.int32), 7], "name": "b"}
    saved.count = 9
    path = tdcp.DistributedCheckpoint(obj=saved).save(tmp_path / "c")
    obj = Assigns()
    w, hist = obj.inner["w"], obj.inner["hist"][0]
    tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert obj.count == 9 and obj.inner["name"] == "b" and obj.inner["hist"][1] == 7
    assert torch.equal(obj.inner["w"], torch.arange(3.0)) and obj.inner["w"] is w  # read where it was
    assert torch.equal(obj.inner["hist"][0], torch.tensor([4, 5], dtype=torch.int32)) and obj.inner["hist"][0] is hist


def expected_by_fresh_read(path: Path, obj: Any) -> Any:
    """What a restore from fresh tensors leaves (the adapter told never to read in place)."""
    tdcp.DistributedCheckpoint().register("obj", obj, adapter=StateDictAdapter(in_place=False)).load(path)
    return obj


def test_in_place_false_reads_fresh_tensors(tmp_path: Path) -> None:
    path, saved, obj = saved_and_fresh(tmp_path, lambda s: Holder(mixed_state(s)))
    own = obj.state["f32"]
    expected_by_fresh_read(path, obj)
    assert same_state(obj.state, saved.state) and obj.received["f32"] is not own


@pytest.mark.parametrize(
    "case",
    ["one tensor twice", "aliased when saved only", "overlapping views", "non-contiguous", "other dtype", "grad_fn"],
)
def test_unsafe_destinations_are_read_fresh_with_the_same_result(tmp_path: Path, case: str) -> None:
    def make(seed: int, saving: bool) -> Holder:
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(4, 6, generator=g)
        if case == "one tensor twice":
            state = {"a": base, "b": base}
        elif case == "aliased when saved only":
            state = {"a": base, "b": base if saving else base.clone()}
        elif case == "overlapping views":
            flat = base.reshape(-1)
            state = {"a": flat[:16], "b": flat[8:]}
        elif case == "non-contiguous":  # (with gaps: a transposed or channels-last one is read in place)
            state = {"a": base if saving else torch.zeros(base.shape[0], 2 * base.shape[1])[:, ::2]}
        elif case == "other dtype":
            state = {"a": base if saving else base.double()}
        else:
            leaf = base.clone().requires_grad_(True)
            state = {"a": base if saving else leaf * 1}
        return Holder(state)

    path = tdcp.DistributedCheckpoint(obj=make(1, True)).save(tmp_path / "c")
    obj, ref = make(2, False), make(2, False)
    before = {k: v for k, v in obj.state.items()}
    with torch.no_grad() if case == "grad_fn" else _nothing():
        tdcp.DistributedCheckpoint(obj=obj).load(path)
        expected_by_fresh_read(path, ref)
    assert same_state(obj.state, ref.state)
    if case == "one tensor twice":  # read once, in place, and the object still holds one tensor
        assert obj.received["a"] is before["a"] and obj.state["a"] is obj.state["b"]
    else:
        assert all(obj.received[k] is not before[k] for k in ("a", "b") if k in before)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def test_which_tensors_are_destinations() -> None:
    ctx = AdapterContext("x")
    live = {"w": torch.zeros(3), "v": torch.zeros(3), "n": 1, "sub": {"u": torch.zeros(2)}}
    spec = {k: TensorSpec(k, (3,), torch.float32, "cpu") for k in ("w", "v")}
    saved = {**spec, "n": 4, "sub": {"u": TensorSpec("sub/u", (2,), torch.float32, "cpu")}}
    from torchrl_dcp.adapters.in_place import in_place_tensors

    assert set(in_place_tensors(live, saved, ctx)) == {"w", "v", "sub/u"}
    assert in_place_tensors({**live, "extra": 1}, saved, ctx) == {}  # other keys: load_state_dict may refuse them
    assert in_place_tensors({**live, "sub": {}}, saved, ctx) == {}
    meta = {**live, "w": torch.zeros(3, device="meta")}
    assert set(in_place_tensors(meta, saved, ctx)) == {"v", "sub/u"}  # not on the device the saved one maps to
    inference = torch.inference_mode()(lambda: torch.zeros(3))()
    assert set(in_place_tensors({**live, "v": inference}, saved, ctx)) == {"w", "sub/u"}
    empty = {"w": torch.zeros(0)}
    assert in_place_tensors(empty, {"w": TensorSpec("w", (0,), torch.float32, "cpu")}, ctx) == {}


def test_a_keys_mismatch_is_refused_by_load_state_dict_and_changes_nothing(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(obj=Holder(mixed_state(1))).save(tmp_path / "c")
    obj = Holder({**mixed_state(2), "extra": torch.ones(2)})
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in obj.state.items()}
    with pytest.raises(tdcp.CheckpointError, match="keys differ"):
        tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert same_state(obj.state, before)


def test_a_failing_restore_of_another_component_leaves_it_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tdcp.DistributedCheckpoint(obj=Holder(mixed_state(1)), stats={"n": 1}).save(tmp_path / "c")
    obj = Holder(mixed_state(2))
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in obj.state.items()}

    def fail(self: Any, value: Any, state: Any, ctx: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(JSONAdapter, "restore", fail)
    with pytest.raises(tdcp.CheckpointError, match="stats"):
        tdcp.DistributedCheckpoint(obj=obj, stats={"n": 2}).load(path)
    assert same_state(obj.state, before)


def test_a_damaged_file_leaves_it_unchanged(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(obj=Holder(mixed_state(1))).save(tmp_path / "c")
    obj = Holder(mixed_state(2))
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in obj.state.items()}
    data = max(
        (p for p in Path(path).rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert same_state(obj.state, before)


def test_its_own_failing_load_state_dict_rolls_back_the_values_and_says_so(tmp_path: Path) -> None:
    class Failing(Holder):
        fail = True

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            super().load_state_dict(sd)
            if Failing.fail:
                Failing.fail = False
                raise RuntimeError("injected after the in-place read")

    path = tdcp.DistributedCheckpoint(obj=Holder(mixed_state(1))).save(tmp_path / "c")
    obj = Failing(mixed_state(2))
    with pytest.raises(tdcp.CheckpointError, match="keep the loaded values"):
        tdcp.DistributedCheckpoint(obj=obj).load(path)
    assert obj.state["steps"] == 2 and obj.state["tag"] == "run-2"  # rolled back; its tensors hold loaded values


def test_the_snapshot_keeps_tensors_read_in_place_by_reference(tmp_path: Path) -> None:
    obj = Holder({"w": torch.zeros(4), "odd": torch.zeros(2, 8)[:, ::2], "n": [1, 2]})  # (not dense: read fresh)
    adapter, ctx = StateDictAdapter(), AdapterContext("obj")
    saved = {
        "w": TensorSpec("w", (4,), torch.float32, "cpu"),
        "odd": TensorSpec("odd", (2, 4), torch.float32, "cpu"),
        "n": [1, 2],
    }
    adapter.validate(obj, {0: saved}, ctx)
    snap = adapter.snapshot(obj, ctx)
    assert snap["w"] is obj.state["w"]  # read in place: kept by reference
    assert snap["odd"] is not obj.state["odd"] and torch.equal(snap["odd"], obj.state["odd"])  # copied
    assert snap["n"] == [1, 2] and snap["n"] is not obj.state["n"]
    assert set(adapter.destinations(obj, saved, ctx) or {}) == {"w"}


def test_rng_streams_stay_as_saved_when_load_state_dict_draws_random_numbers(tmp_path: Path) -> None:
    class Draws(Holder):
        def load_state_dict(self, sd: dict[str, Any]) -> None:
            super().load_state_dict(sd)
            torch.rand(3), random.random(), np.random.rand()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    rng = tdcp.RNGState()
    path = tdcp.DistributedCheckpoint(obj=Draws({"w": torch.ones(3)}), rng=rng).save(tmp_path / "c")
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    obj = Draws({"w": torch.zeros(3)})
    tdcp.DistributedCheckpoint(obj=obj, rng=tdcp.RNGState()).load(path)
    got = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(obj.state["w"], torch.ones(3))
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_torchrl_global_rng_state_is_not_read_in_place() -> None:
    from torchrl_dcp.adapters.rng import TorchrlGlobalRNGAdapter

    adapter, ctx = TorchrlGlobalRNGAdapter(), AdapterContext("rng")
    obj = Holder({"w": torch.zeros(3)})
    adapter.validate(obj, {0: {"w": TensorSpec("w", (3,), torch.float32, "cpu")}}, ctx)
    assert adapter.destinations(obj, {}, ctx) is None


def test_overlapping_tensors_are_all_left_out() -> None:
    from torchrl_dcp.adapters.in_place import _without_overlaps

    flat, other = torch.zeros(10), torch.zeros(3)
    found = _without_overlaps({"a": flat[0:10], "b": flat[2:4], "c": flat[6:8], "d": other})
    assert set(found) == {"d"}
    assert set(_without_overlaps({"a": flat[0:5], "b": flat[5:10]})) == {"a", "b"}  # adjacent, not overlapping
