"""DCP's metadata (``.metadata``) as bytes: parsed without running code, and written by splicing each rank's part.

DCP reads ``.metadata`` with ``pickle.load``. :func:`parse_metadata` uses an
unpickler that admits only DCP's metadata classes, torch dtypes/sizes/layouts and
paths, and builds at most :data:`METADATA_PARSE_RATIO` times the file's size in
objects. :func:`spliced_metadata` concatenates the pickled parts of every rank
(:func:`metadata_fragments`) into the one ``.metadata`` plain ``dcp.load`` reads. What
the parsed metadata must satisfy is :mod:`torchrl_dcp.format.metadata_checks`.

Example:
    >>> import pickle
    >>> from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
    >>> parse_metadata(pickle.dumps(Metadata(state_dict_metadata={})), "x/.metadata").state_dict_metadata
    {}
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, UnsafeCheckpointError
from torchrl_dcp.format.key_hashes import MAX_EQUAL_HASHES

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
        refuse more than :data:`~torchrl_dcp.format.key_hashes.MAX_EQUAL_HASHES` of one hash: a dict or set of n keys
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
