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


def test_a_sparse_tensor_held_twice_or_over_a_dense_ones_memory_loads(tmp_path: Path) -> None:
    """Its second occurrence's parts were written as aliases (or an ``xref`` to another component), which the load
    refused as "malformed sparse tensor: its indices are not a tensor node": a checkpoint the library wrote, refused."""
    dense = torch.tensor([1.0, 2.0, 3.0])
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), dense, (4,))  # (its values are dense's memory)
    module = torch.nn.Module()
    module.register_buffer("s", t)
    owner = torch.nn.Sequential(module)
    path = tdcp.DistributedCheckpoint(d={"a": t, "b": [t], "dense": dense}, m=module, both=owner).save(tmp_path / "c")
    assert tdcp.verify(path)
    live = {"a": torch.zeros(1), "b": [torch.zeros(1)], "dense": torch.zeros(3)}
    fresh, fresh_owner = torch.nn.Module(), torch.nn.Sequential()
    fresh.register_buffer("s", torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([5.0]), (4,)))
    fresh_owner.append(fresh)
    tdcp.DistributedCheckpoint(d=live, m=fresh, both=fresh_owner).load(path)
    for got in (live["a"], live["b"][0], fresh.s):
        assert got._indices().tolist() == [[0, 2, 0]] and got._values().tolist() == [1.0, 2.0, 3.0]
    assert live["dense"].tolist() == [1.0, 2.0, 3.0]


def test_a_complex_sparse_tensor_tracked_by_autograd_comes_back_tracked(tmp_path: Path) -> None:
    t = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([1 + 2j]), (3,)).requires_grad_(True)
    path = tdcp.DistributedCheckpoint(d={"s": t}).save(tmp_path / "c")
    live: dict = {}
    tdcp.DistributedCheckpoint(d=live).load(path)
    assert live["s"].requires_grad and live["s"]._values().tolist() == [1 + 2j]


def _uncoalesced() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([1.0, 2.0, 3.0]), (4,))


def _two_entries_no_sparse_dim() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.zeros(0, 2, dtype=torch.long), torch.tensor([[1.0], [2.0]]), (1,))


@pytest.mark.parametrize(
    ("build", "node_edit", "says"),
    [
        (_uncoalesced, lambda node: node.update(shape=[2**63]), r"shape \[9223372036854775808\]"),
        (
            _two_entries_no_sparse_dim,
            lambda node: node.update(coalesced=True),
            r"coalesced claimed for 2 entries of a tensor of no sparse dim",
        ),
    ],
    ids=["a-size-past-int64", "coalesced-without-sparse-dims"],
)
def test_forgeries_torch_does_not_check_are_refused(tmp_path: Path, build, node_edit, says: str) -> None:
    """A shape of 2**63 made torch raise a ``TypeError`` (no CheckpointError); ``coalesced`` claimed for two entries
    of a tensor with no sparse dimension passed torch's invariant checks and loaded."""
    path = tdcp.DistributedCheckpoint(d={"s": build()}).save(tmp_path / "c")
    forging.edit(path, lambda m: node_edit(_sparse_node(m)))
    for call in (lambda: tdcp.verify(path), lambda: tdcp.DistributedCheckpoint(d={}).load(path)):
        with pytest.raises(tdcp.CheckpointError, match=says):
            call()


@pytest.mark.parametrize("part", ["indices", "values"])
def test_an_alias_to_a_part_of_a_sparse_tensor_is_refused(tmp_path: Path, part: str) -> None:
    """A forged ``{"t": "alias", "key": "s/values"}`` beside the sparse tensor loaded a value sharing the sparse
    tensor's memory (writing into it changed the indices after their checks): no save writes one."""
    saved = {"s": torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,)), "v": torch.ones(2)}
    path = tdcp.DistributedCheckpoint(d=saved).save(tmp_path / "c")

    def forge(m: dict) -> None:
        items = m["components"]["d"]["state"]["items"]
        key = next(v for k, v in items if k == "s")[part]["key"]
        for item in items:
            if item[0] == "v":
                item[1] = {"t": "alias", "key": key}

    forging.edit(path, forge)
    for attempt in (lambda: tdcp.DistributedCheckpoint(d={}).load(path), lambda: tdcp.verify(path)):
        with pytest.raises(tdcp.CheckpointError, match="a part of a sparse tensor"):
            attempt()
