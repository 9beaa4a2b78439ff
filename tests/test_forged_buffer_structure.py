"""A replay buffer's saved state missing an entry its restore reads, or holding one of another kind, resealed: refused
while planning (and by ``verify``), naming what is wrong, before any component's tensors are read in place.

The restore read such entries with ``[]`` after every component's rows were read in place: a ``KeyError`` then
left the policy and optimizer holding the loaded values ("keep the loaded values"). Structure is checked by the
adapter (``buffer_checks.check_structure``); what a sampler's or writer's own ``load_state_dict`` reads is checked
against the live buffer's (``check_live_keys``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, PrioritizedSampler, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

import torchrl_dcp as tdcp
from tests import forging


def _items(node: dict[str, Any]) -> list[list[Any]]:
    return node["items"]


def _entry(node: dict[str, Any], *path: str) -> dict[str, Any]:
    for key in path:
        node = next(value for k, value in _items(node) if k == key)
    return node


def _drop(*path: str) -> Callable[[dict[str, Any]], None]:
    def forge(state: dict[str, Any]) -> None:
        parent = _entry(state, *path[:-1])
        parent["items"] = [item for item in _items(parent) if item[0] != path[-1]]

    return forge


def _set(value: Any, *path: str) -> Callable[[dict[str, Any]], None]:
    def forge(state: dict[str, Any]) -> None:
        parent = _entry(state, *path[:-1])
        parent["items"] = [[k, value if k == path[-1] else v] for k, v in _items(parent)]

    return forge


def _objects(seed: int, sampler: str) -> tuple[tdcp.DistributedCheckpoint, torch.nn.Linear]:
    torch.manual_seed(seed)
    policy = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(3, 4)).sum().backward()
    optim.step()
    samplers = {"prioritized": lambda: PrioritizedSampler(16, 0.7, 0.5), "epoch": SamplerWithoutReplacement}
    rb = ReplayBuffer(storage=LazyTensorStorage(16), sampler=samplers[sampler](), batch_size=2)
    rb.extend(TensorDict({"obs": torch.randn(5, 3)}, [5]))
    return tdcp.DistributedCheckpoint(policy=policy, optim=optim, buffer=rb), policy


CASES = {
    "no writer": ("prioritized", _drop("writer"), "no 'writer'"),
    "no transform": ("prioritized", _drop("transform"), "no 'transform'"),
    "no batch size": ("prioritized", _drop("batch_size"), "no 'batch_size'"),
    "no generator": ("prioritized", _drop("generator"), "no 'generator'"),
    "writer a string": ("prioritized", _set("x", "writer"), "'writer' is a str"),
    "no sum tree": ("prioritized", _drop("sampler", "sum"), r"holds no \['sum'\]"),
    "no max priority": ("prioritized", _drop("sampler", "max_priority"), r"holds no \['max_priority'\]"),
    "no sampler kind": ("prioritized", _drop("sampler", "kind"), "sampler's type and kind"),
    "storage initialized a number": ("prioritized", _set(1, "storage", "initialized"), "initialized"),
    "no storage len": ("prioritized", _drop("storage", "len"), "len"),
    "writer state a string": ("epoch", _set("s", "writer", "state"), "writer's type and state"),
    "no writer cursor": ("epoch", _drop("writer", "state", "_cursor"), r"writer holds no \['_cursor'\]"),
    "no epoch length": ("epoch", _drop("sampler", "state", "len_storage"), "len_storage None"),
    "no epoch flag": ("epoch", _drop("sampler", "state", "drop_last"), r"sampler holds no \['drop_last'\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_buffer_state_missing_what_its_restore_reads_is_refused_before_anything_changes(
    tmp_path: Path, case: str
) -> None:
    sampler, forge, match = CASES[case]
    _objects(0, sampler)[0].save(tmp_path / "c")
    forging.edit(tmp_path / "c", lambda m: forge(m["components"]["buffer"]["ranks"]["0"]["state"]))
    live_only = case in ("no writer cursor", "no epoch flag")  # (what the live buffer's keys tell)
    if not live_only:
        with pytest.raises(tdcp.CheckpointError, match=match):
            tdcp.verify(tmp_path / "c")
    ckpt, policy = _objects(1, sampler)
    before = policy.weight.detach().clone()
    with pytest.raises(tdcp.CheckpointError, match=f"component 'buffer'.*{match}"):
        ckpt.load(tmp_path / "c")
    assert torch.equal(policy.weight, before)  # refused while planning: nothing read in place


@pytest.mark.parametrize("sampler", ["prioritized", "epoch"])
def test_every_saved_buffer_state_passes_the_structure_checks(tmp_path: Path, sampler: str) -> None:
    ckpt, policy = _objects(0, sampler)
    ckpt.save(tmp_path / "c")
    tdcp.verify(tmp_path / "c")
    other, other_policy = _objects(1, sampler)
    other.load(tmp_path / "c")
    assert torch.equal(other_policy.weight, policy.weight)
    listed = ReplayBuffer(storage=ListStorage(8))
    listed.extend([{"a": 1}, {"a": 2}])
    tdcp.DistributedCheckpoint(buffer=listed).save(tmp_path / "list")
    tdcp.DistributedCheckpoint(buffer=ReplayBuffer(storage=ListStorage(8))).load(tmp_path / "list")


@pytest.mark.parametrize("placement", ["replicated", "per_rank"])
def test_an_absent_state_no_save_writes_is_refused(tmp_path: Path, placement: str) -> None:
    """A rank saves ``{"_tdcp_absent_on_this_rank": true}`` for a per-rank component other ranks registered and it
    did not: never for a replicated one, nor on every rank. Forged and resealed, both were taken as "this rank held
    none" (the live object kept, a warning saying other ranks had it)."""
    from torchrl_dcp.placement import ABSENT_STATE

    stats = {"episodes": 3}
    tdcp.DistributedCheckpoint().register("stats", stats, placement=placement).save(tmp_path / "c")
    absent = {"items": [[k, v] for k, v in ABSENT_STATE.items()], "t": "dict"}

    def forge(m: dict[str, Any]) -> None:
        rec = m["components"]["stats"]
        if placement == "replicated":
            rec["state"] = absent
        else:
            rec["ranks"]["0"]["state"] = absent

    forging.edit(tmp_path / "c", forge)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="component 'stats'.*damaged or forged"):
        tdcp.verify(tmp_path / "c")
    live = {"episodes": 0}
    with pytest.raises(tdcp.CheckpointIntegrityError, match="component 'stats'"):
        tdcp.DistributedCheckpoint().register("stats", live, placement=placement).load(tmp_path / "c")
    assert live == {"episodes": 0}


@pytest.mark.parametrize("placement", ["replicated", "per_rank"])
def test_a_components_own_state_equal_to_the_absent_marker_is_refused_at_save(tmp_path: Path, placement: str) -> None:
    """A component whose own state is ``{"_tdcp_absent_on_this_rank": True}`` saved without complaint, and every
    load and ``verify`` then refused the honest checkpoint as forged (probe a3). The value is reserved: the save
    refuses it, naming the component, and writes nothing."""
    from torchrl_dcp.placement import ABSENT_STATE

    ckpt = tdcp.DistributedCheckpoint().register("flags", dict(ABSENT_STATE), placement=placement)
    with pytest.raises(tdcp.EncodingError, match=r"state of component 'flags' is .*reserved.*rename the key or wrap"):
        ckpt.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    wrapped = tdcp.DistributedCheckpoint().register("flags", {"flags": dict(ABSENT_STATE)}, placement=placement)
    wrapped.save(tmp_path / "wrapped")  # (nested, it is an ordinary value)
    tdcp.verify(tmp_path / "wrapped")
    live: dict[str, Any] = {"flags": {}}
    tdcp.DistributedCheckpoint().register("flags", live, placement=placement).load(tmp_path / "wrapped")
    assert live == {"flags": ABSENT_STATE}


@pytest.mark.parametrize("value", ["numpy_true", "one", "ordered_dict"])
def test_a_value_merely_equal_to_the_absent_marker_is_a_components_own_state(tmp_path: Path, value: str) -> None:
    """Probe b2: the marker was compared with ``==``, so a state ``{"_tdcp_absent_on_this_rank": np.True_}`` (or
    ``1``, or an ``OrderedDict``) saved, and every load and ``verify`` refused the library's own checkpoint as
    forged (on 2 ranks, the rank holding it kept its object, told it had registered none). Only the marker itself,
    ``True`` in a plain dict, is absent: these save and load back."""
    import collections

    import numpy as np

    key = "_tdcp_absent_on_this_rank"
    state = {
        "numpy_true": lambda: {key: np.True_},
        "one": lambda: {key: 1},
        "ordered_dict": lambda: collections.OrderedDict({key: True}),
    }[value]()
    tdcp.DistributedCheckpoint().register("flags", state, placement="per_rank").save(tmp_path / "c")
    tdcp.verify(tmp_path / "c")
    live = type(state)({key: 0})
    tdcp.DistributedCheckpoint().register("flags", live, placement="per_rank").load(tmp_path / "c")
    assert live == state and type(live[key]) is type(state[key])


def test_a_state_saved_before_a_writer_stamped_generations_loads_into_one_that_has(tmp_path: Path) -> None:
    """A generation-tracking writer's ``state_dict`` holds ``_generation`` only after its first write: a state saved
    before it was refused as "saved from a buffer built otherwise" by one that had written since (the same build).
    It loads, and the writer holds no stamps again (torchrl's own load kept the old ones)."""
    from torchrl.data import TensorDictReplayBuffer
    from torchrl.data.replay_buffers.writers import TensorDictRoundRobinWriter

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), writer=TensorDictRoundRobinWriter(track_generations=True))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    ckpt.save(tmp_path / "empty")
    rb.extend(TensorDict({"obs": torch.randn(3, 2)}, [3]))
    assert rb._writer._generation is not None
    ckpt.load(tmp_path / "empty")
    assert len(rb) == 0 and rb._writer._generation is None
