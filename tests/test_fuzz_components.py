"""Mutated manifests of a checkpoint holding the kinds of state added last (a list-storage replay buffer of tuples
and TensorDicts, Python and NumPy generators, a ragged lazy stack, a module with extra state): a load completes or
raises a ``CheckpointError`` and changes nothing (but what docs/reliability.md allows: the tensors a failing
module's restore had read in place, named in the error, hold the checkpoint's values); ``verify`` never crashes
with anything else.

Format 5 keeps per-rank states (the generators') in the rank's manifest shard: the mutations reach the root and
the shard, each file resealed the way a forger who knows the format reseals it (the shard's size and CRC-32 in
the root's ``files``, the root's own checksum).
"""

from __future__ import annotations

import copy
import json
import random
import re
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
from torchrl_dcp.format.manifest import dumps, seal
from torchrl_dcp.storage.filesums import file_checksum
from torchrl_dcp.verification import verify

ROOT = "manifest.json"


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


def _fingerprint(objs: dict[str, Any]) -> dict[str, Any]:
    """What the objects hold, compared before and after a refused load (generators by what copies of them draw)."""
    items = [[t.tolist() if isinstance(t, torch.Tensor) else repr(t) for t in it] if isinstance(it, tuple) else
             repr(it.to_dict()) for it in objs["buffer"]._storage._storage]  # fmt: skip
    return {
        "buffer": items,
        "py": copy.deepcopy(objs["py"]).random(),
        "np": copy.deepcopy(objs["np"]).random(),
        "episodes": [td["x"].tolist() for td in objs["episodes"].tensordicts],
        "module": (objs["module"].count, objs["module"].lin.state_dict()),
    }


def _parts(path: Path) -> dict[str, Any]:
    """The manifest's files, parsed, as a forger edits them: the root and every rank's shard (per-rank states)."""
    return {f.name: json.loads(f.read_text()) for f in sorted(path.glob("manifest*.json"))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tdcp.DistributedCheckpoint(**_objects(1)).save(tmp_path_factory.mktemp("components") / "c")
    parts = _parts(path)
    assert sorted(parts) == ["manifest-0.json", ROOT]  # the generators' states are in rank 0's shard
    assert {"py", "np"} <= set(parts["manifest-0.json"]["components"])
    return path, parts


def test_the_checkpoint_itself_loads(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    objs = _objects(7)
    tdcp.DistributedCheckpoint(**objs).load(path)
    assert _same(_fingerprint(objs), _fingerprint(_objects(1)))


def _write_parts(target: Path, saved: dict[str, Any], parts: dict[str, Any]) -> None:
    """Write the (mutated) manifest files ``parts`` over the copy ``target`` of the save whose files were ``saved``:
    a file dropped from ``parts`` is deleted; a shard that changed is written and its size and CRC-32 recorded in
    the root's ``files`` (where that record is still a record), an unchanged one left as saved (its record, mutated
    or not, as the root has it); the root sealed (as it is, where it is no object)."""
    root = parts.get(ROOT)
    for name in saved:
        if name not in parts:
            (target / name).unlink()
    for name, shard in parts.items():
        if name == ROOT or shard == saved.get(name):
            continue
        (target / name).write_bytes(dumps(shard))
        files = root.get("files") if isinstance(root, dict) else None
        if isinstance(files, dict) and isinstance(files.get(name), dict):
            files[name] = {
                **files[name],
                "size": (target / name).stat().st_size,
                "checksum": file_checksum(target / name),
            }
    if ROOT in parts:
        (target / ROOT).write_text(json.dumps(seal(root) if isinstance(root, dict) else root))


def _load_or_unchanged(path: Path, saved: dict[str, Any], parts: dict[str, Any], root: Path) -> Path:
    """Load a copy of ``path`` with the manifest files ``parts`` (resealed): it completes, or refuses and changes
    nothing but what a failing in-place restore is documented to leave (docs/reliability.md): the tensors of the
    components the error names as read in place hold the checkpoint's values, their other state rolled back."""
    target = root / "c"
    shutil.copytree(path, target)
    _write_parts(target, saved, parts)
    objs = _objects(5)
    before = _fingerprint(objs)
    try:
        tdcp.DistributedCheckpoint(**objs).load(target)
    except tdcp.CheckpointError as err:
        after = _fingerprint(objs)
        partial = re.search(r"rows read in place into \[([^]]*)\] keep the loaded values", str(err))
        in_place = set(re.findall(r"'(\w+)'", partial.group(1))) if partial else set()
        assert in_place <= {"module", "episodes"}, (
            f"only the module's and the TensorDict's tensors are read in place here: {err}"
        )
        if "episodes" in in_place:  # each stacked TensorDict's tensor holds what the files hold, or what it held
            genuine, held = _fingerprint(_objects(1))["episodes"], before.pop("episodes")
            now = after.pop("episodes")
            assert len(now) == len(held) and all(x in (g, h) for x, g, h in zip(now, genuine, held)), f"{err}"
        if "module" in in_place:  # its weights hold what the files hold (the genuine save's), its count rolled back
            count, weights = after.pop("module")
            assert count == before.pop("module")[0]
            genuine = _objects(1)["module"].lin.state_dict()
            assert all(torch.equal(weights[k], genuine[k]) for k in genuine), f"{err}"
        assert _same(after, before), f"a refused load changed the objects: {err}"
    return target


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Fingerprints equal (module tensors compared by value)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        if k == "module":
            (ca, wa), (cb, wb) = a[k], b[k]
            if ca != cb or wa.keys() != wb.keys() or not all(torch.equal(wa[n], wb[n]) for n in wa):
                return False
        elif a[k] != b[k]:
            return False
    return True


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutated_manifest_loads_or_changes_nothing(
    saved: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    path, parts = saved
    target = _load_or_unchanged(path, parts, _mutate(parts, data), tmp_path_factory.mktemp("mut"))
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
    path, parts = saved
    mutated = copy.deepcopy(parts)
    for _ in range(data.draw(st.integers(1, 2))):
        paths = [
            p for name in sorted(mutated) for p in _scalar_paths(mutated[name]["components"], (name, "components"))
        ]
        where = data.draw(st.sampled_from(paths))  # in the root's states or in a rank's shard's
        parent = mutated
        for k in where[:-1]:
            parent = parent[k]
        parent[where[-1]] = data.draw(SCALARS)
    _load_or_unchanged(path, parts, mutated, tmp_path_factory.mktemp("val"))
