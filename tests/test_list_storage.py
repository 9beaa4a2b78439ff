"""List storages (``ReplayBuffer()``'s default ``ListStorage``, and ``LazyStackStorage``): every kind of transition
torchrl can sample from them resumes bit for bit, over samplers × fill levels × directory/archive; objects that need
pickle are refused at save time, naming the transition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.data import (
    LazyStackStorage,
    ListStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)

import torchrl_dcp as tdcp

CAPACITY = 12


def _td(i: int) -> TensorDict:
    g = torch.Generator().manual_seed(i)
    return TensorDict({"obs": torch.randn(3, generator=g), "next": {"reward": torch.randn(1, generator=g)}}, [])


def _ragged(i: int) -> TensorDict:  # what LazyStackStorage is for: transitions of different lengths
    return TensorDict({"obs": torch.arange(float(i % 3 + 1)), "id": torch.tensor(i)}, [])


ITEMS = {
    "tensordict": _td,
    "tuple": lambda i: (torch.full((2,), float(i)), torch.tensor(i % 4)),
    "tensor": lambda i: torch.arange(3.0) + i,
    "dict": lambda i: {"obs": torch.full((2,), float(i)), "mask": torch.tensor(i % 2 == 0)},
}
SAMPLERS = {
    "random": RandomSampler,
    "without_replacement": SamplerWithoutReplacement,
    "prioritized": lambda: PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
}
CASES = [("list", kind) for kind in ITEMS] + [("lazy_stack", "ragged")]


def _buffer(storage: str, kind: str, sampler: str) -> ReplayBuffer:
    store = ListStorage(CAPACITY) if storage == "list" else LazyStackStorage(CAPACITY)
    cls = TensorDictReplayBuffer if kind in ("tensordict", "ragged") else ReplayBuffer
    return cls(storage=store, sampler=SAMPLERS[sampler](), batch_size=3)


def _items(kind: str, start: int, n: int) -> list[Any]:
    make = _ragged if kind == "ragged" else ITEMS[kind]
    return [make(i) for i in range(start, start + n)]


def _extend(rb: ReplayBuffer, kind: str, start: int, n: int) -> Any:
    items = _items(kind, start, n)
    if kind == "tensordict":
        return rb.extend(torch.stack(items))
    if kind == "ragged":
        return rb.extend(lazy_stack(items))
    return rb.extend(items)


def _flat(value: Any) -> list[Any]:
    """Every leaf of a sample, in order (tensors as lists), to compare two samples exactly."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), value.tolist()]
    if hasattr(value, "tensordicts"):  # a lazy stack (of ragged transitions): each in turn
        return [_flat(td) for td in value.tensordicts]
    if hasattr(value, "items") and not isinstance(value, dict):  # a TensorDict
        return [[k, _flat(value.get(k))] for k in sorted(value.keys(include_nested=True, leaves_only=True), key=str)]
    if isinstance(value, dict):
        return [[k, _flat(v)] for k, v in sorted(value.items())]
    if isinstance(value, (list, tuple)):
        return [_flat(v) for v in value]
    return [repr(value)]


def _continue(rb: ReplayBuffer, kind: str, sampler: str) -> list[Any]:
    out = []
    for step in range(3):
        batch, info = rb.sample(return_info=True)
        index = info["index"] if isinstance(info, dict) else info
        out.append([_flat(batch), _flat(index)])
        if sampler == "prioritized":
            rb.update_priority(index, torch.arange(1.0, 1.0 + len(index)) * (step + 1))
        _extend(rb, kind, 100 + 10 * step, 2)
    out.append(_flat([rb._storage._storage[i] for i in range(len(rb))]))
    return out


@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
@pytest.mark.parametrize("filled", [5, 17], ids=["partial", "wrapped"])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("storage, kind", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_a_list_storage_buffer_resumes_exactly(
    tmp_path: Path, storage: str, kind: str, sampler: str, filled: int, archive: bool
) -> None:
    torch.manual_seed(0)
    rb = _buffer(storage, kind, sampler)
    _extend(rb, kind, 0, filled)
    rb.sample()  # the sampler has moved (without replacement: mid-epoch)
    path = tdcp.DistributedCheckpoint(buffer=rb, rng=tdcp.RNGState()).save(tmp_path / "c")
    if archive:
        path = tdcp.to_archive(path, tmp_path / "c.zip")
    saved_len = len(rb)
    expected = _continue(rb, kind, sampler)

    torch.manual_seed(1234)
    fresh = _buffer(storage, kind, sampler)
    _extend(fresh, kind, 50, 2)  # holds other transitions before the load
    tdcp.DistributedCheckpoint(buffer=fresh, rng=tdcp.RNGState()).load(path)
    assert len(fresh) == saved_len
    assert _continue(fresh, kind, sampler) == expected


def test_an_object_that_needs_pickle_is_refused_naming_the_transition(tmp_path: Path) -> None:
    rb = ReplayBuffer(storage=ListStorage(8))
    rb.extend([torch.zeros(2), torch.ones(2)])
    rb.add(object())
    with pytest.raises(tdcp.EncodingError, match="entry 2 is a builtins.object.*without pickle"):
        tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("live", ["small", "tensor_storage"])
def test_a_buffer_that_cannot_take_the_saved_list_changes_nothing(tmp_path: Path, live: str) -> None:
    from torchrl.data import LazyTensorStorage

    rb = ReplayBuffer(storage=ListStorage(8))
    rb.extend([torch.full((2,), float(i)) for i in range(6)])
    model = torch.nn.Linear(2, 2)
    path = tdcp.DistributedCheckpoint(buffer=rb, model=model).save(tmp_path / "c")
    store = ListStorage(4) if live == "small" else LazyTensorStorage(8)
    target, other = ReplayBuffer(storage=store), torch.nn.Linear(2, 2)
    target.extend([torch.zeros(2)])
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(tdcp.IncompatibleComponentError, match="room for 4|ListStorage"):
        tdcp.DistributedCheckpoint(buffer=target, model=other).load(path)
    assert len(target) == 1 and all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_numpy_and_scalar_transitions_round_trip(tmp_path: Path) -> None:
    rb = ReplayBuffer(storage=ListStorage(8))
    items = [{"obs": np.arange(3, dtype=np.float32) + i, "step": i, "tag": f"t{i}", "done": i == 2} for i in range(3)]
    rb.extend(items)
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    fresh = ReplayBuffer(storage=ListStorage(8))
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    got = fresh._storage._storage
    assert [(g["step"], g["tag"], g["done"]) for g in got] == [(i, f"t{i}", i == 2) for i in range(3)]
    assert all(isinstance(g["obs"], np.ndarray) and g["obs"].dtype == np.float32 for g in got)
    assert all(np.array_equal(g["obs"], np.arange(3, dtype=np.float32) + i) for i, g in enumerate(got))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, TensorDict):
        return isinstance(b, TensorDict) and (a == b).all() and a.batch_size == b.batch_size
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_transitions_holding_tensordicts_in_tuples_lists_and_dicts_resume(tmp_path: Path) -> None:
    """``(td, 1)``, ``[td, {"info": td}]``: the refusal said "TensorDicts (or lists, tuples and dicts of them)" are
    stored, and refused them. Each comes back of its own type, with its TensorDicts; a set inside one is refused,
    naming it."""
    td = TensorDict({"obs": torch.arange(3.0)}, [])
    items = [(td, 1), [td.clone(), {"info": td.clone(), 2: "x"}], {"a": (td.clone(),)}]
    rb = ReplayBuffer(storage=ListStorage(10), batch_size=2)
    rb.extend(items)
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    fresh = ReplayBuffer(storage=ListStorage(10), batch_size=2)
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    assert all(_same(a, b) for a, b in zip(items, fresh._storage._storage))
    bad = ReplayBuffer(storage=ListStorage(10), batch_size=2)
    bad.extend([(td, {1, 2})])
    with pytest.raises(tdcp.EncodingError, match="entry 0 is a builtins.tuple holding a builtins.set"):
        tdcp.DistributedCheckpoint(buffer=bad).save(tmp_path / "d")


def test_a_prefetching_buffer_is_warned_about_at_save_and_load(tmp_path: Path) -> None:
    """Batches a ``prefetch=`` buffer drew ahead are not saved: samples after a restore differ (docs say so), and now
    the user hears it."""
    rb = ReplayBuffer(storage=ListStorage(10), batch_size=2, prefetch=2)
    rb.extend([torch.tensor([float(i)]) for i in range(5)])
    rb.sample()
    with pytest.warns(tdcp.InexactResumeWarning, match=r"\(saving\): the replay buffer prefetches"):
        path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    with pytest.warns(tdcp.InexactResumeWarning, match=r"\(loading\): the replay buffer prefetches"):
        tdcp.DistributedCheckpoint(buffer=ReplayBuffer(storage=ListStorage(10), batch_size=2, prefetch=2)).load(path)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_a_list_entry_whose_tuple_flag_is_not_a_bool_is_refused_by_load_and_verify(tmp_path: Path, flag: Any) -> None:
    """``{"seq": {"tuple": ...}}`` took any value that is not ``true`` for a list: no save writes it."""
    import json

    from tests import forging
    from torchrl_dcp.format.layout import shard_name

    td = TensorDict({"obs": torch.zeros(2)}, [])
    rb = ReplayBuffer(storage=ListStorage(4), batch_size=1)
    rb.extend([(td, 1)])
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    assert shard_name(0) in {p.name for p in path.iterdir()}

    def forge(m: dict) -> None:
        text = json.dumps(m)
        m.clear()
        forged = text.replace('["tuple", true]', f'["tuple", {json.dumps(flag)}]')  # (a codec dict's item)
        assert forged != text
        m.update(json.loads(forged))

    forging.edit(path, forge)
    with pytest.raises(tdcp.CheckpointError, match="malformed list storage entry"):
        tdcp.verify(path)
    with pytest.raises(tdcp.CheckpointError, match="malformed list storage entry"):
        tdcp.DistributedCheckpoint(buffer=ReplayBuffer(storage=ListStorage(4), batch_size=1)).load(path)
