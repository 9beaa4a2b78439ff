"""Sparse COO tensors in a state: SGD with momentum over sparse gradients (``nn.Embedding(sparse=True)``) keeps a
sparse, uncoalesced ``momentum_buffer``, which every save refused ("layout torch.sparse_coo"). Saved as its indices
and values, it resumes exactly; forged indices are refused before torch's kernels see them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def _embedding(seed: int) -> tuple[torch.nn.Embedding, torch.optim.SGD]:
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    return emb, torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)


def _step(emb: torch.nn.Embedding, opt: torch.optim.SGD, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    opt.zero_grad()
    emb(torch.randint(10, (6,), generator=g)).pow(2).sum().backward()  # repeated rows: uncoalesced gradients
    opt.step()
    return emb.weight.detach().clone()


def _sparse_buffer(values: list[float], rows: list[int]) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_buffer("s", torch.sparse_coo_tensor(torch.tensor([rows]), torch.tensor(values), (4,)))
    return m


@pytest.mark.parametrize("live_state", [False, True], ids=["fresh-optimizer", "stepped-optimizer"])
def test_sgd_momentum_over_sparse_gradients_resumes_exactly(tmp_path: Path, live_state: bool) -> None:
    emb, opt = _embedding(0)
    for i in range(3):
        _step(emb, opt, i)
    buffer = opt.state[emb.weight]["momentum_buffer"]
    assert buffer.layout == torch.sparse_coo and not buffer.is_coalesced()
    held = buffer._indices().clone()  # (the steps below grow the buffer in place)
    saved = tdcp.state_snapshot({"emb": emb, "opt": opt}, "job")
    path = tdcp.DistributedCheckpoint(model=emb, optim=opt).save(tmp_path / "c")
    assert tdcp.verify(path)["tensors"] == 3  # the weight, the buffer's indices and values
    expected = [_step(emb, opt, i) for i in range(3, 6)]

    emb2, opt2 = _embedding(1)
    if live_state:
        _step(emb2, opt2, 99)  # a sparse buffer of other entries already there
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.InexactResumeWarning)
        result = tdcp.DistributedCheckpoint(model=emb2, optim=opt2).load(path)
    assert result.loaded == {"model", "optim"} and not result.incompatible
    assert tdcp.state_differences(saved, tdcp.state_snapshot({"emb": emb2, "opt": opt2}, "job")) == []
    restored = opt2.state[emb2.weight]["momentum_buffer"]
    assert torch.equal(restored._indices(), held) and not restored.is_coalesced()
    assert all(torch.equal(a, b) for a, b in zip(expected, [_step(emb2, opt2, i) for i in range(3, 6)]))


def test_a_sparse_module_buffer_round_trips_as_held(tmp_path: Path) -> None:
    saved = _sparse_buffer([1.0, 2.0, 3.0], [0, 2, 0])  # row 0 twice: uncoalesced
    path = tdcp.DistributedCheckpoint(m=saved).save(tmp_path / "c")
    live = _sparse_buffer([5.0], [1])
    assert tdcp.DistributedCheckpoint(m=live).load(path).loaded == {"m"}
    assert live.s._indices().tolist() == [[0, 2, 0]] and live.s._values().tolist() == [1.0, 2.0, 3.0]
    assert not live.s.is_coalesced()
    assert tdcp.state_differences(tdcp.state_snapshot(saved, "m"), tdcp.state_snapshot(live, "m")) == []


def _sparse_node(m: dict) -> dict:
    items = m["components"]["d"]["state"]["items"]
    return next(v for k, v in items if k == "s")


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        (lambda node: node.update(shape=[2]), r"size is 2 but found index 2"),
        (lambda node: node.update(coalesced=True), r"cannot set is_coalesced to true"),
        (lambda node: node.update(values=7), r"its values are not a tensor node"),
        (lambda node: node["indices"].update(dtype="int32"), r"inventory disagrees|indices of torch.int32"),
    ],
    ids=["index-out-of-shape", "claimed-coalesced", "values-not-a-tensor", "indices-of-another-dtype"],
)
def test_a_forged_sparse_tensor_is_refused_and_nothing_is_restored(tmp_path: Path, forge, says: str) -> None:
    """Resealed: the manifest's seal and the shard's record recomputed (tests/forging.py). The indices are read and
    checked before anything is restored; ``verify`` runs the same check."""
    saved = {"s": torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([1.0, 2.0, 3.0]), (4,))}
    path = tdcp.DistributedCheckpoint(d=saved, w=torch.nn.Linear(2, 2)).save(tmp_path / "c")
    forging.edit(path, lambda m: forge(_sparse_node(m)))
    live, module = {"s": torch.zeros(2)}, torch.nn.Linear(2, 2)
    weight = module.weight.detach().clone()
    with pytest.raises(tdcp.CheckpointError, match=says) as err:
        tdcp.DistributedCheckpoint(d=live, w=module).load(path)
    assert "component 'd'" in str(err.value) and str(path) in str(err.value)
    assert torch.equal(live["s"], torch.zeros(2)) and torch.equal(module.weight, weight)  # nothing restored
    with pytest.raises(tdcp.CheckpointError, match=says):
        tdcp.verify(path)


def test_other_sparse_layouts_are_refused_with_what_to_do(tmp_path: Path) -> None:
    m = torch.nn.Module()
    m.register_buffer("s", torch.eye(3).to_sparse_csr())
    with pytest.raises(tdcp.EncodingError, match=r"sparse_csr: convert it with .to_sparse_coo\(\) or .to_dense\(\)"):
        tdcp.DistributedCheckpoint(m=m).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()
