"""Lazily stacked TensorDicts (ragged entries: the shape of variable-length episodes) as components and inside
TensorDicts: saved as their stacked TensorDicts, restored into each where it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

import torchrl_dcp as tdcp


def _ragged(lengths: list[int], offset: float = 0.0, stack_dim: int = 0) -> LazyStackedTensorDict:
    parts = [
        TensorDict({"obs": torch.arange(float(n)) + offset, "id": torch.tensor(i), "meta": {"n": torch.tensor(n)}}, [])
        for i, n in enumerate(lengths)
    ]
    return lazy_stack(parts, dim=stack_dim)


def _same(a: LazyStackedTensorDict, b: LazyStackedTensorDict) -> bool:
    return len(a.tensordicts) == len(b.tensordicts) and all(
        bool((x == y).all()) and set(x.keys(True, True)) == set(y.keys(True, True))
        for x, y in zip(a.tensordicts, b.tensordicts)
    )


@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
@pytest.mark.parametrize("lengths", [[1], [3, 1, 2], [2, 2, 2, 5]], ids=["one", "three", "four"])
def test_a_ragged_lazy_stack_round_trips_in_place(tmp_path: Path, lengths: list[int], archive: bool) -> None:
    saved = _ragged(lengths, offset=10.0)
    path = tdcp.DistributedCheckpoint(episodes=saved).save(tmp_path / "c")
    if archive:
        path = tdcp.to_archive(path, tmp_path / "c.zip")
    live = _ragged([4] * len(lengths))
    parts = list(live.tensordicts)
    tdcp.DistributedCheckpoint(episodes=live).load(path)
    assert _same(live, saved) and all(p is q for p, q in zip(parts, live.tensordicts))


def test_a_lazy_stack_nested_in_a_tensordict_round_trips(tmp_path: Path) -> None:
    saved = TensorDict({"episodes": _ragged([2, 3], offset=1.0), "step": torch.tensor(7)}, [])
    path = tdcp.DistributedCheckpoint(state=saved).save(tmp_path / "c")
    live = TensorDict({"episodes": _ragged([1, 1]), "step": torch.tensor(0)}, [])
    tdcp.DistributedCheckpoint(state=live).load(path)
    assert _same(live["episodes"], saved["episodes"]) and live["step"].item() == 7


def test_another_number_of_stacked_tensordicts_changes_nothing(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    path = tdcp.DistributedCheckpoint(model=model, episodes=_ragged([2, 3])).save(tmp_path / "c")
    live, other = _ragged([1, 1, 1]), torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(tdcp.IncompatibleComponentError, match="3 stacked TensorDicts.*the checkpoint 2"):
        tdcp.DistributedCheckpoint(model=other, episodes=live).load(path)
    assert _same(live, _ragged([1, 1, 1]))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
