"""Mutated manifests of a checkpoint holding the kinds of state added last (a list-storage replay buffer of tuples
and TensorDicts, Python and NumPy generators, a ragged lazy stack, a module with extra state): a load completes or
raises a ``CheckpointError`` and changes nothing; ``verify`` never crashes with anything else."""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack
from torchrl.data import ListStorage, ReplayBuffer

import torchrl_dcp as tdcp
from tests.test_fuzz import _mutate
from torchrl_dcp.format.manifest import seal
from torchrl_dcp.verification import verify


class _Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.count = 0

    def get_extra_state(self) -> dict:
        return {"count": self.count}

    def set_extra_state(self, state: dict) -> None:
        self.count = state["count"]


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    rb = ReplayBuffer(storage=ListStorage(8))
    rb.extend([(torch.full((2,), float(seed + i)), torch.tensor(i)) for i in range(3)])
    rb.add(TensorDict({"obs": torch.arange(float(seed % 3 + 1))}, []))
    module = _Extra()
    module.count = seed
    parts = [TensorDict({"x": torch.arange(float(n)) + seed}, []) for n in (1, 2)]
    return {
        "buffer": rb,
        "py": random.Random(seed),
        "np": np.random.default_rng(seed),
        "episodes": lazy_stack(parts),
        "module": module,
    }


def _fingerprint(objs: dict[str, Any]) -> Any:
    """What the objects hold, compared before and after a refused load (generators by what copies of them draw)."""
    items = [[t.tolist() if isinstance(t, torch.Tensor) else repr(t) for t in it] if isinstance(it, tuple) else
             repr(it.to_dict()) for it in objs["buffer"]._storage._storage]  # fmt: skip
    return (
        items,
        copy.deepcopy(objs["py"]).random(),
        copy.deepcopy(objs["np"]).random(),
        [td["x"].tolist() for td in objs["episodes"].tensordicts],
        objs["module"].count,
        objs["module"].lin.weight.tolist(),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tdcp.DistributedCheckpoint(**_objects(1)).save(tmp_path_factory.mktemp("components") / "c")
    return path, json.loads((path / "manifest.json").read_text())


def test_the_checkpoint_itself_loads(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    objs = _objects(7)
    tdcp.DistributedCheckpoint(**objs).load(path)
    assert _fingerprint(objs) == _fingerprint(_objects(1))


def _load_or_unchanged(path: Path, manifest: dict[str, Any], root: Path) -> Path:
    """Load a copy of ``path`` with ``manifest`` (resealed): it completes, or refuses and changes nothing."""
    target = root / "c"
    shutil.copytree(path, target)
    (target / "manifest.json").write_text(json.dumps(seal(manifest)))
    objs = _objects(5)
    before = _fingerprint(objs)
    try:
        tdcp.DistributedCheckpoint(**objs).load(target)
    except tdcp.CheckpointError:
        assert _fingerprint(objs) == before
    return target


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutated_manifest_loads_or_changes_nothing(
    saved: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    path, manifest = saved
    target = _load_or_unchanged(path, _mutate(manifest, data), tmp_path_factory.mktemp("mut"))
    try:
        verify(target)
    except tdcp.CheckpointError:
        pass


_TENSOR_NODE_FIELDS = {"t", "key", "shape", "dtype", "device", "component"}


def _scalar_paths(node: Any, path: tuple = ()) -> list[tuple]:  # type: ignore[type-arg]
    """Paths of the scalar values inside component states (the values adapters restore; tensor nodes left alone)."""
    out = []
    if isinstance(node, dict):
        tensor_node = node.get("t") in ("tensor", "dtensor", "alias", "xref")
        for k, v in node.items():
            if tensor_node and k in _TENSOR_NODE_FIELDS or k == "t":
                continue
            out += _scalar_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _scalar_paths(v, (*path, i))
    elif node is None or isinstance(node, (bool, int, float, str)):
        out.append(path)
    return out


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63]),
    st.text(max_size=5),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_forged_state_value_loads_or_changes_nothing(
    saved: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Decodable states with other values (lengths, kinds, generator states, batch sizes, stack dims, ...)."""
    path, manifest = saved
    mutated = copy.deepcopy(manifest)
    for _ in range(data.draw(st.integers(1, 2))):
        where = data.draw(st.sampled_from(_scalar_paths(mutated["components"], ("components",))))
        parent = mutated
        for k in where[:-1]:
            parent = parent[k]
        parent[where[-1]] = data.draw(SCALARS)
    _load_or_unchanged(path, mutated, tmp_path_factory.mktemp("val"))
