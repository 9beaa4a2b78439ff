"""DCP's metadata (``.metadata``) as bytes in, values out: parsed without running code, checked against the manifest.

DCP reads ``.metadata`` with ``pickle.load``. :func:`parse_metadata` uses an
unpickler that admits only DCP's metadata classes, torch dtypes/sizes/layouts and
paths, and builds at most :data:`METADATA_PARSE_RATIO` times the file's size in
objects; :func:`check_storage_bounds` proves that every record it names lies inside a
file the manifest lists; :func:`record_index` looks records up by key.

Example:
    >>> import pickle
    >>> from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
    >>> parse_metadata(pickle.dumps(Metadata(state_dict_metadata={})), "x/.metadata").state_dict_metadata
    {}
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import weakref
from collections.abc import Collection, Mapping
from typing import Any, BinaryIO, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, UnsafeCheckpointError
from torchrl_dcp.format.codec import MAX_EQUAL_HASHES
from torchrl_dcp.format.layout import is_data_file, is_plain_name

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


def _opcode_costs() -> tuple[int, ...]:
    """Bytes of Python objects each pickle opcode may leave built (CPython, 64-bit), by opcode: the object it
    makes (an empty set 216, a dict 64, a list 56, an instance 56, an int 32, a str's header ~80...) and the
    8-byte slot holding it (on the stack, in a list or tuple), or the memo entry it adds (~80 with its key)."""
    slot = 8
    costs = [0] * 256  # (opcodes that only move objects: APPEND(S), SETITEM(S), ADDITEMS, POP, STOP, ...)
    table = (
        (slot, "NONE NEWTRUE NEWFALSE EMPTY_TUPLE DUP GET BINGET LONG_BINGET BININT1"),  # (existing objects)
        (slot, "GLOBAL STACK_GLOBAL EXT1 EXT2 EXT4"),
        (32 + slot, "INT BININT BININT2 LONG LONG1 LONG4"),
        (24 + slot, "FLOAT BINFLOAT"),
        (80 + slot, "UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8"),
        (64 + slot, "STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 REDUCE OBJ INST"),
        (56 + slot, "EMPTY_LIST LIST MARK NEWOBJ NEWOBJ_EX"),  # MARK: a new stack list, the old one kept
        (64 + slot, "EMPTY_DICT DICT"),
        (216 + slot, "EMPTY_SET FROZENSET"),
        (40 + slot, "TUPLE"),
        (48, "TUPLE1"),  # (a tuple in place of the slot of what it holds)
        (56, "TUPLE2"),
        (64, "TUPLE3 BUILD"),  # BUILD: the instance's attribute dict
        (80, "PUT BINPUT LONG_BINPUT MEMOIZE"),  # a memo entry, its int key (measured: ~78 for 2M entries)
    )
    for cost, names in table:
        for name in names.split():
            costs[getattr(pickle, name)[0]] = cost
    return tuple(costs)


#: what each opcode is charged (:func:`_opcode_costs`); the bytes a str, bytes or int reads are not charged (at
#: most ~4 bytes per byte read), nor dict and set entries beyond their items' slots (a dict or set of 3- to 5-byte
#: int keys builds ~2.5x what it is charged, ~21-29x its size)
_OPCODE_COST = _opcode_costs()
#: ``.metadata`` is unpickled only while the objects its opcodes build (as :data:`_OPCODE_COST` charges them) stay
#: within this multiple of its size plus :data:`METADATA_PARSE_FLOOR`. Measured (Python 3.11): DCP's metadata of
#: 5,000 whole tensors is charged ~10-13x its size (its real peak ~11-12x), of 100 tensors in 50 row chunks ~16-21x
#: (real peak ~12-21x); a forgery of 1-byte ``EMPTY_SET`` opcodes built ~224x before this bound
METADATA_PARSE_RATIO = 64
METADATA_PARSE_FLOOR = 1 << 20


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # Python's: its opcodes are overridable
    """The allow-list unpickler: globals from :data:`_ALLOWED` only, and ``BUILD`` (which sets attributes or calls
    ``__setstate__``) only on objects this unpickling created with ``NEWOBJ``; what it builds is bounded by
    :data:`METADATA_PARSE_RATIO` times the input's size (``size``).

    ``find_class`` alone is not enough: ``BUILD`` applies to whatever is on the stack, an allowed class or
    function itself included (``setattr(pathlib.PosixPath, "__fspath__", ...)`` patches every later path of the
    process, even when the metadata is refused afterwards) or a singleton an allowed callable returns (an enum
    member). Python's unpickler is used because the C one cannot refuse that; it is ~4× slower (5,000 tensors:
    ~60 ms), and only ``verify``, format-4 loads and DCP-written saves parse ``.metadata``.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: BinaryIO, source: str, size: int) -> None:
        super().__init__(file)
        self.source = source
        self.size = size
        self.budget = METADATA_PARSE_RATIO * size + METADATA_PARSE_FLOOR
        self._created: dict[int, Any] = {}  # id -> object (held: an id is never reused meanwhile)
        self._hashes: dict[int, tuple[Any, dict[int, int]]] = {}  # id of a dict or set -> (it, {hash: keys})

    def load(self) -> Any:
        """``pickle._Unpickler.load`` (as in Python 3.10 to 3.13), each opcode charged its :data:`_OPCODE_COST` before it
        runs: refused once the charges pass :attr:`budget` (a ``.metadata`` of 1-byte ``EMPTY_SET`` opcodes built
        ~224x its size). Inline, not a wrapper per opcode: 5,000 tensors parse as fast as without it."""
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch, costs = self.read, self.dispatch, _OPCODE_COST
        spent, budget = 0, self.budget
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                code = key[0]
                spent += costs[code]
                if spent > budget:
                    raise self._refused(
                        f"its opcodes would build over {budget >> 20} MiB of objects, more than "
                        f"{METADATA_PARSE_RATIO}x its size (+{METADATA_PARSE_FLOOR >> 20} MiB); no save writes "
                        "metadata that dense"
                    )
                dispatch[code](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def _refused(self, what: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(
            f"refused to unpickle DCP metadata of {self.size} bytes: {what}; the file is damaged or forged, do not "
            "load it",
            path=self.source,
        )

    def _bytearray8(self) -> None:
        """``BYTEARRAY8``, whose length is allocated (and zeroed) before its bytes are read: never past the input."""
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self.size:
            raise self._refused(f"it claims a bytearray of {size} bytes, more than the whole file")
        data = bytearray(size)
        self.readinto(data)
        self.append(data)

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refused to unpickle {module}.{name}: DCP metadata may only hold DCP's metadata classes; "
            "the file was damaged or planted, do not load it",
            path=self.source,
        )

    def _new_object(self, load: Any, at: int) -> None:
        cls = self.stack[at]
        if not isinstance(cls, type) or cls.__new__ is not object.__new__:
            raise UnsafeCheckpointError(  # an enum's __new__ returns its shared member: BUILD would then patch it
                f"refused to unpickle: the metadata creates a {getattr(cls, '__name__', cls)!r:.60} with NEWOBJ, "
                "which DCP uses only for its metadata dataclasses (new objects); the file was damaged or planted, "
                "do not load it",
                path=self.source,
            )
        load(self)
        made = self.stack[-1]
        self._created[id(made)] = made

    def _build(self) -> None:
        target = self.stack[-2]
        if self._created.get(id(target)) is not target:
            raise UnsafeCheckpointError(
                f"refused to unpickle: the metadata sets the state of {type(target).__name__} {target!r:.60}, an "
                "object it did not create (an attempt to patch a class or shared object); the file was damaged or "
                "planted, do not load it",
                path=self.source,
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _count_hashes(self, container: Any, keys: Any) -> None:
        """Count the hashes of the non-str ``keys`` going into ``container`` (``None``: one built from them alone);
        refuse more than :data:`~torchrl_dcp.format.codec.MAX_EQUAL_HASHES` of one hash: a dict or set of n keys
        sharing one (ints ``k + i * (2**61 - 1)``) takes n**2 / 2 comparisons to build (60,000 took 14 s)."""
        others = [k for k in keys if type(k) is not str]  # str hashes are randomized: no forger makes them collide
        if not others:
            return  # (the common case: an object's attributes; its container is never tracked)
        if container is None:
            counts: dict[int, int] = {}
        else:
            held = self._hashes.get(id(container))
            if held is None:
                held = self._hashes[id(container)] = (container, {})  # (held: its id is never reused meanwhile)
            counts = held[1]
        for key in others:
            try:
                h = hash(key)
            except TypeError:
                continue  # unhashable: the opcode itself refuses it
            n = counts[h] = counts.get(h, 0) + 1
            if n > MAX_EQUAL_HASHES:
                raise self._refused(
                    f"more than {MAX_EQUAL_HASHES} of its keys share one hash ({type(key).__name__} {key!r:.40}): "
                    "building that container takes quadratic time, and no save writes one"
                )

    # dicts and sets grow key by key: their keys' hashes are counted on the way (a fresh one: its items at once);
    # a malformed stack is left to the opcode itself, which says so
    def _setitem(self) -> None:
        if len(self.stack) >= 3:
            self._count_hashes(self.stack[-3], (self.stack[-2],))
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def _setitems(self) -> None:
        if self.metastack and self.metastack[-1]:
            self._count_hashes(self.metastack[-1][-1], self.stack[0::2])
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def _additems(self) -> None:
        if self.metastack and self.metastack[-1]:
            self._count_hashes(self.metastack[-1][-1], self.stack)
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]

    def _frozenset(self) -> None:
        self._count_hashes(None, self.stack)
        pickle._Unpickler.load_frozenset(self)  # type: ignore[attr-defined]

    def _dict(self) -> None:
        self._count_hashes(None, self.stack[0::2])
        pickle._Unpickler.load_dict(self)  # type: ignore[attr-defined]

    def _reduce(self) -> None:
        func, args = (self.stack[-2], self.stack[-1]) if len(self.stack) >= 2 else (None, None)
        items = args[0] if isinstance(args, tuple) and args and isinstance(args[0], (list, tuple)) else ()
        if func in (set, frozenset):
            self._count_hashes(None, items)
        elif func is collections.OrderedDict:
            self._count_hashes(None, [p[0] for p in items if isinstance(p, (list, tuple)) and p])
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    dispatch[pickle.SETITEM[0]] = _setitem
    dispatch[pickle.SETITEMS[0]] = _setitems
    dispatch[pickle.ADDITEMS[0]] = _additems
    dispatch[pickle.FROZENSET[0]] = _frozenset
    dispatch[pickle.DICT[0]] = _dict
    dispatch[pickle.REDUCE[0]] = _reduce

    # (the class is below its arguments: one tuple for NEWOBJ, a tuple and a dict for NEWOBJ_EX)
    dispatch[pickle.NEWOBJ[0]] = lambda self: self._new_object(pickle._Unpickler.load_newobj, -2)  # type: ignore[attr-defined]
    dispatch[pickle.NEWOBJ_EX[0]] = lambda self: self._new_object(pickle._Unpickler.load_newobj_ex, -3)  # type: ignore[attr-defined]
    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.BYTEARRAY8[0]] = _bytearray8


def parse_metadata(data: bytes, where: Any) -> Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, through the allow-list unpickler only (refused,
    naming ``where``, once its opcodes would build more than :data:`METADATA_PARSE_RATIO` times its size)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), str(where), len(data)).load()
    except CheckpointIntegrityError:  # (refusals: an unsafe global, a forged cost)
        raise
    except Exception as err:
        raise CheckpointIntegrityError(
            f"DCP metadata cannot be read ({type(err).__name__}: {err})", path=where
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata", path=where)
    _check_containers(metadata, where)
    return metadata


def _check_containers(metadata: Metadata, where: Any) -> None:
    """The containers DCP writes, of the types it writes: every later check may then iterate them."""
    state, storage = metadata.state_dict_metadata, metadata.storage_data
    ok = isinstance(state, dict) and all(isinstance(k, str) for k in state)
    ok = ok and (storage is None or isinstance(storage, dict))
    ok = ok and all(isinstance(i, MetadataIndex) and isinstance(i.fqn, str) for i in storage or {})
    if not ok:
        raise CheckpointFormatError(
            "DCP metadata has containers of the wrong types (damaged or forged): refused", path=where
        )


RecordIndex = dict[str, dict[tuple[int, ...], Any]]
_INDEXES: dict[int, RecordIndex] = {}


def chunk_specs(
    metadata: Metadata, keys: Any = None
) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    """``{(key, chunk offsets): (dtype, chunk sizes)}``: what each tensor record must hold, as DCP's metadata says
    (of ``keys`` only, when given). Built once per metadata object (a load asks three times; 5,000 tensors: 3 ms
    each) and shared: never change what it returns."""
    found = _SPECS.get(id(metadata))
    if found is None:
        found = {
            (key, tuple(c.offsets)): (md.properties.dtype, tuple(c.sizes))
            for key, md in metadata.state_dict_metadata.items()
            for c in getattr(md, "chunks", None) or ()
        }
        _SPECS[id(metadata)] = found
        weakref.finalize(metadata, _SPECS.pop, id(metadata), None)
    if keys is None:
        return found
    return {k: v for k, v in found.items() if k[0] in keys}


_SPECS: dict[int, dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]] = {}


def record_index(metadata: Metadata) -> RecordIndex:
    """``{key: {chunk offsets: storage info}}`` of every record DCP's metadata lists, built once per metadata
    object (loads look records up by key many times: a scan of ``storage_data`` per question was 1 ms a scan
    for 5,000 tensors, and every ``MetadataIndex`` hash a Python call).

    Example:
        >>> import tempfile, torch
        >>> from torchrl_dcp.storage.writer import write_state
        >>> from torchrl_dcp.storage.filesystem import safe_load_metadata
        >>> d = tempfile.mkdtemp()
        >>> _ = write_state({"w": torch.zeros(2)}, d)
        >>> list(record_index(safe_load_metadata(d + "/.metadata"))["w"])
        [(0,)]
    """
    found = _INDEXES.get(id(metadata))
    if found is None:
        found = {}
        for index, info in (metadata.storage_data or {}).items():
            found.setdefault(index.fqn, {})[tuple(index.offset or ())] = info
        _INDEXES[id(metadata)] = found
        weakref.finalize(metadata, _INDEXES.pop, id(metadata), None)
    return found


def check_storage_files(metadata: Metadata, source: str, allowed: Collection[str] | None) -> None:
    """Every data file DCP would open must be a plain name (and listed in the manifest)."""
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not is_plain_name(rel):
            raise CheckpointIntegrityError(f"DCP metadata points outside the checkpoint ({rel!r})", path=source)
        if allowed is not None and rel not in allowed:
            raise CheckpointIntegrityError(f"DCP metadata names {rel!r}, which the manifest does not list", path=source)


def check_storage_bounds(
    metadata: Metadata, source: str, files: Mapping[str, Mapping[str, Any]], *, trailer: int = 0
) -> None:
    """Every data file DCP would open is a plain file name the manifest lists (``files``), and every byte range
    DCP would read lies inside it (sizes as the manifest records them), before the ``trailer`` bytes that end
    every data file (its save identity, format 3 and later: never a record's)."""
    checked: set[str] = set()
    ends: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if type(rel) is not str or rel not in checked:
            if type(rel) is not str or rel not in files or not is_plain_name(rel):
                check_storage_files(metadata, source, files)  # says which, and why
            checked.add(rel)
        end = ends.get(rel)
        if end is None:
            end = ends[rel] = files[rel]["size"] - (trailer if is_data_file(rel) else 0)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(offset, int) or not isinstance(length, int):
            raise CheckpointIntegrityError(f"DCP metadata entry for {index.fqn!r} is malformed", path=source)
        if offset < 0 or length < 0 or offset + length > end:
            ahead = f" ({trailer} of them its save identity)" if end != files[rel]["size"] else ""
            raise CheckpointIntegrityError(
                f"DCP metadata puts tensor {index.fqn!r} at bytes {offset}..{offset + length} of "
                f"{info.relative_path}, which has {files[rel]['size']} bytes{ahead}: the checkpoint is inconsistent "
                "or forged",
                path=source,
            )


def check_inventoried(metadata: Metadata, source: Any, components: Mapping[str, Mapping[str, Any]]) -> None:
    """Every tensor DCP's metadata holds is one a component's inventory lists: a save writes no record that no
    saved state refers to, so an extra one is what is left where a forger made a state refer to another tensor.

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> check_inventoried(Metadata(state_dict_metadata={}), "c", {})  # nothing to say
    """
    listed: set[str] = set()
    for record in components.values():
        listed.update(record.get("inventory") or ())
    extra = sorted(k for k in metadata.state_dict_metadata if k not in listed)
    if extra:
        raise CheckpointIntegrityError(
            f"DCP metadata holds {len(extra)} tensor(s) that no component in the manifest lists ({extra[:3]}): no "
            "save writes those; the checkpoint is inconsistent or forged",
            path=source,
        )


MAX_CHUNKS_PER_TENSOR = 1 << 20  # chunk files of 8 MiB: 8 TiB in one tensor; a forged list is refused first


def _ints(values: Any, ndim: int) -> tuple[int, ...] | None:
    try:
        out = tuple(values)
    except TypeError:
        return None
    if len(out) != ndim or not all(type(v) is int for v in out):
        return None
    return out


def check_coverage(metadata: Metadata, source: Any) -> None:
    """Every tensor's chunks tile it exactly (every element covered once, none outside it) and each chunk's record
    holds at least its bytes; no two records of a file overlap; no byte items. Run by every load and ``verify``.

    A forger who recomputes every checksum can still hand DCP a chunk list that leaves
    part of a tensor unread (its destination would keep old or uninitialised memory) or
    points two tensors at the same bytes: this proves the structure instead.

    Example:
        >>> import tempfile, torch
        >>> from torchrl_dcp.storage.writer import write_state
        >>> from torchrl_dcp.storage.filesystem import safe_load_metadata
        >>> d = tempfile.mkdtemp()
        >>> _ = write_state({"w": torch.zeros(4, 2)}, d)
        >>> check_coverage(safe_load_metadata(d + "/.metadata"), d)
    """
    records = record_index(metadata)
    shapes: dict[int, WholeTensor | None] = {}  # id(md): whole_tensor(md)
    for key, md in (metadata.state_dict_metadata or {}).items():
        found = records.get(key, {})
        whole = shapes.get(id(md), False)
        if whole is False:  # tensors of one dtype and shape share their metadata (built, or unpickled memoized)
            whole = shapes[id(md)] = whole_tensor(md)
        if whole is not None and len(found) == 1:  # the common case: one lookup (5,000 tensors: 2 ms less a load)
            length = getattr(found.get(whole.offsets), "length", None)
            if type(length) is int and length >= whole.nbytes:
                continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointIntegrityError(
                f"DCP metadata holds {key!r} as a byte item, which torchrl_dcp never writes: refused", path=source
            )
        _check_tensor_chunks(key, md, found, source)
    _check_disjoint_records(metadata, source)


def _check_tensor_chunks(key: str, md: TensorStorageMetadata, records: dict[tuple[int, ...], Any], source: Any) -> None:
    if _whole_tensor_record(md, records):
        return  # the common case, checked in a few operations (5,000 tensors: 9 ms less a load)

    def bad(why: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(
            f"DCP metadata of tensor {key!r}: {why}; the checkpoint is damaged or forged, refused", path=source
        )

    size = _ints(md.size, len(md.size))
    chunks = md.chunks
    if size is None or any(n < 0 for n in size) or not isinstance(chunks, list):
        raise bad("malformed size or chunk list")
    if not chunks or len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise bad(f"{len(chunks) if isinstance(chunks, list) else 0} chunks for a tensor of shape {list(size)}")
    itemsize = md.properties.dtype.itemsize
    backed = sum(int(getattr(info, "length", 0) or 0) for info in records.values())
    if math.prod(size) * itemsize > backed:  # the allocation bound first: what a load would allocate for it
        raise bad(f"it claims {math.prod(size) * itemsize} bytes but its records hold {backed}")
    boxes = []
    for chunk in chunks:
        offsets, sizes = (
            _ints(getattr(chunk, "offsets", None), len(size)),
            _ints(getattr(chunk, "sizes", None), len(size)),
        )
        if offsets is None or sizes is None:
            raise bad("a chunk has malformed offsets or sizes")
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise bad(f"chunk at {list(offsets)} of sizes {list(sizes)} lies outside the shape {list(size)}")
        info = records.get(offsets)
        if info is None:
            raise bad(f"chunk at {list(offsets)} has no record")
        if info.length < math.prod(sizes) * itemsize:
            raise bad(
                f"chunk at {list(offsets)} needs {math.prod(sizes) * itemsize} bytes, its record holds {info.length}"
            )
        boxes.append((offsets, sizes))
    filled = sum(1 for _, n in boxes if math.prod(n))  # a DTensor shard of an uneven split may be empty
    if filled > max(1, math.prod(size)):
        raise bad(f"{filled} chunks for a tensor of shape {list(size)}")
    if sum(math.prod(n) for _, n in boxes) != math.prod(size) or not _disjoint(boxes):
        raise bad(f"its {len(boxes)} chunks do not cover the shape {list(size)} exactly once")
    if len(records) != len(boxes):
        raise bad(f"{len(records)} records for {len(boxes)} chunks")


def _whole_tensor_record(md: TensorStorageMetadata, records: dict[tuple[int, ...], Any]) -> bool:
    """One chunk, the whole tensor at the origin, with one record holding at least its bytes: every check of
    :func:`_check_tensor_chunks` passes."""
    whole = whole_tensor(md)
    if whole is None or len(records) != 1:
        return False
    length = getattr(records.get(whole.offsets), "length", None)
    return type(length) is int and length >= whole.nbytes


class WholeTensor(NamedTuple):
    """A tensor's metadata of one chunk, the whole tensor at the origin: what its record must hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]  # the chunk's (all zeros): its record's key in :func:`record_index`
    nbytes: int


def whole_tensor(md: Any) -> WholeTensor | None:
    """:class:`WholeTensor` of ``md`` when it is a tensor's metadata (exactly) of one chunk, the whole tensor at the
    origin, else ``None`` (``torch.Size`` holds only ints; a negative size is left to the full checks). Tensors of
    one dtype and shape share their metadata (built by our writer, or unpickled memoized): callers ask once per
    object.

    Example:
        >>> import torch
        >>> from torch.distributed.checkpoint.metadata import (
        ...     ChunkStorageMetadata, TensorProperties, TensorStorageMetadata)
        >>> size = torch.Size([2, 3])
        >>> md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
        ...                            [ChunkStorageMetadata(torch.Size([0, 0]), size)])
        >>> whole_tensor(md)
        WholeTensor(dtype=torch.float32, shape=(2, 3), offsets=(0, 0), nbytes=24)
    """
    if type(md) is not TensorStorageMetadata:
        return None
    size, chunks = md.size, md.chunks
    if type(chunks) is not list or len(chunks) != 1 or type(size) is not torch.Size:
        return None
    chunk = chunks[0]
    offsets = getattr(chunk, "offsets", None)
    if type(offsets) is not torch.Size or getattr(chunk, "sizes", None) != size or len(offsets) != len(size):
        return None
    if any(offsets) or (size and min(size) < 0):
        return None
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    return WholeTensor(dtype, tuple(size), tuple(offsets), math.prod(size) * dtype.itemsize)


def _disjoint(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """No two boxes share an element (boxes of volume 0 are ignored). Row chunks (whole rows) are checked in
    ``O(n log n)``; other layouts (DTensor shards: a few per tensor) pairwise."""
    boxes = [b for b in boxes if math.prod(b[1])]
    if len(boxes) < 2:
        return True
    if all(o[1:] == (0,) * (len(o) - 1) for o, _ in boxes) and len({n[1:] for _, n in boxes}) == 1:
        rows = sorted((o[0], n[0]) for o, n in boxes)
        return all(a + m <= b for (a, m), (b, _) in zip(rows, rows[1:]))
    if len(boxes) > 4096:
        return False  # no layout this library writes: refuse rather than spend quadratic time
    for i, (o1, n1) in enumerate(boxes):
        for o2, n2 in boxes[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, n1, o2, n2)):
                return False
    return True


def _check_disjoint_records(metadata: Metadata, source: Any) -> None:
    """No two records of one data file share a byte (two tensors never read the same bytes)."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        spans.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for rel, found in spans.items():
        found.sort()
        for (a, n, k1), (b, _, k2) in zip(found, found[1:]):
            if a + n > b:
                raise CheckpointIntegrityError(
                    f"DCP metadata puts records of {k1!r} and {k2!r} on the same bytes of {rel} (from byte {b}): "
                    "the checkpoint is damaged or forged, refused",
                    path=source,
                )


# ---------------------------------------------------------------------- writing it from every rank's part
_FRAGMENT_HEAD = b"\x80\x02}q\x00"  # protocol 2, an empty dict, memoized as 0


def metadata_fragments(part: Metadata) -> tuple[bytes, bytes]:
    """The items of one rank's ``state_dict_metadata`` and ``storage_data`` as pickle opcodes (protocol 2) that
    :func:`spliced_metadata` can put into the whole file's dicts: each rank pickles its own part, rank 0 only
    concatenates (a pickled dict is ``}`` then ``MARK key value ... SETITEMS`` batches, which apply to any dict
    on the stack; memo slots a fragment fills are its own, each read only after it was written in the same
    fragment).

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> metadata_fragments(Metadata(state_dict_metadata={}, storage_data={}))
        (b'', b'')
    """
    out = []
    for d in (part.state_dict_metadata, part.storage_data or {}):
        data = pickle.dumps(dict(d), protocol=2)
        if not (data.startswith(_FRAGMENT_HEAD) and data.endswith(pickle.STOP)):  # pragma: no cover - pickle's own
            raise RuntimeError("internal: unexpected pickle of a dict")
        out.append(data[len(_FRAGMENT_HEAD) : -1])
    return out[0], out[1]


class _Spliced(dict):  # a dict pickled as its fragments
    def __init__(self, fragments: list[bytes]) -> None:
        super().__init__()
        self.fragments = fragments


class _SplicingPickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table takes a new type
    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def _save_spliced(self, obj: _Spliced) -> None:
        self.write(pickle.EMPTY_DICT)
        for fragment in obj.fragments:
            self.write(fragment)

    dispatch[_Spliced] = _save_spliced


def spliced_metadata(shared: Metadata, fragments: list[tuple[bytes, bytes]]) -> bytes:
    """The ``.metadata`` bytes of ``shared`` (rank 0's: the tensors no one rank owns, and the file's identity)
    with every rank's :func:`metadata_fragments` added to its two dicts: what ``pickle.dumps`` of the whole
    ``Metadata`` would load as, in time proportional to the bytes, not to the tensors.

    The outer pickle keeps no memo (``fast``), so no fragment can overwrite a slot it reads.

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
        >>> a, b = Metadata(state_dict_metadata={"x": 1}, storage_data={}), Metadata({"y": 2}, storage_data={})
        >>> sorted(pickle.loads(spliced_metadata(a, [metadata_fragments(b)])).state_dict_metadata.items())
        [('x', 1), ('y', 2)]
    """
    own_state, own_storage = metadata_fragments(shared)
    whole = Metadata(
        state_dict_metadata=_Spliced([own_state, *(f[0] for f in fragments)]),
        planner_data=shared.planner_data,
        storage_data=_Spliced([own_storage, *(f[1] for f in fragments)]),
        storage_meta=shared.storage_meta,
        version=shared.version,
    )
    buffer = io.BytesIO()
    pickler = _SplicingPickler(buffer, protocol=2)
    pickler.fast = True
    pickler.dump(whole)
    return buffer.getvalue()


def metadata_difference(built: Metadata, saved: Metadata) -> str | None:
    """Where two ``Metadata`` place tensors differently (dtype, shape, chunks, records: file, offset, length), or
    ``None``: ``verify`` compares the manifest's storage entries with ``.metadata`` this way, so that a forged,
    resealed manifest cannot point a load elsewhere than a plain ``dcp.load`` reads.

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> metadata_difference(Metadata({}, storage_data={}), Metadata({}, storage_data={})) is None
        True
    """
    a, b = built.state_dict_metadata, saved.state_dict_metadata
    if a.keys() != b.keys():
        differ = sorted(a.keys() ^ b.keys())
        return f"tensors {differ[:3]} are in only one of them"
    for key, x in a.items():
        y = b[key]
        px, py = getattr(x, "properties", None), getattr(y, "properties", None)
        same = (
            type(x) is type(y)
            and getattr(px, "dtype", None) == getattr(py, "dtype", None)
            and tuple(getattr(x, "size", ())) == tuple(getattr(y, "size", ()))
            and [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(x, "chunks", [])]
            == [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(y, "chunks", [])]
        )
        if not same:
            return f"tensor {key!r} has another dtype, shape or chunking"

    def places(md: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int]]:
        return {
            (i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset, s.length)
            for i, s in (md.storage_data or {}).items()
        }

    pa, pb = places(built), places(saved)
    if pa != pb:
        differ = sorted(k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k))
        return f"the records of {[k[0] for k in differ[:3]]} are elsewhere"
    return None
