"""A generated adversarial suite: forged files that reseal every documented checksum never become the state.

The forger can write the checkpoint and recomputes everything ``docs/format.md`` documents: each file's size and
CRC-32 in the manifest's ``files``, the ``chunks`` fingerprints and the manifest's own seal. One checkpoint holds a
component of every kind the library adapts (a module, its Adam optimizer with state, a plain dict, a TensorDict, a
replay buffer, a prioritized replay buffer with updated priorities, the RNG streams, a ``torch.Generator`` and a
tensor large enough to be cut into chunk files). The cases are the cross product

    component kind x mutation (where it applies) x backend (directory, ZIP archive, ``memory://``, moto S3 for some)

generated from the tables below. Each case must end in one of two ways:

* ``load`` raises a :class:`tdcp.CheckpointError` whose message names the file involved, every live object is bit
  for bit what it was, and ``verify`` refuses the checkpoint too; or
* the load succeeds (the forgery is indistinguishable from a legitimate save) and the objects hold exactly what a
  trusted decoding of the forged files gives: the objects are saved again and that checkpoint's tensors (read here
  record by record with ``torch.load(weights_only=True)``) and JSON states must equal the forged checkpoint's. Then
  ``verify`` must accept it as well. Mutations the format promises to refuse (``must_refuse``) may not load at all.

No case may hang (an alarm bounds each) and nothing outside the checkpoint may be written (the test's directory
tree and the memory store are compared before and after). Findings the library does not meet yet are listed in
``KNOWN`` and marked ``xfail(strict=True)`` with what happens.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import random
import re
import shutil
import signal
import struct
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictPrioritizedReplayBuffer

import torchrl_dcp as tdcp
import torchrl_dcp.chunking as chunking
from tests import forging
from tests.test_forged_metadata import FORGERIES
from tests.test_load_phases import _clone, same
from torchrl_dcp.format.checksums import content_fingerprint
from torchrl_dcp.format.codec import dtype_from_name
from torchrl_dcp.format.layout import identity_trailer
from torchrl_dcp.storage.archive import write_archive
from torchrl_dcp.storage.filesums import file_checksum
from torchrl_dcp.storage.filesystem import safe_load_metadata

CASE_SECONDS = 30  # a case that runs longer is a hang
CAPACITY = 8
DATA = "__0_0.distcp"


# ---------------------------------------------------------------------- the job's objects
def make_objects(seed: int) -> dict[str, Any]:
    """A small RL job: every component kind, filled from ``seed`` (the same structure for every seed)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    policy(torch.randn(5, 3)).pow(2).sum().backward()
    optim.step()
    rb = ReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(TensorDict({"obs": torch.randn(5, 3), "r": torch.arange(5) + seed}, [5]))
    prb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=2)
    prb.extend(TensorDict({"obs": torch.randn(6, 2)}, [6]))
    batch = prb.sample()
    prb.update_priority(batch["index"], torch.rand(2) + 0.1)
    torch.rand(seed)  # the global streams differ between seeds
    return {
        "policy": policy,
        "optim": optim,
        "stats": {"w": torch.randn(3), "n": seed, "tag": f"run-{seed}"},
        "td": TensorDict({"a": torch.randn(4, 2), "b": {"c": torch.arange(4) * seed}}, [4]),
        "rb": rb,
        "prb": prb,
        "rng": tdcp.RNGState(),
        "gen": torch.Generator().manual_seed(seed),
        "big": {"x": torch.randn(64, 64)},  # 16 KiB: four chunk files under the lowered thresholds below
    }


def _buffer(rb: Any, every_row: bool) -> dict[str, Any]:
    storage = rb._storage
    rows = storage._storage if every_row or not storage.initialized else storage._storage[: len(storage)]
    out = {
        "len": len(storage),
        "initialized": storage.initialized,
        "max_size": storage.max_size,
        "rows": _clone(rows.to_dict()) if storage.initialized else None,
        "writer": _clone(rb._writer.state_dict()),
    }
    sampler = rb._sampler
    if hasattr(sampler, "_sum_tree"):
        everything = torch.arange(sampler._sum_tree.size)
        out["sampler"] = {
            "sum": sampler._sum_tree[everything],
            "min": sampler._min_tree[everything],
            "max": _clone(sampler._max_priority),
            "settings": (sampler._alpha, sampler._beta, sampler._eps, sampler._max_capacity),
        }
    return out


def snapshot(objs: dict[str, Any], every_row: bool = True) -> dict[str, Any]:
    """Bit-level copies of everything a load could change (buffer rows never written too, unless not ``every_row``)."""
    np_state = np.random.get_state()
    return {
        "policy": _clone(dict(objs["policy"].state_dict())),
        "optim": _clone(objs["optim"].state_dict()),
        "stats": _clone(dict(objs["stats"])),
        "td": (tuple(objs["td"].batch_size), _clone(objs["td"].to_dict())),
        "rb": _buffer(objs["rb"], every_row),
        "prb": _buffer(objs["prb"], every_row),
        "rng": (torch.get_rng_state(), (np_state[0], np_state[1].copy(), *np_state[2:]), random.getstate()),
        "gen": objs["gen"].get_state(),
        "big": _clone(dict(objs["big"])),
    }


# ---------------------------------------------------------------------- component kinds
@dataclass(frozen=True)
class Kind:
    component: str
    key: str  # the DCP key of one of its tensors, the target of tensor-level mutations
    values: tuple[tuple[str, tuple[Any, ...], Any], ...] = ()  # (label, path in its state, forged JSON value)


KINDS: dict[str, Kind] = {
    "module": Kind("policy", "replicated/policy/0.weight"),
    "optimizer": Kind(
        "optim",
        "replicated/optim/state/0/exp_avg",
        (
            ("lr", ("param_groups", 0, "lr"), 0.5),
            ("params repeated", ("param_groups", 0, "params"), "REPEAT"),
            ("lr a string", ("param_groups", 0, "lr"), "fast"),
        ),
    ),
    "dict": Kind("stats", "replicated/stats/w", (("int", ("n",), 4), ("int to str", ("n",), "four"))),
    "tensordict": Kind(
        "td",
        "replicated/td/entries/a/tensor",
        (("batch size larger", ("batch_size",), [5]), ("batch size smaller", ("batch_size",), [2])),
    ),
    "replay_buffer": Kind(
        "rb",
        "rank/0/rb/storage/data/obs",
        (
            ("len past the rows", ("storage", "len"), 7),
            ("len past the capacity", ("storage", "len"), 99),
            ("rows past the saved ones", ("storage", "rows"), 7),
            ("max_size smaller", ("storage", "max_size"), 4),
            ("cursor", ("writer", "state", "_cursor"), 2),
            ("cursor negative", ("writer", "state", "_cursor"), -3),
        ),
    ),
    "prioritized": Kind(
        "prb",
        "rank/0/prb/sampler/sum",
        (
            ("alpha", ("sampler", "alpha"), 0.9),
            ("capacity smaller", ("sampler", "capacity"), 4),
            ("capacity larger", ("sampler", "capacity"), 64),
            ("len past the rows", ("storage", "len"), 8),
            ("cursor past the capacity", ("writer", "state", "_cursor"), 9),
        ),
    ),
    "rng": Kind(
        "rng",
        "rank/0/rng/torch",
        (
            ("numpy pos out of range", ("numpy", "pos"), 700),
            ("numpy kind", ("numpy", "kind"), "PCG64"),
            ("python version", ("python", "version"), 9),
            ("python gauss a string", ("python", "gauss"), "x"),  # random.setstate takes it; gauss() then fails
            ("numpy gauss a string", ("numpy", "gauss"), "x"),
        ),
    ),
    "generator": Kind(
        "gen", "rank/0/gen/state", (("device", ("device",), "cuda:7"), ("device junk", ("device",), "nowhere"))
    ),
    "chunked": Kind("big", "replicated/big/x"),
}


# ---------------------------------------------------------------------- the pristine checkpoints
@dataclass
class Pristine:
    path: Path
    other: Path  # the same job saved again from other values: another save id
    manifest: dict[str, Any]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    root = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:  # small thresholds: the 16 KiB tensor is cut into chunk files
        mp.setattr(chunking, "CHUNK_BYTES", 4096)
        mp.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
        path = tdcp.DistributedCheckpoint(**make_objects(1)).save(root / "c", step=1)
        other = tdcp.DistributedCheckpoint(**make_objects(2)).save(root / "other", step=2)
    manifest = forging.read_parts(path)
    assert len(manifest["chunks"]["replicated/big/x"]) == 4
    return Pristine(path, other, manifest)


# ---------------------------------------------------------------------- a trusted decoding
class Untrusted(Exception):
    """The files do not decode unambiguously."""


def _record(root: Path, name: str, offset: int, length: int) -> bytes:
    if "/" in name or name.startswith(".") and name != ".metadata" or not (root / name).is_file():
        raise Untrusted(f"record in {name!r}")
    data = (root / name).read_bytes()
    if offset < 0 or length <= 0 or offset + length > len(data):
        raise Untrusted(f"record {offset}+{length} outside {name}")
    return data[offset : offset + length]


def trusted_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``root``, assembled record by record, each element exactly once."""
    md = safe_load_metadata(root / ".metadata")
    out: dict[str, torch.Tensor] = {}
    for key, saved in md.state_dict_metadata.items():
        if not isinstance(saved, TensorStorageMetadata):
            raise Untrusted(f"{key} is not a tensor")
        target = torch.zeros(saved.size, dtype=saved.properties.dtype)
        seen = torch.zeros(saved.size, dtype=torch.int32)
        for chunk in saved.chunks:
            info = md.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise Untrusted(f"{key}: no record for {chunk}")
            tensor = torch.load(
                io.BytesIO(_record(root, info.relative_path, info.offset, info.length)), weights_only=True
            )
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(chunk.sizes):
                raise Untrusted(f"{key}: record of another shape")
            if tensor.dtype != saved.properties.dtype:
                raise Untrusted(f"{key}: record of another dtype")
            where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            target[where] = tensor
            seen[where] += 1
        if not bool((seen == 1).all()):
            raise Untrusted(f"{key} is not tiled by its chunks")
        out[key] = target
    return out


def leaves(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[tuple[Any, ...], Any]:
    """Every leaf of every saved state by its path: JSON values as they are, tensors (plain, aliased or referenced
    from another component) by their values. Two states that hold the same values compare equal whether a tensor
    is stored once and repeated or stored twice (what a load into live objects may turn one into)."""
    out: dict[tuple[Any, ...], Any] = {}

    def walk(node: Any, path: tuple[Any, ...], prefix: str) -> None:
        if isinstance(node, dict) and node.get("t") in ("tensor", "alias", "xref"):
            if node["t"] == "xref":
                key = f"replicated/{node['component']}/{node['key']}"
            else:
                key = f"{prefix}/{node['key']}"
            if key not in tensors:
                raise Untrusted(f"{path} names {key}, which the files do not hold")
            out[path] = tensors[key]
        elif isinstance(node, dict):
            for k, v in sorted(node.items()):
                walk(v, (*path, k), prefix)
        elif isinstance(node, list):
            for k, v in enumerate(node):
                walk(v, (*path, k), prefix)
        else:
            out[path] = node

    for name, c in manifest["components"].items():
        if c["placement"] == "per_rank":
            for r, entry in c["ranks"].items():
                walk(entry["state"], (name, r), f"rank/{r}/{name}")
        else:
            walk(c["state"], (name,), f"{c['placement']}/{name}")
    return out


def holds_exactly_the_files(objs: dict[str, Any], forged: Path, root: Path) -> None:
    """The loaded objects, saved again, give the forged checkpoint's states exactly: every JSON value, and every
    tensor by the values its records hold."""
    expected = leaves(forging.read_parts(forged), trusted_tensors(forged))
    resaved = tdcp.DistributedCheckpoint(**objs).save(root / "resaved")
    actual = leaves(forging.read_parts(resaved), trusted_tensors(resaved))
    differ = sorted(set(actual) ^ set(expected), key=str)
    assert not differ, f"the loaded objects hold another structure: {differ[:4]}"
    wrong = [k for k in expected if not same(actual[k], expected[k])]
    assert not wrong, f"the loaded objects hold other values than the forged files at {wrong[:4]}"


# ---------------------------------------------------------------------- the forger
def _items_slot(node: Any, step: Any) -> tuple[list[Any], int]:
    """``(container, index)`` of ``step`` inside a skeleton node (a dict's ``items`` pair, or a list item)."""
    if node.get("t") in ("dict", "odict"):
        for pair in node["items"]:
            if pair[0] == step:
                return pair, 1
        raise KeyError(step)
    return node["items"], step


def _payload_span(record: bytes, member: str = r"/data/\d+$") -> tuple[int, int]:
    """``(start, size)`` of a member's data inside a ``torch.save`` record (STORED members)."""
    zf = zipfile.ZipFile(io.BytesIO(record))
    info = next(i for i in zf.infolist() if re.search(member, i.filename))
    n, e = struct.unpack_from("<HH", record, info.header_offset + 26)
    return info.header_offset + 30 + n + e, info.file_size


_OTHER_DTYPE = {torch.float32: torch.int32, torch.int64: torch.float64, torch.uint8: torch.int8}
_WIDER_DTYPE = {torch.float32: torch.float64, torch.int64: torch.int32, torch.uint8: torch.int16}


class Forger:
    def __init__(self, path: Path, kind: Kind, pristine: Pristine) -> None:
        self.path, self.kind, self.pristine = path, kind, pristine
        self.component, self.key = kind.component, kind.key
        self.unread = False  # only .metadata was forged, which loads do not read (its records not in the manifest's)
        self.mirrored = False  # a .metadata forgery was mirrored into the manifest's storage entries

    # the manifest (root and shards, edited as one: tests/forging.py)
    def manifest(self) -> dict[str, Any]:
        return forging.read_parts(self.path)

    def write_manifest(self, m: dict[str, Any]) -> None:
        """Write ``m`` back; where its storage entries (index, chunk places) changed, ``.metadata`` says the same
        (a forger who moves a record in one moves it in the other)."""
        if forging.places(m) != forging.places(self.manifest()):
            forging.mirror_into_metadata(self.path, m)
        forging.write_parts(self.path, m)

    def write_root_text(self, m: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
        """Write ``m`` with its root spelled by ``text(sealed root)`` (forgeries of the JSON text itself)."""
        forging.write_parts(self.path, m, text=text)

    def edit(self, fn: Callable[[dict[str, Any]], Any]) -> None:
        m = self.manifest()
        fn(m)
        self.write_manifest(m)

    def entry(self, m: dict[str, Any]) -> dict[str, Any]:
        return m["components"][self.component]

    def state(self, m: dict[str, Any]) -> Any:
        c = self.entry(m)
        return c["state"] if "state" in c else c["ranks"]["0"]["state"]

    def set_value(self, m: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
        node = self.state(m)
        for step in path[:-1]:
            container, i = _items_slot(node, step)
            node = container[i]
        container, i = _items_slot(node, path[-1])
        if value == "REPEAT":  # a list whose last item repeats the one before
            items = container[i]["items"]
            items[-1] = items[-2]
        else:
            container[i] = value

    def reseal(self, *names: str) -> None:
        """Record the current size and CRC-32 of ``names`` (and every chunk's fingerprint), then reseal."""
        m = self.manifest()
        for name in names:
            m["files"][name] = {**m["files"].get(name, {}), "size": (self.path / name).stat().st_size,
                                "checksum": file_checksum(self.path / name)}  # fmt: skip
        try:
            md = safe_load_metadata(self.path / ".metadata")
            md.storage_data.items()
        except (tdcp.CheckpointError, AttributeError):  # forged beyond reading: the fingerprints stay
            md = None
        for key, chunks in m.get("chunks", {}).items() if md is not None else ():
            for c in chunks:
                index = next((i for i in md.storage_data if i.fqn == key and i.offset[0] == c["start"]), None)
                info = md.storage_data.get(index) if index is not None else None
                if info is None or info.relative_path != c["file"] or not (self.path / c["file"]).is_file():
                    continue
                record = (self.path / c["file"]).read_bytes()[info.offset : info.offset + info.length]
                try:
                    start, size = _payload_span(record)
                except (zipfile.BadZipFile, StopIteration, struct.error):
                    continue
                c["fingerprint"] = content_fingerprint(record[start : start + size])[0]
        self.write_manifest(m)

    # .metadata
    def metadata(self) -> Any:
        return safe_load_metadata(self.path / ".metadata")

    def write_metadata(self, md: Any) -> None:
        """Write ``md`` as ``.metadata`` and mirror its records into the manifest's storage entries (a forger
        changes both); a forgery they cannot say (dtypes, shapes, chunking, DCP's types) stays in ``.metadata``."""
        mirrored = forging.write_metadata(self.path, md)
        self.mirrored = self.mirrored or mirrored
        self.unread = self.unread or not mirrored
        self.reseal(".metadata")

    def edit_metadata(self, fn: Callable[[Any], Any]) -> None:
        md = self.metadata()
        fn(md)
        self.write_metadata(md)

    def index(self, md: Any, key: str | None = None) -> MetadataIndex:
        key = key or self.key
        return next(i for i in md.storage_data if i.fqn == key)

    # data files
    def record_at(self) -> tuple[str, int, int]:
        info = self.metadata().storage_data[self.index(self.metadata())]
        return info.relative_path, info.offset, info.length

    @property
    def file(self) -> str:
        return self.record_at()[0]

    def rewrite(self, name: str, fn: Callable[[bytearray], bytes | bytearray]) -> None:
        data = bytearray((self.path / name).read_bytes())
        (self.path / name).write_bytes(bytes(fn(data)))

    def replace_record(self, record: bytes) -> None:
        """Put ``record`` in place of the target's record (at its end, before the trailer, when sizes differ)."""
        name, offset, length = self.record_at()
        data = (self.path / name).read_bytes()
        if len(record) == length:
            (self.path / name).write_bytes(data[:offset] + record + data[offset + length :])
            self.reseal(name)
            return
        (self.path / name).write_bytes(data[:-64] + record + data[-64:])
        md = self.metadata()
        info = copy.copy(md.storage_data[self.index(md)])
        info.offset, info.length = len(data) - 64, len(record)
        md.storage_data[self.index(md)] = info
        forging.write_metadata(self.path, md)
        self.reseal(name, ".metadata")

    def target_tensor(self) -> torch.Tensor:
        name, offset, length = self.record_at()
        return torch.load(io.BytesIO((self.path / name).read_bytes()[offset : offset + length]), weights_only=True)


# ---------------------------------------------------------------------- mutations
@dataclass(frozen=True)
class Mutation:
    apply: Callable[[Forger], None]
    names: Callable[[Forger], tuple[str, ...]]  # the files an error must name (any of them)
    applies: Callable[[str], bool] = lambda kind: True
    must_refuse: bool = False  # the format promises a refusal: a load may not succeed
    backends: tuple[str, ...] = ("directory", "archive", "memory")
    s3: bool = False  # also on moto's S3 (for the module)
    compatibility: bool = False  # refused against the registered objects: verify, which has none, may accept it
    # what only tools show (a component's totals): a load checks it where it reads every rank's inventory (one rank),
    # verify always; a rank of a multi-rank load, reading its own shard, cannot
    tools_only: bool = False


# A manifest forgery's error names the manifest or the component whose entry it is (the library's messages say
# "component 'policy': ..." or "... in the manifest"); a .metadata forgery's names ".metadata" or "DCP's metadata".
MANIFEST = lambda f: ("manifest", f"'{f.component}'", f"{f.component}:")  # noqa: E731
METADATA = lambda f: ("metadata",)  # noqa: E731
TARGET = lambda f: (f.file,)  # noqa: E731
RECORD = lambda f: ("metadata", f.file)  # noqa: E731
CHUNKED = lambda kind: kind == "chunked"  # noqa: E731
WHOLE = lambda kind: kind != "chunked"  # noqa: E731
MANIFEST_BACKENDS = ("directory", "archive")
BACKEND_KINDS = ("module", "chunked")  # every kind on directories; these also on the other backends

MUTATIONS: dict[str, Mutation] = {}


def mutation(name: str, names: Callable[[Forger], tuple[str, ...]], **kw: Any) -> Callable[[Callable], Callable]:
    def register(fn: Callable[[Forger], None]) -> Callable[[Forger], None]:
        assert name not in MUTATIONS
        MUTATIONS[name] = Mutation(fn, names, **kw)
        return fn

    return register


# --- manifest.json: inventory, skeletons, component entries
def _inventory(f: Forger, m: dict[str, Any]) -> dict[str, Any]:
    return f.entry(m)["inventory"][f.key]


def _node(f: Forger, m: dict[str, Any]) -> dict[str, Any]:
    return forging.tensor_node(f.state(m), f.key.split(f"{f.component}/", 1)[1])


def _other_dtype(name: str, table: dict[torch.dtype, torch.dtype]) -> str:
    return str(table[getattr(torch, name)]).removeprefix("torch.")


def _reshape(shape: list[int]) -> list[int]:
    return [shape[1], shape[0], *shape[2:]] if len(shape) > 1 and shape[0] != shape[1] else [*shape, 1]


@mutation("inventory dtype", MANIFEST, backends=MANIFEST_BACKENDS, s3=True)
def _(f: Forger) -> None:
    f.edit(lambda m: _inventory(f, m).update(dtype=_other_dtype(_inventory(f, m)["dtype"], _WIDER_DTYPE)))


@mutation("inventory shape", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _inventory(f, m).update(shape=_reshape(_inventory(f, m)["shape"])))


@mutation("inventory entry removed", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: f.entry(m)["inventory"].pop(f.key))


@mutation("inventory entry added", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: f.entry(m)["inventory"].update({f.key + "_x": dict(_inventory(f, m))}))


def _both(f: Forger, m: dict[str, Any], **kw: Any) -> None:
    _inventory(f, m).update(kw)
    _node(f, m).update(kw)


@mutation("skeleton and inventory dtype, same itemsize", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _both(f, m, dtype=_other_dtype(_inventory(f, m)["dtype"], _OTHER_DTYPE)))


@mutation("skeleton and inventory dtype, wider", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _both(f, m, dtype=_other_dtype(_inventory(f, m)["dtype"], _WIDER_DTYPE)))


@mutation("skeleton and inventory shape, same numel", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _both(f, m, shape=_reshape(_inventory(f, m)["shape"])))


@mutation("skeleton device meta", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _node(f, m).update(device="meta"))


@mutation("skeleton device junk", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: _node(f, m).update(device="tpu:99"))


@mutation("skeleton key of another tensor", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    def fn(m: dict[str, Any]) -> None:
        node = _node(f, m)
        others = [k for k in f.entry(m)["inventory"] if k != f.key]
        if others:
            node["key"] = others[0].split(f"{f.component}/", 1)[1]
        else:
            node["key"] = node["key"] + "_x"

    f.edit(fn)


def _alias(f: Forger, m: dict[str, Any]) -> None:
    """The target tensor's node made an alias of another tensor of its state (the same dtype and shape when there
    is one: e.g. exp_avg made exp_avg_sq), and dropped from the inventory: the state holds one tensor twice."""
    node, inventory = _node(f, m), f.entry(m)["inventory"]
    others = [k for k in inventory if k != f.key]
    alike = [k for k in others if inventory[k] == inventory[f.key]]
    target = next(iter(alike + others), None)
    target = target.split(f"{f.component}/", 1)[1] if target else node["key"] + "_x"
    node.clear()
    node.update(t="alias", key=target)
    dropped = inventory.pop(f.key)
    entry = f.entry(m)  # the totals recounted, as a forger would
    entry["num_tensors"] -= 1
    entry["nbytes"] -= math.prod(dropped["shape"]) * dtype_from_name(dropped["dtype"]).itemsize


@mutation(
    "tensor made an alias of another, its record left",
    lambda f: (*MANIFEST(f), *METADATA(f)),
    backends=MANIFEST_BACKENDS,
    must_refuse=True,
)
def _(f: Forger) -> None:  # .metadata then holds a record no state refers to: no save writes that
    f.edit(lambda m: _alias(f, m))


def _alias_and_drop(f: Forger) -> None:
    """A consistent alias forgery: the record dropped from .metadata too."""

    def drop(md: Any) -> None:
        md.state_dict_metadata.pop(f.key)
        for index in [i for i in md.storage_data if i.fqn == f.key]:
            md.storage_data.pop(index)

    f.edit(lambda m: _alias(f, m))
    f.edit_metadata(drop)


_NEVER_SHARING = ("optimizer", "rng", "generator")  # their adapters' shares_tensors = False
MUTATIONS["tensor made an alias of another, its record dropped"] = Mutation(  # refused: these never repeat one
    _alias_and_drop,
    lambda f: (*MANIFEST(f), "twice"),
    applies=lambda kind: kind in _NEVER_SHARING,
    backends=MANIFEST_BACKENDS,
    must_refuse=True,
)
MUTATIONS["tensor made an alias of another, its record dropped (a state that may share)"] = Mutation(
    _alias_and_drop,  # a state a save can write (tied weights, a list storage's shared tensors): loaded as the files
    MANIFEST,  # say, or refused against the live object (an alias of another shape than the object's tensor)
    applies=lambda kind: kind not in _NEVER_SHARING,
    backends=MANIFEST_BACKENDS,
    compatibility=True,
)


@mutation("tensor replaced by a number", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    def fn(m: dict[str, Any]) -> None:
        node = _node(f, m)
        node.clear()
        node.update(t="float", value="nan")

    f.edit(fn)


@mutation("adapter id of another kind", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    def fn(m: dict[str, Any]) -> None:
        c = f.entry(m)
        c["adapter"] = "torchrl_dcp.state_dict" if c["adapter"] == "torchrl_dcp.json" else "torchrl_dcp.json"

    f.edit(fn)


@mutation("adapter id unknown", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    f.edit(lambda m: f.entry(m).update(adapter="evil.adapter"))


@mutation("adapter version from the future", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    f.edit(lambda m: f.entry(m).update(adapter_version=99))


@mutation("placement changed", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    f.edit(
        lambda m: f.entry(m).update(placement="sharded" if f.entry(m)["placement"] == "replicated" else "replicated")
    )


@mutation("num_tensors and nbytes wrong", MANIFEST, backends=MANIFEST_BACKENDS, tools_only=True)
def _(f: Forger) -> None:
    f.edit(lambda m: f.entry(m).update(num_tensors=f.entry(m)["num_tensors"] + 1, nbytes=f.entry(m)["nbytes"] * 2))


@mutation("component removed", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    f.edit(lambda m: m["components"].pop(f.component))


@mutation("duplicate keys, the last one genuine", MANIFEST, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    m = f.manifest()

    def text(sealed: dict[str, Any]) -> str:  # parsed, the last of two equal keys wins: the seal is the genuine one's
        out = json.dumps(sealed)
        genuine = json.dumps({"adapter": f.entry(m)["adapter"]})[1:-1]
        at = out.index(json.dumps(f.component) + ": {") + len(json.dumps(f.component) + ": {")
        out = out[:at] + '"adapter": "evil.adapter", "placement": "sharded", ' + out[at:]
        assert genuine in out
        return out

    f.write_root_text(m, text)


@mutation("duplicate keys, the first one genuine", MANIFEST, backends=MANIFEST_BACKENDS, compatibility=True)
def _(f: Forger) -> None:
    m = f.manifest()
    forged = copy.deepcopy(m)
    f.entry(forged)["adapter_version"] = 99

    def text(sealed: dict[str, Any]) -> str:
        out = json.dumps(sealed)
        name = json.dumps(f.component) + ": {"
        at = out.index(name) + len(name)
        return out[:at] + f'"adapter_version": {f.entry(m)["adapter_version"]}, ' + out[at:]

    f.write_root_text(forged, text)


def _value_mutation(path: tuple[Any, ...], value: Any) -> Callable[[Forger], None]:
    return lambda f: f.edit(lambda m: f.set_value(m, path, value))


_AGAINST_THE_OBJECT = {"state value (gen): device"}  # a valid state (a CUDA generator's), refused for this object

for _kind_name, _kind in KINDS.items():
    for _label, _path, _value in _kind.values:
        _name = f"state value ({_kind.component}): {_label}"
        MUTATIONS[_name] = Mutation(
            _value_mutation(_path, _value),
            MANIFEST,
            applies=lambda k, n=_kind_name: k == n,
            backends=MANIFEST_BACKENDS,
            compatibility=_name in _AGAINST_THE_OBJECT,
        )


# --- manifest.json: the files and chunks tables, identities
@mutation("files: size off by one", TARGET, must_refuse=True)
def _(f: Forger) -> None:
    name = f.file
    f.edit(lambda m: m["files"][name].update(size=m["files"][name]["size"] + 1))


@mutation("files: entry removed", TARGET, must_refuse=True, s3=True)
def _(f: Forger) -> None:
    name = f.file
    f.edit(lambda m: m["files"].pop(name))


@mutation("files: .metadata entry removed", METADATA, must_refuse=True, applies=lambda k: k == "module")
def _(f: Forger) -> None:
    f.edit(lambda m: m["files"].pop(".metadata"))


@mutation(
    "files: entry for a missing file", lambda f: ("__0_9.distcp",), must_refuse=True, applies=lambda k: k == "module"
)
def _(f: Forger) -> None:
    f.edit(lambda m: m["files"].update({"__0_9.distcp": {"size": 64, "checksum": "crc32:00000000"}}))


@mutation("files: checksum of another file", TARGET, must_refuse=True)
def _(f: Forger) -> None:
    name = f.file
    other = next(n for n in f.manifest()["files"] if n not in (name, ".metadata"))
    f.edit(lambda m: m["files"][name].update(checksum=m["files"][other]["checksum"]))


@mutation("files: origin of another save", TARGET)
def _(f: Forger) -> None:
    name = f.file
    f.edit(lambda m: m["files"][name].update(origin=uuid.uuid4().hex))


@mutation("files: a planted listed data file", lambda f: ("__1_0.distcp",), applies=lambda k: k == "module")
def _(f: Forger) -> None:
    save_id = f.manifest()["save_id"]
    (f.path / "__1_0.distcp").write_bytes(b"\0" * 128 + identity_trailer(save_id, 1))
    f.reseal("__1_0.distcp")


@mutation(
    "save id changed in the manifest",
    lambda f: (".metadata", DATA, "save"),
    must_refuse=True,
    applies=lambda k: k == "module",
)
def _(f: Forger) -> None:
    f.edit(lambda m: m.update(save_id=uuid.uuid4().hex))


@mutation("world size + 1", MANIFEST, must_refuse=True, applies=lambda k: k == "module", backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    f.edit(lambda m: m.update(world_size=m["world_size"] + 1))


def _chunks(f: Forger, m: dict[str, Any]) -> list[dict[str, Any]]:
    return m["chunks"][f.key]


@mutation("chunks: file fields swapped", MANIFEST, applies=CHUNKED)
def _(f: Forger) -> None:
    def fn(m: dict[str, Any]) -> None:
        c = _chunks(f, m)
        c[0]["file"], c[1]["file"] = c[1]["file"], c[0]["file"]

    f.edit(fn)


@mutation("chunks: entry dropped", MANIFEST, applies=CHUNKED)
def _(f: Forger) -> None:
    f.edit(lambda m: _chunks(f, m).pop(1))


@mutation("chunks: rows and starts shifted", MANIFEST, applies=CHUNKED)
def _(f: Forger) -> None:
    def fn(m: dict[str, Any]) -> None:
        for c in _chunks(f, m):
            c["start"] += 1

    f.edit(fn)


@mutation("chunks: fingerprint of another chunk", MANIFEST, applies=CHUNKED)
def _(f: Forger) -> None:
    f.edit(lambda m: _chunks(f, m)[0].update(fingerprint=_chunks(f, m)[1]["fingerprint"]))


@mutation("chunks: table for a tensor saved whole", MANIFEST, applies=WHOLE, backends=MANIFEST_BACKENDS)
def _(f: Forger) -> None:
    shape = f.manifest()["components"][f.component]["inventory"][f.key]["shape"]
    rows = shape[0] if shape else 1
    fingerprint = content_fingerprint(f.target_tensor().numpy().tobytes())[0]
    name = f.file
    f.edit(
        lambda m: m["chunks"].update({f.key: [{"start": 0, "rows": rows, "file": name, "fingerprint": fingerprint}]})
    )


# --- .metadata
for _name in ("no chunks", "half the rows", "negative sizes", "past the end"):
    MUTATIONS[f".metadata: {_name}"] = Mutation(
        (lambda fn: lambda f: f.edit_metadata(lambda md: fn(md, f.key)))(FORGERIES[_name]),
        METADATA,
        must_refuse=True,
        s3=_name == "half the rows",
    )


@mutation(".metadata: a million references", METADATA, must_refuse=True, backends=("directory",), applies=CHUNKED)
def _(f: Forger) -> None:
    f.edit_metadata(lambda md: FORGERIES["a million references"](md, f.key))


def _chunk(offsets: Any, sizes: Any) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


@mutation(".metadata: overlapping chunks", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        saved = md.state_dict_metadata[f.key]
        saved.chunks = [*saved.chunks, saved.chunks[0]]

    f.edit_metadata(fn)


@mutation(".metadata: chunk shifted by a row", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        saved = md.state_dict_metadata[f.key]
        first = saved.chunks[0]
        shifted = _chunk((first.offsets[0] + 1, *first.offsets[1:]), first.sizes)
        index = next(i for i in md.storage_data if i.fqn == f.key and i.offset == first.offsets)
        md.storage_data[MetadataIndex(f.key, shifted.offsets)] = md.storage_data.pop(index)
        saved.chunks = [shifted, *saved.chunks[1:]]

    f.edit_metadata(fn)


@mutation(".metadata: tensor size shrunk with its chunks", METADATA)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        saved = md.state_dict_metadata[f.key]
        last = saved.chunks[-1]
        saved.size = torch.Size((saved.size[0] - 1, *saved.size[1:]))
        saved.chunks = [*saved.chunks[:-1], _chunk(last.offsets, (last.sizes[0] - 1, *last.sizes[1:]))]

    f.edit_metadata(fn)


@mutation(".metadata: dtype changed", METADATA)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        saved = md.state_dict_metadata[f.key]
        saved.properties = copy.copy(saved.properties)
        saved.properties.dtype = _WIDER_DTYPE[saved.properties.dtype]

    f.edit_metadata(fn)


@mutation(".metadata: bytes item instead of a tensor", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    f.edit_metadata(lambda md: md.state_dict_metadata.__setitem__(f.key, BytesStorageMetadata()))


@mutation(".metadata: tensor removed", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        del md.state_dict_metadata[f.key]
        for index in [i for i in md.storage_data if i.fqn == f.key]:
            del md.storage_data[index]

    f.edit_metadata(fn)


@mutation(".metadata: record entry removed", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    f.edit_metadata(lambda md: md.storage_data.pop(f.index(md)))


@mutation(".metadata: an extra tensor on an existing record", METADATA)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        md.state_dict_metadata[f.key + "_x"] = copy.deepcopy(md.state_dict_metadata[f.key])
        for index in [i for i in md.storage_data if i.fqn == f.key]:
            md.storage_data[MetadataIndex(f.key + "_x", index.offset, index.index)] = md.storage_data[index]

    f.edit_metadata(fn)


@mutation(".metadata: chunks are not a list", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    f.edit_metadata(
        lambda md: setattr(md.state_dict_metadata[f.key], "chunks", {"0": md.state_dict_metadata[f.key].chunks[0]})
    )


@mutation(".metadata: size is not a Size", METADATA, must_refuse=True)
def _(f: Forger) -> None:
    f.edit_metadata(lambda md: setattr(md.state_dict_metadata[f.key], "size", "big"))


for _field in ("state_dict_metadata", "storage_data"):
    MUTATIONS[f".metadata: {_field} is a list"] = Mutation(
        (lambda fld: lambda f: f.edit_metadata(lambda md: setattr(md, fld, list(getattr(md, fld).items()))))(_field),
        METADATA, must_refuse=True, applies=lambda k: k == "module",
    )  # fmt: skip


@mutation(".metadata: save id changed", METADATA, must_refuse=True, applies=lambda k: k == "module")
def _(f: Forger) -> None:
    f.edit_metadata(lambda md: setattr(md.storage_meta, "save_id", uuid.uuid4().hex))


def _move(fn: Callable[[Any], None]) -> Callable[[Forger], None]:
    def apply(f: Forger) -> None:
        def edit(md: Any) -> None:
            index = f.index(md)
            info = copy.copy(md.storage_data[index])
            fn(info)
            md.storage_data[index] = info

        f.edit_metadata(edit)

    return apply


_MOVES: dict[str, Callable[[Any], None]] = {
    "offset +1": lambda i: setattr(i, "offset", i.offset + 1),
    "offset negative": lambda i: setattr(i, "offset", -1),
    "offset past the end": lambda i: setattr(i, "offset", 1 << 40),
    "length halved": lambda i: setattr(i, "length", i.length // 2),
    "length past the end": lambda i: setattr(i, "length", i.length + (1 << 30)),
    "length zero": lambda i: setattr(i, "length", 0),
    "onto the identity trailer": lambda i: (setattr(i, "offset", -64), setattr(i, "length", 64)),
    "into another file": lambda i: setattr(i, "relative_path", "__0_2.distcp" if i.relative_path == DATA else DATA),
    "into .metadata": lambda i: setattr(i, "relative_path", ".metadata"),
    "into manifest.json": lambda i: setattr(i, "relative_path", "manifest.json"),
    "outside the checkpoint": lambda i: setattr(i, "relative_path", "../outside.bin"),
    "absolute path": lambda i: setattr(i, "relative_path", "/etc/hostname"),
    "a missing file": lambda i: setattr(i, "relative_path", "__7_7.distcp"),
}
for _label, _fn in _MOVES.items():
    MUTATIONS[f".metadata: record {_label}"] = Mutation(_move(_fn), RECORD, s3=_label == "offset +1")


@mutation(".metadata: record onto another tensor's", RECORD)
def _(f: Forger) -> None:
    def fn(md: Any) -> None:
        mine = md.storage_data[f.index(md)]
        other = next(i for i in md.storage_data if i.fqn != f.key and md.storage_data[i].relative_path == DATA)
        moved = copy.copy(md.storage_data[other])
        moved.relative_path, moved.offset = mine.relative_path, mine.offset
        md.storage_data[other] = moved

    f.edit_metadata(fn)


# --- data files and chunk files
@mutation("data: payload byte flipped, resealed", TARGET, s3=True)
def _(f: Forger) -> None:
    name, offset, length = f.record_at()
    record = (f.path / name).read_bytes()[offset : offset + length]
    start, size = _payload_span(record)
    f.rewrite(name, lambda d: d.__setitem__(offset + start + size // 2, d[offset + start + size // 2] ^ 0x01) or d)
    f.reseal(name)


@mutation("data: payload byte flipped, not resealed", TARGET, must_refuse=True)
def _(f: Forger) -> None:
    name, offset, length = f.record_at()
    start, size = _payload_span((f.path / name).read_bytes()[offset : offset + length])
    f.rewrite(name, lambda d: d.__setitem__(offset + start + size // 2, d[offset + start + size // 2] ^ 0x01) or d)


@mutation("data: pickle byte flipped, resealed", TARGET)
def _(f: Forger) -> None:
    name, offset, length = f.record_at()
    start, size = _payload_span((f.path / name).read_bytes()[offset : offset + length], r"data\.pkl$")
    f.rewrite(name, lambda d: d.__setitem__(offset + start + size // 2, d[offset + start + size // 2] ^ 0x20) or d)
    f.reseal(name)


@mutation("data: record header byte flipped, resealed", TARGET)
def _(f: Forger) -> None:
    name, offset, _ = f.record_at()
    f.rewrite(name, lambda d: d.__setitem__(offset + 8, d[offset + 8] ^ 0xFF) or d)
    f.reseal(name)


@mutation("data: record of the same-itemsize dtype", RECORD)
def _(f: Forger) -> None:
    t = f.target_tensor()
    buf = io.BytesIO()
    torch.save(t.view(_OTHER_DTYPE[t.dtype]).clone(), buf)
    f.replace_record(buf.getvalue())


@mutation("data: record of a wider dtype", RECORD)
def _(f: Forger) -> None:
    t = f.target_tensor()
    buf = io.BytesIO()
    torch.save(t.to(_WIDER_DTYPE[t.dtype]), buf)
    f.replace_record(buf.getvalue())


@mutation("data: record of another shape", RECORD)
def _(f: Forger) -> None:
    t = f.target_tensor()
    buf = io.BytesIO()
    torch.save(t.reshape(-1)[: max(1, t.numel() // 2)].clone(), buf)
    f.replace_record(buf.getvalue())


@mutation("data: record with a view offset", RECORD)
def _(f: Forger) -> None:
    """A record whose storage is larger than the tensor (a view at an offset): the bytes at the start are others."""
    t = f.target_tensor()
    base = torch.cat([torch.full((7,), 3, dtype=t.dtype), t.reshape(-1)])
    buf = io.BytesIO()
    torch.save(base[7:].view(t.shape), buf)
    f.replace_record(buf.getvalue())


@mutation("data: truncated by one byte", TARGET, must_refuse=True)
def _(f: Forger) -> None:
    name = f.file
    f.rewrite(name, lambda d: d[:-1])
    f.reseal(name)


@mutation("data: truncated to half", TARGET, must_refuse=True, s3=True)
def _(f: Forger) -> None:
    name = f.file
    f.rewrite(name, lambda d: d[: len(d) // 2])
    f.reseal(name)


@mutation("data: junk appended", TARGET, must_refuse=True)
def _(f: Forger) -> None:
    name = f.file
    f.rewrite(name, lambda d: d + b"\x5a" * 100)
    f.reseal(name)


@mutation("data: a second trailer appended", TARGET)
def _(f: Forger) -> None:
    name = f.file
    f.rewrite(name, lambda d: d + d[-64:])
    f.reseal(name)


@mutation("data: trailer of another rank", TARGET)
def _(f: Forger) -> None:
    name = f.file
    save_id = f.manifest()["save_id"]
    f.rewrite(name, lambda d: d[:-64] + identity_trailer(save_id, 1))
    f.reseal(name)


@mutation("data: copied from another save", lambda f: (f.file, "save"), must_refuse=True, s3=True)
def _(f: Forger) -> None:
    name = f.file
    shutil.copyfile(f.pristine.other / name, f.path / name)
    f.reseal(name)


@mutation("data: copied from another save, trailer rewritten", TARGET)
def _(f: Forger) -> None:
    name = f.file
    save_id = f.manifest()["save_id"]
    shutil.copyfile(f.pristine.other / name, f.path / name)
    f.rewrite(name, lambda d: d[:-64] + identity_trailer(save_id, 0))
    f.reseal(name)


@mutation("data: .metadata copied from another save", METADATA, must_refuse=True, applies=lambda k: k == "module")
def _(f: Forger) -> None:
    shutil.copyfile(f.pristine.other / ".metadata", f.path / ".metadata")
    f.unread = True  # (the other save's records are not this manifest's)
    f.reseal(".metadata")


@mutation("data: two data files swapped", lambda f: (DATA, "__0_1.distcp", ".metadata"), applies=WHOLE)
def _(f: Forger) -> None:
    a, b = (f.path / DATA).read_bytes(), (f.path / "__0_1.distcp").read_bytes()
    (f.path / DATA).write_bytes(b)
    (f.path / "__0_1.distcp").write_bytes(a)
    f.reseal(DATA, "__0_1.distcp")


@mutation("chunk files swapped", TARGET, applies=CHUNKED, s3=True)
def _(f: Forger) -> None:
    a, b = (f.path / "__0_1.distcp").read_bytes(), (f.path / "__0_2.distcp").read_bytes()
    (f.path / "__0_1.distcp").write_bytes(b)
    (f.path / "__0_2.distcp").write_bytes(a)
    f.reseal("__0_1.distcp", "__0_2.distcp")


@mutation("chunk file removed with its entry", lambda f: ("__0_2.distcp",), must_refuse=True, applies=CHUNKED)
def _(f: Forger) -> None:
    (f.path / "__0_2.distcp").unlink()
    f.edit(lambda m: m["files"].pop("__0_2.distcp"))


@mutation(
    "chunk file emptied to its trailer", lambda f: ("__0_2.distcp", ".metadata"), must_refuse=True, applies=CHUNKED
)
def _(f: Forger) -> None:
    f.rewrite("__0_2.distcp", lambda d: d[-64:])
    f.reseal("__0_2.distcp")


# ---------------------------------------------------------------------- backends
def _archive(forged: Path, destination: Path) -> Path:
    """Rebuild the archive from the forged directory: every file as it is, with its actual size and CRC-32."""
    names = sorted((p.name for p in forged.iterdir() if p.name != "manifest.json"), key=lambda n: (n != ".metadata", n))
    files = [(n, forged / n, (forged / n).stat().st_size, file_checksum(forged / n)) for n in names]
    return write_archive(files, (forged / "manifest.json").read_bytes(), destination)


def _upload(forged: Path, url: str, options: dict[str, Any]) -> None:
    fs, root = fsspec.core.url_to_fs(url, **options)
    for p in forged.iterdir():
        fs.pipe_file(f"{root}/{p.name}", p.read_bytes())


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _memory_store() -> dict[str, Any]:
    fs = fsspec.filesystem("memory")
    return {k: bytes(v.getbuffer()) for k, v in fs.store.items()}


class Hang(BaseException):  # not an Exception: nothing inside the library may swallow it
    pass


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------- known findings
# (kind or "*", mutation, backend or "*") -> what happens; each is xfail(strict=True)
_IN_PLACE = ("module", "optimizer", "replay_buffer")  # kinds whose tensors are read in place (module, buffers)
KNOWN: dict[tuple[str, str, str], str] = {}


def _known(kind: str, name: str, backend: str) -> str | None:
    for k in ((kind, name, backend), (kind, name, "*"), ("*", name, backend), ("*", name, "*")):
        if k in KNOWN:
            return KNOWN[k]
    return None


def _cases() -> Iterator[Any]:
    for name, m in MUTATIONS.items():
        for kind in KINDS:
            if not m.applies(kind):
                continue
            backends = [b for b in m.backends if b == "directory" or kind in BACKEND_KINDS]
            backends += ["s3"] if m.s3 and kind == "module" else []
            for backend in backends:
                reason = _known(kind, name, backend)
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                yield pytest.param(kind, name, backend, marks=marks, id=f"{kind}-{name}-{backend}")


# ---------------------------------------------------------------------- the tests
def test_the_control_loads_exactly_and_resaves_the_same(pristine: Pristine, tmp_path: Path) -> None:
    """The pristine checkpoint loads into other objects exactly, on every backend (the judge of a success works)."""
    assert not same(snapshot(make_objects(1)), snapshot(make_objects(5)))
    for backend in ("directory", "archive", "memory"):
        where: Any = pristine.path
        if backend == "archive":
            where = _archive(pristine.path, tmp_path / f"{backend}.zip")
        elif backend == "memory":
            where = f"memory://tdcp-adversarial/{uuid.uuid4().hex}"
            _upload(pristine.path, where, {})
        tdcp.verify(where)
        objs = make_objects(5)
        tdcp.DistributedCheckpoint(**objs).load(where)
        loaded = snapshot(objs, every_row=False)
        expected = snapshot(make_objects(1), every_row=False)
        assert [
            k for k in loaded if not same(loaded[k], expected[k])
        ] == []  # make_objects(1) leaves the global streams as saved
        holds_exactly_the_files(objs, pristine.path, tmp_path / backend)


@pytest.mark.parametrize(("kind", "name", "backend"), list(_cases()))
def test_a_forgery_never_becomes_the_state(
    pristine: Pristine, tmp_path: Path, kind: str, name: str, backend: str, request: pytest.FixtureRequest
) -> None:
    mutation = MUTATIONS[name]
    forged = Path(shutil.copytree(pristine.path, tmp_path / "c"))
    (tmp_path / "outside.bin").write_bytes(b"outside the checkpoint")
    forger = Forger(forged, KINDS[kind], pristine)
    names = mutation.names(forger)  # before the mutation: the files as saved
    mutation.apply(forger)
    if forger.mirrored:  # the records moved in the manifest's storage entries too: an error may name either
        names = (*names, "manifest")

    options: dict[str, Any] = {}
    where: Any = forged
    if backend == "archive":
        where = _archive(forged, tmp_path / "forged.zip")
    elif backend == "memory":
        where = f"memory://tdcp-adversarial/{uuid.uuid4().hex}"
        _upload(forged, where, options)
    elif backend == "s3":
        s3 = request.getfixturevalue("s3")
        where, options = s3.url(), s3.storage_options
        _upload(forged, where, options)

    tree, store = _tree(tmp_path), _memory_store()
    objs = make_objects(5)
    before = snapshot(objs)
    verify_error: BaseException | None = None
    load_error: BaseException | None = None
    with deadline(CASE_SECONDS):
        try:
            tdcp.verify(where, storage_options=options) if options else tdcp.verify(where)
        except Exception as err:  # noqa: BLE001 - judged below
            verify_error = err
        try:
            tdcp.DistributedCheckpoint(storage_options=options, **objs).load(where)
        except Exception as err:  # noqa: BLE001 - judged below
            load_error = err
    assert _tree(tmp_path) == tree, "verify or load wrote into the test's directory"
    assert _memory_store() == store, "verify or load wrote into the memory store"
    if verify_error is not None:
        assert isinstance(verify_error, tdcp.CheckpointError), f"verify raised {verify_error!r}"

    problems: list[str] = []
    if verify_error is not None and not isinstance(verify_error, tdcp.CheckpointError):
        problems.append(f"verify raised {verify_error!r}")
    if forger.unread:  # only .metadata is forged: loads read the manifest's entries, verify compares the two
        if verify_error is None or "metadata" not in str(verify_error):
            problems.append(f"verify does not refuse a forged .metadata naming it: {verify_error}")
        if load_error is not None:
            problems.append(f"a load refused a .metadata it does not read: {load_error}")
        else:
            try:
                holds_exactly_the_files(objs, pristine.path, tmp_path)
            except AssertionError as err:
                problems.append(str(err).split("\n")[0])
    elif load_error is not None:
        if not isinstance(load_error, tdcp.CheckpointError):
            problems.append(f"load raised {load_error!r}")
        elif not any(n in str(load_error) for n in names):
            problems.append(f"the load error names none of {names}: {load_error}")
        after = snapshot(objs)
        changed = [k for k in before if not same(before[k], after[k])]
        if changed:
            problems.append(f"a refused load changed {changed}: {load_error}")
        if verify_error is None and not mutation.compatibility:
            problems.append(f"verify accepts what load refuses: {load_error}")
    else:
        if mutation.must_refuse:
            problems.append("the load accepted a forgery the format promises to refuse")
        if verify_error is not None:
            problems.append(f"load accepted what verify refuses: {verify_error}")
        try:
            holds_exactly_the_files(objs, forged, tmp_path)
        except Untrusted as err:
            problems.append(f"the load accepted files that do not decode: {err}")
        except AssertionError as err:
            problems.append(str(err).split("\n")[0])
    assert not problems, "; ".join(problems)
