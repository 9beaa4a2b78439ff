"""Property-based tests: random and mutated manifests and skeletons only ever raise CheckpointError.

The manifest reader (``parse_manifest`` / ``loads_manifest`` / ``read_manifest``), the
JSON value codec (``decode`` / ``tensor_specs``) and a whole ``load`` are fed random
JSON and random mutations of a real checkpoint's manifest. Anything but a
:class:`CheckpointError` escaping is a bug; a load that fails must leave the objects
unchanged.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import torchrl_dcp as tdcp
from torchrl_dcp.format.codec import decode, encode, tensor_specs, xrefs
from torchrl_dcp.format.manifest import FORMAT, FORMAT_VERSION, loads_manifest, parse_manifest, seal
from torchrl_dcp.verification import verify

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["tensor", "dict", "float", "t", "key", "shape", "dtype", "float32", "int64", "nan", "-1", "cpu"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.sampled_from(["t", "key", "shape", "dtype", "items", "v", "state"])),
            children,
            max_size=5,
        ),
    ),
    max_leaves=30,
)

KINDS = [
    "tensor", "dtensor", "alias", "xref", "ndarray", "dict", "odict", "list", "tuple", "set", "frozenset", "float",
    "size", "dtype", "device", "np", "complex", "bytes", "bytearray", "slice", "range", "path", "ellipsis", "bogus",
]  # fmt: skip


@st.composite
def skeletons(draw: Any, depth: int = 0) -> Any:
    """Skeleton-shaped JSON: nodes ``{"t": kind, ...}`` with plausible and implausible fields."""
    if depth > 3 or draw(st.integers(0, 3)) == 0:
        return draw(scalars)
    kind = draw(st.sampled_from(KINDS))
    node: dict[str, Any] = {"t": kind}
    fields = draw(st.sets(st.sampled_from(["key", "shape", "dtype", "device", "items", "v", "np_dtype", "tensor",
                                           "component", "metadata"]), max_size=5))  # fmt: skip
    for f in fields:
        if f == "items":
            node[f] = draw(st.lists(st.one_of(st.lists(skeletons(depth + 1), min_size=2, max_size=2),
                                              skeletons(depth + 1)), max_size=3))  # fmt: skip
        elif f == "shape":
            node[f] = draw(st.one_of(st.lists(st.integers(-2, 4), max_size=3), json_values))
        elif f == "dtype":
            node[f] = draw(
                st.one_of(st.sampled_from(["float32", "int64", "bool", "Tensor", "nn", "float"]), json_values)
            )
        elif f in ("tensor", "metadata"):
            node[f] = draw(skeletons(depth + 1))
        elif f == "v":
            node[f] = draw(st.one_of(json_values, st.lists(skeletons(depth + 1), max_size=3)))
        elif f == "np_dtype":
            node[f] = draw(st.sampled_from(["float32", "O", "V8", "int8", "<U3", "nonsense", "M8[s]"]))
        else:
            node[f] = draw(st.one_of(st.sampled_from(["a", "b/c", "cpu", "meta", "cuda:99", "x"]), json_values))
    return node


# ---------------------------------------------------------------------- manifest reader
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("fuzz")
    path = _objects_ckpt(0).save(d / "ckpt", step=3, metadata={"k": [1, 2]})
    return path, json.loads((path / "manifest.json").read_text())


def _objects_ckpt(seed: int) -> tdcp.DistributedCheckpoint:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return tdcp.DistributedCheckpoint(model=model, stats={"n": seed, "w": torch.arange(3.0) + seed, "tag": "x"})


@SETTINGS
@given(json_values)
def test_random_json_manifest(raw: Any) -> None:
    try:
        parse_manifest(raw, "fuzz")
    except tdcp.CheckpointError:
        pass


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_manifest(data: bytes) -> None:
    try:
        loads_manifest(data, "fuzz")
    except tdcp.CheckpointError:
        pass


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(manifest: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    m = copy.deepcopy(manifest)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(m) if p]
        where = data.draw(st.sampled_from(paths))
        parent = m
        for k in where[:-1]:
            parent = parent[k]
        action = data.draw(st.sampled_from(["replace", "delete", "skeleton"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[where[-1]]
        elif action == "skeleton":
            parent[where[-1]] = data.draw(skeletons())
        else:
            parent[where[-1]] = data.draw(json_values)
    return m


@SETTINGS
@given(data=st.data())
def test_mutated_real_manifest_parses_or_refuses(real: tuple[Path, dict[str, Any]], data: st.DataObject) -> None:
    _, manifest = real
    try:
        parse_manifest(_mutate(manifest, data), "fuzz")
    except tdcp.CheckpointError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_load_with_mutated_manifest_completes_or_changes_nothing(
    real: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    path, manifest = real
    mutated = _mutate(manifest, data)
    target = tmp_path_factory.mktemp("mut") / "ckpt"
    shutil.copytree(path, target)
    (target / "manifest.json").write_text(json.dumps(seal(mutated)))
    torch.manual_seed(99)
    model = torch.nn.Linear(3, 2)
    stats: dict[str, Any] = {"n": -1, "w": torch.zeros(3), "tag": "fresh"}
    before = (model.weight.detach().clone(), model.bias.detach().clone(), copy.deepcopy(stats))
    try:
        tdcp.DistributedCheckpoint(model=model, stats=stats).load(target)
    except tdcp.CheckpointError:
        assert torch.equal(model.weight, before[0]) and torch.equal(model.bias, before[1])
        assert stats.keys() == before[2].keys() and stats["n"] == -1 and stats["tag"] == "fresh"
        assert torch.equal(stats["w"], before[2]["w"])
    try:
        verify(target)
    except tdcp.CheckpointError:
        pass


def test_newer_version_and_foreign_format_are_refused_with_their_kind() -> None:
    base = {"format": FORMAT, "format_version": FORMAT_VERSION + 1}
    with pytest.raises(tdcp.CheckpointVersionError, match="upgrade torchrl_dcp"):
        parse_manifest(base, "x")
    with pytest.raises(tdcp.CheckpointFormatError, match="format"):
        parse_manifest({**base, "format": "other"}, "x")


# ---------------------------------------------------------------------- codec
@SETTINGS
@given(skeletons())
@example({"t": "tensor", "key": "a", "dtype": "float32", "shape": [], "device": []})  # unhashable device
@example({"t": "tensor", "key": "a", "dtype": [], "shape": []})  # unhashable dtype
@example({"t": [], "key": "a"})  # unhashable kind
def test_decode_random_skeleton(skeleton: Any) -> None:
    tensors = {"a": torch.ones(2), "b/c": torch.zeros(1), "x": torch.arange(3)}
    try:
        decode(skeleton, tensors)
    except tdcp.CheckpointError:
        pass
    try:
        list(tensor_specs(skeleton))
        list(xrefs(skeleton))
    except tdcp.CheckpointError:
        pass


@SETTINGS
@given(st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(), st.text(max_size=6)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=5), c, max_size=4),
                        st.tuples(c, c)),
    max_leaves=20,
))  # fmt: skip
def test_encode_decode_round_trip(value: Any) -> None:
    """Whatever the codec accepts comes back equal (NaN compared as NaN), through JSON."""
    skeleton, tensors = encode({"v": value})
    back = decode(json.loads(json.dumps(skeleton, allow_nan=False)), tensors)["v"]
    assume(value == value)  # NaN payloads: compare through repr below
    assert repr(back) == repr(value)


def test_deeply_nested_skeleton_is_refused_not_crashing() -> None:
    node: Any = 1
    for _ in range(50_000):
        node = {"t": "list", "items": [node]}
    with pytest.raises(tdcp.CheckpointError):
        decode(node, {})
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(tdcp.CheckpointError):
        loads_manifest(deep.encode(), "x")
