"""Reading a ``torchrl.checkpoint`` checkpoint (directory or ``.torchrl`` ZIP archive) without running its content.

torchrl 0.14's :class:`torchrl.checkpoint.Checkpoint` writes ``manifest.json``
(``format: "torchrl.checkpoint"``, ``format_version: 1``) and one folder per
component under ``components/``, whose files its adapters choose:

- ``torchrl.json``: ``value.json``;
- ``torchrl.state_dict``: ``state.json`` (the schema of the state dict) and its tensors as
  a TensorDict memory-map folder ``state/``, a TensorDict archive ``state.tdz`` or a
  consolidated file ``state.tdc``; ``state.pt`` (``payload_format="torch"``) is a pickle,
  which this reader refuses;
- ``torchrl.dump_load``: what the object's ``dump`` wrote (replay buffers: see
  :mod:`torchrl_dcp.torchrl_format.buffers`).

Everything is parsed here: JSON, raw tensor bytes whose dtype and shape the JSON gives
(and that must match the file's size), never a pickle and never a class named by a file.
Every problem raises :class:`~torchrl_dcp.errors.CheckpointFormatError` (or
:class:`~torchrl_dcp.errors.CheckpointIntegrityError` for a file whose size contradicts
its description) naming the file.

Example:
    >>> import tempfile, torch
    >>> from torchrl.checkpoint import Checkpoint
    >>> from torchrl_dcp.torchrl_format.reader import TorchrlContainer
    >>> path = Checkpoint(policy=torch.nn.Linear(2, 1)).save(tempfile.mkdtemp() + "/c")
    >>> box = TorchrlContainer.open(path)
    >>> box.components()["policy"]["adapter"]
    'torchrl.state_dict'
    >>> sorted(box.state_dict_payload("policy"))
    ['bias', 'weight']
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import stat
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
)
from torchrl_dcp.format.manifest import check_parse_cost
from torchrl_dcp.format.manifest_depth import check_depth
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.torchrl_format.detect import (
    FORMAT_NAME,
    JSON_LIMIT,
    MANIFEST,
    ZIPFILE_ERRORS,
    is_torchrl_checkpoint,
    open_zip,
)

__all__ = ["FORMAT_NAME", "TorchrlContainer", "is_torchrl_checkpoint"]  # (detection: .detect, torch-free)

FORMAT_VERSION = 1
ADAPTERS = ("torchrl.json", "torchrl.state_dict", "torchrl.dump_load")
#: dtypes a tensor of a torchrl checkpoint may have (the names its files use), and numpy arrays' dtypes
DTYPES = {
    f"torch.{name}": getattr(torch, name)
    for name in (
        "float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint8 "
        "uint16 uint32 uint64 bool float8_e4m3fn float8_e5m2"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
NUMPY_KINDS = "biufc"  # bool, ints, unsigned, floats, complex: never objects or structured dtypes


class TorchrlContainer:
    """The files of one ``torchrl.checkpoint`` checkpoint, read-only and size-checked.

    Only the files the manifest lists are ever read, through :meth:`read`; member names
    are relative, without ``..``, and (in a directory) never followed through a link.
    """

    def __init__(self, path: Path, archive: zipfile.ZipFile | None) -> None:
        self.path = path
        self._zip = archive
        self._members = {i.filename: i for i in archive.infolist()} if archive is not None else {}
        self.manifest = self._read_manifest()

    @classmethod
    def open(cls, path: str | os.PathLike) -> TorchrlContainer:
        from torchrl_dcp.storage.urls import is_file_url, resolve_path  # (``file://``: the local path it spells)

        p = Path(resolve_path(path) if is_file_url(path) else path)
        p = p.expanduser().absolute()
        if not p.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {p}", path=p)
        if p.is_dir():
            return cls(p, None)
        try:
            return cls(p, open_zip(p))
        except ZIPFILE_ERRORS as err:
            raise CheckpointFormatError(f"not a torchrl.checkpoint archive: {str(err)[:200]}", path=p) from None

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def __enter__(self) -> TorchrlContainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ files
    @property
    def is_archive(self) -> bool:
        return self._zip is not None

    def where(self, name: str) -> str:
        return f"{self.path}::{name}" if self._zip is not None else str(self.path / name)

    def size(self, name: str) -> int:
        """The size of member ``name`` (raises when it is absent or not a regular file)."""
        safe = _safe_name(name, self.path)
        if self._zip is not None:
            info = self._members.get(safe)
            if info is None or info.is_dir():
                raise CheckpointIntegrityError("a file the checkpoint lists is missing", path=self.where(name))
            return info.file_size
        full = self.path / safe
        try:
            st = full.lstat()
        except FileNotFoundError:
            raise CheckpointIntegrityError("a file the checkpoint lists is missing", path=full) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError("not a regular file (a link, a folder or a device)", path=full)
        for parent in PurePosixPath(safe).parents:  # no folder on the way may be a link out of the checkpoint
            if str(parent) != "." and (self.path / parent).is_symlink():
                raise CheckpointFormatError("a folder of the checkpoint is a link", path=self.path / parent)
        return st.st_size

    def read(self, name: str, limit: int | None = None) -> bytes:
        """Member ``name``'s bytes (at most ``limit``: a larger file is refused before it is read)."""
        size = self.size(name)
        if limit is not None and size > limit:
            raise CheckpointFormatError(
                f"{size} bytes, more than the {limit} such a file may hold", path=self.where(name)
            )
        safe = _safe_name(name, self.path)
        if self._zip is not None:
            data = zip_member(self._zip, self._members[safe], size + 1, self.where(name))
        else:
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # swapped for a FIFO
            fd = os.open(self.path / safe, flags)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise CheckpointFormatError(
                        "not a regular file (a link, a folder or a device)", path=self.where(name)
                    )
                data = f.read(size + 1)
        if len(data) != size:
            raise CheckpointIntegrityError(f"holds {len(data)} bytes, its size said {size}", path=self.where(name))
        return data

    def read_json(self, name: str) -> Any:
        raw = self.read(name, JSON_LIMIT)
        check_parse_cost(raw, self.where(name))  # a forged file dense in JSON values is refused before it is parsed
        try:
            return loads_json(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise CheckpointFormatError(f"not valid JSON: {str(err)[:200]}", path=self.where(name)) from None

    # ------------------------------------------------------------------ manifest
    def _read_manifest(self) -> dict[str, Any]:
        manifest = self.read_json(MANIFEST)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise CheckpointFormatError("not a torchrl.checkpoint checkpoint", path=self.where(MANIFEST))
        version = manifest.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise CheckpointFormatError(
                f"torchrl.checkpoint format version {version!r}: this library reads version {FORMAT_VERSION} "
                "(torchrl 0.14); load it with the torchrl that wrote it",
                path=self.where(MANIFEST),
            )
        components = manifest.get("components")
        if not isinstance(components, dict):
            raise CheckpointFormatError("the manifest has no component mapping", path=self.where(MANIFEST))
        for name, record in components.items():
            self._check_record(name, record)
        for key in ("metadata", "versions"):  # (null: none, as torchrl reads them)
            if not isinstance(manifest.get(key) or {}, dict):
                raise CheckpointFormatError(f"the manifest's {key} is not a mapping", path=self.where(MANIFEST))
        return manifest

    def _check_record(self, name: Any, record: Any) -> None:
        where = self.where(MANIFEST)
        ok = (
            isinstance(name, str)
            and name
            and isinstance(record, dict)
            and isinstance(record.get("adapter"), str)
            and isinstance(record.get("adapter_version"), int)
            and not isinstance(record.get("adapter_version"), bool)
            and isinstance(record.get("path"), str)
            and isinstance(record.get("files"), list)
            and all(isinstance(f, str) for f in record["files"])
        )
        if not ok:
            raise CheckpointFormatError(f"component {name!r} has a malformed record", path=where)
        _safe_name(record["path"], where)
        for f in record["files"]:
            _safe_name(f"{record['path']}/{f}", where)

    def components(self) -> dict[str, dict[str, Any]]:
        return self.manifest["components"]

    def record(self, name: str) -> dict[str, Any]:
        return self.components()[name]

    def component_file(self, name: str, relative: str) -> str | None:
        """The member name of ``relative`` inside component ``name``, ``None`` when the manifest does not list it."""
        rec = self.record(name)
        return f"{rec['path']}/{relative}" if relative in rec["files"] else None

    def component_files(self, name: str) -> list[str]:
        rec = self.record(name)
        return [f"{rec['path']}/{f}" for f in rec["files"]]

    def check_sizes(self, name: str) -> int:
        """Every file component ``name`` lists exists as a regular file; returns their total size."""
        return sum(self.size(f) for f in self.component_files(name))

    # ------------------------------------------------------------------ payloads
    def json_payload(self, name: str) -> Any:
        member = self.need(name, "value.json")
        return self.read_json(member)

    def state_dict_payload(self, name: str, device: Any = None) -> Any:
        """The state dict a ``torchrl.state_dict`` component holds, decoded from its schema (no pickle)."""
        rec = self.record(name)
        if "state.pt" in rec["files"]:
            raise CheckpointFormatError(
                f"component {name!r} was saved with payload_format='torch' (a pickle), which torchrl_dcp never "
                "loads: load it with torchrl.checkpoint in a process you trust and save it again with the default "
                "payload format, or with DistributedCheckpoint",
                path=self.where(rec["path"] + "/state.pt"),
            )
        tensors = self._state_tensors(name)
        schema = self.read_json(self.need(name, "state.json"))
        where = self.where(f"{rec['path']}/state.json")
        check_depth(schema, where)  # decoded recursively: a deeper schema is refused first
        used: set[str] = set()
        state = decode_schema(schema, tensors, used, where, device)
        unused = set(tensors) - used
        if unused:
            raise CheckpointFormatError(
                f"component {name!r}: tensors its schema does not use: {sorted(unused)[:5]}",
                path=self.where(rec["path"]),
            )
        return state

    def _state_tensors(self, name: str) -> dict[str, torch.Tensor]:
        rec = self.record(name)
        files = rec["files"]
        if "state/meta.json" in files:
            return read_memmap_folder(self, f"{rec['path']}/state", flat=True)
        if "state.tdz" in files:
            return read_tensordict_archive(self, self.need(name, "state.tdz"))
        if "state.tdc" in files:
            return read_consolidated(self, self.need(name, "state.tdc"))
        raise CheckpointFormatError(f"component {name!r} holds no state-dict payload", path=self.where(rec["path"]))

    def need(self, name: str, relative: str, what: str = "") -> str:
        """The member name of ``relative`` inside component ``name``; refused when the manifest does not list it
        (``what``: what a component without it is not, for the message)."""
        member = self.component_file(name, relative)
        if member is None:
            raise CheckpointFormatError(
                f"component {name!r} does not list {relative}" + (f": {what}" if what else ""),
                path=self.where(self.record(name)["path"]),
            )
        return member


def _safe_name(name: str, where: Any) -> str:
    p = PurePosixPath(name.replace("\\", "/"))
    if not name or "\x00" in name or p.is_absolute() or ".." in p.parts or any(":" in part for part in p.parts[:1]):
        raise CheckpointFormatError(f"unsafe member name {name!r}", path=where)
    return str(p)


# ---------------------------------------------------------------------- tensors
def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: list[int], where: str) -> torch.Tensor:
    """A fresh tensor of ``dtype``/``shape`` holding exactly ``data`` (refused when the sizes differ)."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != numel * itemsize:
        raise CheckpointIntegrityError(
            f"holds {len(data)} bytes, its description ({dtype}, shape {list(shape)}) needs {numel * itemsize}",
            path=where,
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype a torchrl file names (``"torch.float32"``), ``None`` for anything else (any JSON value)."""
    return DTYPES.get(name) if isinstance(name, str) else None


@contextlib.contextmanager
def reading(what: str, where: Any) -> Iterator[None]:
    """Turn an error no check foresaw while reading ``what`` (a component) at ``where`` into a
    :class:`CheckpointFormatError` naming both: torchrl's files have no checksums, so any value in them may be
    anything, and no reader may let a raw ``TypeError`` or ``KeyError`` out."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as err:
        raise CheckpointFormatError(
            f"{what}: malformed torchrl data ({type(err).__name__}: {str(err)[:200]}): the checkpoint is damaged or "
            "was altered",
            path=where,
        ) from None


def leaf_spec(entry: Any, where: str) -> tuple[torch.dtype, list[int]]:
    if not isinstance(entry, dict) or entry.get("is_nested", False):
        raise CheckpointFormatError("a tensor description is malformed (or a nested tensor)", path=where)
    dtype = dtype_named(entry.get("dtype"))
    shape = entry.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise CheckpointFormatError(f"a tensor has dtype {entry.get('dtype')!r}, shape {shape!r}", path=where)
    return dtype, shape


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: keys of a TensorDict memory-map ``meta.json`` that describe the folder itself, not an entry
META_KEYS = {"shape", "device", "_type", "names", "batch_size", "is_locked"}
PLAIN_TENSORDICT = "<class 'tensordict._td.TensorDict'>"


def check_entry_name(key: Any, where: Any) -> str:
    """An entry of a memory-map ``meta.json``: one plain path segment (its file is ``<key>.memmap``, a nested entry
    its folder ``<key>/``): ``.``, ``..``, an empty name or one holding ``/`` names no entry (``.`` led a load into
    the same folder again, without end)."""
    if not isinstance(key, str) or key in ("", ".", "..") or "/" in key or "\\" in key or "\x00" in key:
        raise CheckpointFormatError(f"entry name {key!r} names no entry of a tensordict folder", path=where)
    return key


def read_memmap_folder(box: TorchrlContainer, folder: str, *, flat: bool = False) -> dict[str, Any]:
    """A TensorDict memory-map folder (``meta.json`` + ``<key>.memmap``, sub-folders for nested entries) as nested
    dicts of fresh tensors. ``flat``: nested entries are refused. Only plain TensorDicts are read (the class a
    ``meta.json`` names is never imported)."""
    meta_name = f"{folder}/meta.json"
    meta = box.read_json(meta_name)
    if not isinstance(meta, dict) or meta.get("_type", PLAIN_TENSORDICT) != PLAIN_TENSORDICT:
        raise CheckpointFormatError(
            f"a tensordict of type {meta.get('_type') if isinstance(meta, dict) else None!r}: only plain "
            "TensorDicts are read from a torchrl checkpoint",
            path=box.where(meta_name),
        )
    out: dict[str, Any] = {}
    for key, entry in meta.items():
        if key in META_KEYS:
            continue
        check_entry_name(key, box.where(meta_name))
        if entry == {"type": "NonTensorData"}:  # (a None: a sampler without replacement that never sampled)
            out[key] = _none_entry(box, f"{folder}/{key}")
            continue
        if isinstance(entry, dict) and "dtype" not in entry:  # a nested tensordict: its own folder
            if flat:
                raise CheckpointFormatError(f"unexpected nested entry {key!r}", path=box.where(meta_name))
            out[key] = read_memmap_folder(box, f"{folder}/{key}")
            continue
        dtype, shape = leaf_spec(entry, box.where(meta_name))
        if math.prod(shape) == 0:  # tensordict writes no file for a tensor without elements
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        member = f"{folder}/{key}.memmap"
        out[key] = tensor_from_bytes(box.read(member), dtype, shape, box.where(member))
    return out


#: what tensordict writes for a ``None`` entry (``NonTensorData(None)``), in the entry's own folder
_NONE_ENTRY = {"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "data": None, "_is_non_tensor": True}


def _none_entry(box: TorchrlContainer, folder: str) -> None:
    """A non-tensor entry of a memory-map folder, read when it holds ``None`` (any other value is refused: it would be
    built by the class its ``meta.json`` names)."""
    meta_name = f"{folder}/meta.json"
    meta = box.read_json(meta_name)
    if not (isinstance(meta, dict) and {k: meta.get(k) for k in _NONE_ENTRY} == _NONE_ENTRY):
        raise CheckpointFormatError(
            "a non-tensor entry other than None: torchrl_dcp reads tensors and None from a torchrl checkpoint's "
            "memory-map folders",
            path=box.where(meta_name),
        )
    return None


def zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, where: str) -> bytes:
    """At most ``limit`` bytes of an archive's member: every way its bytes can fail to come out (a CRC that does not
    match, a damaged deflate stream, a compression method or encryption this Python cannot read, a truncated
    archive) is a :class:`CheckpointIntegrityError` naming it."""
    try:
        with archive.open(info) as f:
            return f.read(limit)
    except ZIPFILE_ERRORS as err:
        raise CheckpointIntegrityError(
            f"cannot be read from its archive ({type(err).__name__}: {str(err)[:200]}): the checkpoint is damaged, or "
            "written by a tool this reader does not follow",
            path=where,
        ) from None


def read_tensordict_archive(box: TorchrlContainer, member: str) -> dict[str, torch.Tensor]:
    """A TensorDict archive (``state.tdz``: a ZIP of a flat memory-map folder, stored uncompressed)."""
    import io

    raw = box.read(member)
    where = box.where(member)
    try:
        inner = zipfile.ZipFile(io.BytesIO(raw))
    except ZIPFILE_ERRORS as err:
        raise CheckpointFormatError(f"not a TensorDict archive: {err}", path=where) from None
    with inner:
        infos = {i.filename: i for i in inner.infolist()}
        if "meta.json" not in infos or infos["meta.json"].file_size > JSON_LIMIT:
            raise CheckpointFormatError("a TensorDict archive without a readable meta.json", path=where)
        try:
            meta = loads_json(zip_member(inner, infos["meta.json"], JSON_LIMIT, f"{where}::meta.json"))
        except (ValueError, RecursionError) as err:
            raise CheckpointFormatError(f"its meta.json is not valid JSON: {str(err)[:200]}", path=where) from None
        if not isinstance(meta, dict) or meta.get("_type", PLAIN_TENSORDICT) != PLAIN_TENSORDICT:
            raise CheckpointFormatError("only plain TensorDict archives are read", path=where)
        out = {}
        for key, entry in meta.items():
            if key in META_KEYS:
                continue
            dtype, shape = leaf_spec(entry, where)
            info = infos.get(f"{key}.memmap")
            if info is None and math.prod(shape) == 0:  # no file for a tensor without elements
                out[key] = torch.empty(shape, dtype=dtype)
                continue
            if info is None:
                raise CheckpointIntegrityError(f"the archive lacks {key}.memmap", path=where)
            expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if info.file_size != expected:
                raise CheckpointIntegrityError(f"{key}.memmap holds {info.file_size} bytes, not {expected}", path=where)
            member = f"{where}::{key}.memmap"
            out[key] = tensor_from_bytes(zip_member(inner, info, expected, member), dtype, shape, member)
    return out


def read_consolidated(box: TorchrlContainer, member: str) -> dict[str, torch.Tensor]:
    """A consolidated TensorDict file (``state.tdc``): the tensors' bytes, a JSON description, its length (8 bytes)."""
    raw = memoryview(box.read(member))
    where = box.where(member)
    if len(raw) < 8:
        raise CheckpointIntegrityError("too short for a consolidated TensorDict", path=where)
    json_len = int.from_bytes(raw[-8:], "little")
    if json_len > len(raw) - 8:
        raise CheckpointIntegrityError("its description's length exceeds the file", path=where)
    end = len(raw) - 8 - json_len
    try:
        meta = loads_json(bytes(raw[end : len(raw) - 8]))
    except ValueError as err:
        raise CheckpointFormatError(f"its description is not valid JSON: {err}", path=where) from None
    if not isinstance(meta, dict) or meta.get("cls") != "TensorDict" or meta.get("non_tensors"):
        raise CheckpointFormatError("only flat, plain consolidated TensorDicts are read", path=where)
    leaves = meta.get("leaves")
    if not isinstance(leaves, dict):
        raise CheckpointFormatError("a consolidated TensorDict without leaves", path=where)
    out = {}
    for key, leaf in leaves.items():
        if not (isinstance(leaf, list) and len(leaf) >= 4 and _is_count(leaf[2]) and _is_count(leaf[3])):
            raise CheckpointFormatError(f"leaf {key!r} is malformed", path=where)
        dtype, shape = leaf_spec({"dtype": leaf[0], "shape": leaf[1]}, where)
        start, stop = leaf[2], leaf[3]
        pad = leaf[4] if len(leaf) > 4 else 0  # bytes after the tensor's, aligning the next leaf (tensordict 0.14)
        if not _is_count(pad) or not start <= stop - pad <= stop <= end:
            raise CheckpointIntegrityError(f"leaf {key!r} lies outside the data", path=where)
        out[key] = tensor_from_bytes(raw[start : stop - pad], dtype, shape, f"{where}::{key}")
    return out


# ---------------------------------------------------------------------- the state-dict schema
def decode_schema(node: Any, tensors: Mapping[str, torch.Tensor], used: set[str], where: str, device: Any) -> Any:
    """One node of torchrl's state-dict schema (``{"kind": ..., ...}``) as the value ``state_dict()`` returned."""
    if not isinstance(node, dict) or not isinstance(node.get("kind"), str):
        raise CheckpointFormatError(f"a schema node is malformed: {str(node)[:80]}", path=where)
    kind = node["kind"]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise CheckpointFormatError(f"unknown schema kind {kind!r}", path=where)
    try:
        return decoder(node, tensors, used, where, device)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - what torch or numpy make of a forged value (a device "nodev:7", an
        # int8 of 100000, an int past a float): the node is malformed, whichever constructor says so
        raise CheckpointFormatError(
            f"a {kind!r} schema node is malformed ({type(err).__name__}: {err})", path=where
        ) from None


def _items(node: Mapping[str, Any], tensors: Any, used: set[str], where: str, device: Any) -> list[Any]:
    items = node["items"]
    if not isinstance(items, list):
        raise TypeError("items is not a list")
    return [decode_schema(i, tensors, used, where, device) for i in items]


def _tensor(node: Mapping[str, Any], tensors: Any, used: set[str], where: str, device: Any) -> torch.Tensor:
    key = node["key"]
    if key not in tensors:
        raise CheckpointFormatError(f"the schema names tensor {key!r}, which the payload lacks", path=where)
    if key in used:
        raise CheckpointFormatError(f"the schema uses tensor {key!r} twice", path=where)
    used.add(key)
    target = device(str(node.get("device", "cpu"))) if callable(device) else torch.device("cpu")
    return tensors[key].to(target)


def _numpy(node: Mapping[str, Any], tensors: Any, used: set[str], where: str, device: Any) -> np.ndarray:
    dtype = np.dtype(str(node["dtype"]))
    if dtype.kind not in NUMPY_KINDS or dtype.fields is not None:
        raise CheckpointFormatError(f"numpy dtype {node['dtype']!r} is not read", path=where)
    return _tensor(node, tensors, used, where, None).numpy().astype(dtype, copy=True)


def _mapping(node: Mapping[str, Any], tensors: Any, used: set[str], where: str, device: Any) -> Any:
    out: Any = OrderedDict() if node["kind"] == "ordered_dict" else {}
    for pair in node["items"]:
        if not isinstance(pair, list) or len(pair) != 2:
            raise TypeError("a mapping item is not a [key, value] pair")
        key = decode_schema(pair[0], tensors, used, where, device)
        if isinstance(key, (dict, list, set, bytearray, torch.Tensor, np.ndarray)):
            raise TypeError(f"an unhashable key of type {type(key).__name__}")
        out[key] = decode_schema(pair[1], tensors, used, where, device)
    if node.get("metadata") is not None:
        if not isinstance(out, OrderedDict):  # (torchrl records a module state dict's, an OrderedDict's, only)
            raise TypeError("a plain dict node carries metadata")
        out._metadata = decode_schema(node["metadata"], tensors, used, where, device)
    return out


def _torch_dtype(node: Mapping[str, Any], *_: Any) -> torch.dtype:
    dtype = dtype_named(f"torch.{node['value']}") if isinstance(node.get("value"), str) else None
    if dtype is None:
        raise ValueError(f"unknown torch dtype {node['value']!r}")
    return dtype


def _numpy_scalar(node: Mapping[str, Any], *_: Any) -> Any:
    dtype = np.dtype(str(node["dtype"]))
    if dtype.kind not in NUMPY_KINDS:
        raise ValueError(f"numpy dtype {node['dtype']!r} is not read")
    value = node["value"]
    if not isinstance(value, (bool, int, float, list)):
        raise TypeError("a numpy scalar's value is not a number")
    return dtype.type(complex(*value) if isinstance(value, list) else value)


def _plain(node: Mapping[str, Any], *_: Any) -> Any:
    value = node["value"]
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"a value of type {type(value).__name__}")
    return value


def _ints(values: Any) -> list[Any]:
    if not isinstance(values, list) or not all(
        v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values
    ):
        raise TypeError("expected a list of integers")
    return values


def _b64(node: Mapping[str, Any], *_: Any) -> Any:
    decoded = base64.b64decode(str(node["value"]), validate=True)
    return decoded if node["kind"] == "bytes" else bytearray(decoded)


_COLLECTIONS = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}
_DECODERS: dict[str, Any] = {
    "tensor": _tensor,
    "numpy": _numpy,
    "dict": _mapping,
    "ordered_dict": _mapping,
    **{k: (lambda n, t, u, w, d, _c=c: _c(_items(n, t, u, w, d))) for k, c in _COLLECTIONS.items()},
    "torch_size": lambda n, *_: torch.Size([int(v) for v in _ints(n["items"])]),
    "slice": lambda n, t, u, w, d: slice(*_items(n, t, u, w, d)),
    "range": lambda n, *_: range(*_ints(n["items"])),
    "torch_device": lambda n, *_: torch.device(str(n["value"])),
    "torch_dtype": _torch_dtype,
    "path": lambda n, *_: Path(str(n["value"])),
    "bytes": _b64,
    "bytearray": _b64,
    "complex": lambda n, *_: complex(float(n["real"]), float(n["imag"])),
    "numpy_scalar": _numpy_scalar,
    "ellipsis": lambda n, *_: Ellipsis,
    "value": _plain,
}
