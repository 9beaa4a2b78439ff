"""Pickle-free encoding of nested state into a JSON skeleton plus flat tensors.

``encode`` walks a nested value (dicts, lists, tuples, tensors, numpy arrays and
scalars, dtypes, devices, sizes, ...) and returns a JSON-safe *skeleton* and a
flat ``{key: tensor}`` mapping; ``decode`` rebuilds the value from the two.
Keys are the nested path joined with ``/``. Nothing is ever pickled: a value the
codec does not know raises :class:`~torchrl_dcp.errors.EncodingError` naming its
path, at save time.

Example:
    >>> import torch
    >>> from torchrl_dcp.format.codec import encode, decode
    >>> skeleton, tensors = encode({"w": torch.ones(2), "step": 3})
    >>> sorted(tensors)
    ['w']
    >>> decode(skeleton, tensors)["step"]
    3
"""

from __future__ import annotations

import base64
import enum
import functools
import json
import math
import re
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
import torch

from torchrl_dcp.errors import CheckpointFormatError, EncodingError
from torchrl_dcp.format.key_hashes import HASH_MODULUS, HASHES_CHECKED_FROM, check_hashes, count_hash
from torchrl_dcp.format.manifest_depth import MAPPING_NODES
from torchrl_dcp.format.record import is_memmap_tensor
from torchrl_dcp.format.scalar_nodes import (
    UnstorableLeaf,
    decode_enum,
    decode_float,
    decode_np_scalar,
    enum_node,
    float_node,
    np_dtype_from_name,
    np_scalar_node,
)
from torchrl_dcp.format.sparse_nodes import build_sparse, sparse_node, sparse_parts
from torchrl_dcp.format.tensor_nodes import (
    TensorSpec,
    dtype_from_name,
    dtype_name,
    grad_flag,
    node_spec,
    with_layout,
)

__all__ = [
    "MAX_DEPTH",
    "TensorSpec",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "escape_key",
    "named_factory",
    "canonical_bools",
    "is_dtensor",
    "np_dtype_from_name",
    "tensor_specs",
    "walk_nodes",
]

_SCALAR_KINDS = (type(None), bool, int, str)
MAX_DEPTH = 100  # nesting levels of a state (and of its skeleton): deeper is refused on save and on load
_MAPPING_KINDS: dict[type, str] = {dict: "dict", OrderedDict: "odict", Counter: "counter", defaultdict: "defaultdict"}
#: the ``default_factory`` a ``defaultdict`` node may name (``factory``): types, never a function (none is pickled)
DEFAULT_FACTORIES: dict[str | None, Any] = {
    None: None,
    **{f.__name__: f for f in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset)},
    **{f.__name__: f for f in (Counter, OrderedDict, deque, defaultdict)},
}
_FACTORY_NAMES = {id(f): name for name, f in DEFAULT_FACTORIES.items() if f is not None}


def named_factory(value: defaultdict) -> bool:
    """Whether a ``defaultdict``'s factory is one a node can name (:data:`DEFAULT_FACTORIES`)."""
    return value.default_factory is None or id(value.default_factory) in _FACTORY_NAMES


_CONTAINERS = frozenset(
    {*MAPPING_NODES, "list", "tuple", "set", "frozenset", "deque", "np", "complex", "slice", "sparse_coo"}
)


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor viewing ``array`` (its strides kept), or of a row-major copy where torch cannot view it (negative
    strides)."""
    try:
        return torch.from_numpy(array)
    except ValueError:  # (ascontiguousarray makes a 0-d array 1-d: the shape is put back)
        return torch.from_numpy(np.ascontiguousarray(array).reshape(array.shape))


def escape_key(key: Any) -> str:
    """One path segment for a mapping key or list index (``/`` and ``%`` escaped)."""
    return str(key).replace("%", "%25").replace("/", "%2F")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: tensor dtypes no save writes (no torch.save storage, DCP's writer fails on them): the sub-byte integers, the bit
#: dtypes, and the quantized ones (a view of bytes as a quantized dtype is not ``is_quantized``)
_REFUSED_DTYPES = frozenset(
    d
    for name, d in vars(torch).items()
    if isinstance(d, torch.dtype) and re.fullmatch(r"u?int[1-7]|bits.*|q(u)?int.*", name)
)


@functools.lru_cache(maxsize=1)
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor`` (plain tensors answer without an ``isinstance`` walk)."""
    if type(value) in _PLAIN_TENSORS:  # the common case, without the isinstance walk
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def tensor_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Same memory, same view: two tensors with equal identities hold the same values."""
    if t.numel() == 0 or is_dtensor(t):
        return None
    return (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Encoder:
    def __init__(self, where: str, shared: Mapping[tuple[Any, ...], tuple[str, str]] | None) -> None:
        self.where = where
        self.tensors: dict[str, Any] = {}
        self._seen: dict[tuple[Any, ...], str] = {}
        self._shared = shared or {}

    def key(self, path: str) -> str:
        key, n = path or "_", 1
        while key in self.tensors:
            key, n = f"{path}~{n}", n + 1
        return key

    def fail(self, path: str, value: Any, why: str = "") -> EncodingError:
        return EncodingError(
            f"cannot store {type(value).__module__}.{type(value).__qualname__} at "
            f"{self.where}/{path or '<root>'}{why}: torchrl_dcp never pickles; convert it to "
            "tensors and JSON-safe values (dict, list, str, int, float, bool, None) or register "
            "an adapter for its type"
        )

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        if isinstance(value, enum.Enum):  # (an IntEnum or a str Enum is an int or a str too: its class is kept)
            try:
                return enum_node(value)
            except UnstorableLeaf as err:
                raise self.fail(path, value, f" ({err})") from None
        if isinstance(value, _SCALAR_KINDS):
            if type(value) not in _SCALARS:  # a subclass of int or str would come back as a plain one
                raise self.fail(path, value, f" (a subclass of {type(value).__mro__[1].__name__}: convert it)")
            if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:  # JSON would refuse it at commit
                raise self.fail(path, value, f" (an integer of more than {MAX_INT_BITS} bits: store it as a string)")
            return value
        if type(value) is float:  # (NumPy's float64 is a float too: its own node below keeps its type)
            return value if math.isfinite(value) else float_node(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, np.ndarray):
            return self._array(value, path)
        if depth >= MAX_DEPTH:  # load refuses deeper containers: refuse them here, at save time
            raise self.fail(path, value, f" (nested more than {MAX_DEPTH} levels deep)")
        depth += 1
        if isinstance(value, Mapping):
            return self._mapping(value, path, depth)
        if isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if isinstance(value, (list, tuple, set, frozenset)):
            return self._sequence(value, path, depth)
        if type(value) is deque:  # (its maxlen kept: a window of the last N values stays one)
            items = [self.encode(v, f"{path}/{i}" if path else str(i), depth) for i, v in enumerate(value)]
            return {"t": "deque", "items": items, "maxlen": value.maxlen}
        return self._other(value, path, depth)

    def _array(self, value: np.ndarray, path: str) -> dict[str, Any]:
        if type(value) is not np.ndarray:  # a masked array's mask, a matrix's kind would be lost
            raise self.fail(path, value, " (a numpy array subclass: convert it with np.asarray, or save its parts)")
        if value.dtype.kind not in "biufc":
            raise self.fail(path, value, f" (numpy dtype {value.dtype})")
        native = value.astype(value.dtype.newbyteorder("="), copy=False)  # torch takes native byte order only
        try:  # its own layout (a Fortran-ordered array comes back so); negative strides: a row-major copy
            tensor = _from_numpy(native)
        except TypeError:
            raise self.fail(path, value, f" (numpy dtype {value.dtype} has no torch dtype)") from None
        node = self._tensor(tensor, path)
        return {"t": "ndarray", "np_dtype": value.dtype.str, "tensor": node}

    def _mapping(self, value: Mapping[Any, Any], path: str, depth: int) -> dict[str, Any]:
        items, used = [], set()
        for k, v in value.items():
            if not isinstance(k, (str, int, bool, type(None), float, tuple)):
                raise self.fail(path, k, " (as a mapping key)")
            segment = escape_key(k)
            if segment in used:
                segment = f"{segment}~{type(k).__name__}"
            used.add(segment)
            items.append([self.encode(k, path, depth), self.encode(v, f"{path}/{segment}" if path else segment, depth)])
        node: dict[str, Any] = {"t": "odict" if isinstance(value, OrderedDict) else "dict", "items": items}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            node["metadata"] = self.encode(metadata, f"{path}/_metadata" if path else "_metadata", depth)
        if not hasattr(value, "_metadata"):  # other Mapping types (TensorDict, ...) come back as dicts
            node["t"] = _MAPPING_KINDS.get(type(value), "dict")
        if node["t"] == "defaultdict":
            node["factory"] = self._factory(value, path)
        return node

    def _factory(self, value: defaultdict, path: str) -> str | None:
        factory = value.default_factory
        if factory is None:
            return None
        name = _FACTORY_NAMES.get(id(factory))
        if name is None:
            named = getattr(factory, "__qualname__", type(factory).__qualname__)
            raise self.fail(
                path,
                value,
                f" (a defaultdict whose default_factory is {named}: only a type among "
                f"{', '.join(n for n in DEFAULT_FACTORIES if n)} is kept; use one of those, or save dict(value) and "
                "rebuild the defaultdict after a load)",
            )
        return name

    def _sequence(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        kind = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}.get(type(value))
        if kind is None:
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                raise self.fail(path, value, " (namedtuple)")
            kind = "list" if isinstance(value, list) else "tuple"
        seq = sorted(value, key=_set_order) if kind in ("set", "frozenset") else value
        return {
            "t": kind,
            "items": [self.encode(v, f"{path}/{i}" if path else str(i), depth) for i, v in enumerate(seq)],
        }

    def _other(self, value: Any, path: str, depth: int) -> Any:
        """Leaves that are neither scalars, tensors nor containers."""
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": dtype_name(value)}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, np.generic):
            try:
                return np_scalar_node(value, lambda item: self.encode(item, path, depth))
            except UnstorableLeaf as err:
                raise self.fail(path, value, f" ({err})" if str(err) else "") from None
        if isinstance(value, complex):
            return {"t": "complex", "v": [self.encode(value.real, path, depth), self.encode(value.imag, path, depth)]}
        if isinstance(value, (bytes, bytearray)):
            return {"t": type(value).__name__, "v": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, slice):
            return {"t": "slice", "v": [self.encode(v, path, depth) for v in (value.start, value.stop, value.step)]}
        if isinstance(value, range):
            return {"t": "range", "v": [self.encode(v, path, depth) for v in (value.start, value.stop, value.step)]}
        if isinstance(value, PurePath):  # a pure path keeps its flavour (Windows: other separators, drives)
            kind = type(value).__name__ if type(value) in (PurePosixPath, PureWindowsPath) else None
            return {"t": "path", "v": str(value)} if kind is None else {"t": "path", "v": str(value), "kind": kind}
        if value is Ellipsis:
            return {"t": "ellipsis"}
        raise self.fail(path, value)

    def _tensor(self, value: torch.Tensor, path: str, share: bool = True) -> dict[str, Any]:
        """A tensor's node; ``share=False`` (a sparse tensor's parts): a node of its own, never an alias or a
        reference, nor one an alias may name (stored again where the state holds the sparse tensor twice, or a dense
        tensor sharing its values' memory: a load checks the parts it reads)."""
        if is_dtensor(value):
            key = self.key(path)
            self.tensors[key] = value
            return {
                "t": "dtensor",
                "key": key,
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
                "device": str(value.device),
            }
        if value.layout == torch.sparse_coo:  # its parts stored as its own (never an alias: a load checks them)
            indices, values = sparse_parts(value)
            inner = f"{path}/" if path else ""
            parts = self._tensor(indices, f"{inner}indices", False), self._tensor(values, f"{inner}values", False)
            return sparse_node(value, *parts)
        if value.is_nested:  # (jagged or strided: neither converts to a dense or a sparse tensor)
            raise self.fail(path, value, " (a nested tensor: save its components, value.unbind(), as a list)")
        if value.is_sparse or value.layout != torch.strided:
            raise self.fail(path, value, f" (layout {value.layout}: convert it with .to_sparse_coo() or .to_dense())")
        if value.is_meta:
            raise self.fail(path, value, " (on the meta device: it holds no data; initialise it before saving)")
        if value.is_quantized:
            raise self.fail(
                path,
                value,
                " (a quantized tensor: save value.dequantize(), or value.int_repr() with its quantization parameters)",
            )
        if value.dtype in _REFUSED_DTYPES:
            raise self.fail(path, value, f" (dtype {value.dtype}, which torchrl_dcp does not save)")
        if type(value) not in _PLAIN_TENSORS and not is_memmap_tensor(value):  # (DCP would pickle its class)
            raise self.fail(
                path,
                value,
                f" (a tensor of subclass {type(value).__module__}.{type(value).__qualname__}: a load never unpickles "
                "a class; save its data, value.as_subclass(torch.Tensor), and build the subclass again after the "
                "load, or register an adapter for the object that holds it)",
            )
        ident = tensor_identity(value) if share else None
        alias = self._seen.get(ident) if ident is not None else None
        if alias is not None:
            return {"t": "alias", "key": alias}
        ref = self._shared.get(ident) if ident is not None else None
        if ref is not None:
            node = {
                "t": "xref",
                "component": ref[0],
                "key": ref[1],
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
                "device": str(value.device),
            }
            return with_layout(node, value)  # (a load of this component alone allocates it: in its layout)
        key = self.key(path)
        if ident is not None:
            self._seen[ident] = key
        self.tensors[key] = canonical_bools(value.detach())
        node = {
            "t": "tensor",
            "key": key,
            "dtype": dtype_name(value.dtype),
            "shape": list(value.shape),
            "device": str(value.device),
        }
        if value.requires_grad:  # a leaf that autograd tracks (a Parameter in a dict): it comes back tracked
            node["grad"] = True
        return with_layout(node, value)


def canonical_bools(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a bool tensor holding bytes other than 0 and 1 (memory ``torch.empty`` left unset, e.g. the
    unwritten rows of a storage saved through its ``state_dict``) a copy holding 0 and 1 (true where a byte is not 0).

    Loads refuse such bytes as damage, so a save never writes them.

    Example:
        >>> raw = torch.tensor([0, 1, 255], dtype=torch.uint8).view(torch.bool)
        >>> canonical_bools(raw).view(torch.uint8).tolist()
        [0, 1, 1]
    """
    if t.dtype != torch.bool or t.numel() == 0:
        return t
    if not t.is_contiguous():  # (a writer's copy of a strided tensor keeps its bytes, 3 as 3: a transpose's too)
        raw = t.view(torch.uint8)  # the same elements as bytes, in its layout (no copy)
        return raw != 0 if int(raw.max()) > 1 else t  # (the layout kept: dense inputs give outputs of their strides)
    from torchrl_dcp.format.record import byte_view

    raw = byte_view(t)  # the bytes as they are (no copy: a copy would convert them)
    return (raw != 0).view(t.shape) if int(raw.max()) > 1 else t


def encode(
    value: Any, where: str = "state", shared: Mapping[tuple[Any, ...], tuple[str, str]] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``value`` into a JSON-safe skeleton and a flat ``{key: tensor}`` dict.

    Args:
        value: nested state (dicts, sequences, tensors, arrays, JSON scalars, ...).
        where: a name for error messages, e.g. the component name.
        shared: tensors already stored by other components, by :func:`tensor_identity`, as
            ``(component, key)``: such a tensor becomes a reference (``xref``), not a copy.

    Raises:
        EncodingError: a leaf cannot be stored without pickle (the message names its path).
    """
    encoder = _Encoder(where, shared)
    return encoder.encode(value, ""), encoder.tensors


def xrefs(skeleton: Any) -> Iterator[tuple[str, TensorSpec]]:
    """Every reference to another component's tensor: ``(component, spec)``."""
    for node in _nodes(skeleton):
        if node.get("t") == "xref":
            if not isinstance(node.get("component"), str):
                raise CheckpointFormatError(f"malformed tensor reference {node!r}")
            yield node["component"], node_spec(node)


def walk_nodes(skeleton: Any) -> Iterator[dict[str, Any]]:
    """Every dict node of a skeleton, depth first, without recursion (a tensor's node is not entered).

    Example:
        >>> [n["t"] for n in walk_nodes({"t": "dict", "items": [["a", {"t": "list", "items": []}]]})]
        ['dict', 'list']
    """
    return _nodes(skeleton)


def repeated_tensors(skeleton: Any) -> list[str]:
    """The keys every repeated tensor leaf names: an ``alias`` (a tensor met earlier in the same state) or an
    ``xref`` (a tensor another component stores).

    Example:
        >>> import torch
        >>> w = torch.zeros(2)
        >>> repeated_tensors(encode({"a": w, "b": w, "c": torch.ones(1)})[0])
        ['a']
    """
    return [node.get("key") for node in _nodes(skeleton) if node.get("t") in ("alias", "xref")]


def xref_key(component: str, key: str) -> str:
    """The key under which :func:`decode` looks up a reference to another component's tensor."""
    return f"@{component}/{key}"


class TensorSink(dict):
    """A ``tensors`` mapping for :func:`decode` that decodes each tensor leaf itself (``take(node)``): what a load's
    planning uses to collect every leaf's spec in the same walk (:func:`torchrl_dcp.load_plan.plan_view`)."""

    def take(self, node: dict[str, Any]) -> Any:
        raise NotImplementedError

    def saw_sparse(self, node: dict[str, Any]) -> None:
        """A sparse tensor's node met (its parts taken already): its indices are checked once read."""


def tensor_specs(skeleton: Any) -> Iterator[TensorSpec]:
    """Every tensor (and DTensor) leaf of a skeleton, with its shape, dtype and device."""
    for node in _nodes(skeleton):
        if node.get("t") in ("tensor", "dtensor"):
            yield node_spec(node)


def _nodes(skeleton: Any) -> Iterator[dict[str, Any]]:
    """Every dict node of a skeleton (depth first, without recursion)."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            if node.get("t") not in ("tensor", "dtensor", "xref", "alias"):
                stack.extend(v for k, v in node.items() if k != "t")


def _decode_path(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> PurePath:
    kind = node.get("kind")
    if kind is None:
        return Path(node["v"])
    if kind not in _PURE_PATHS:
        raise CheckpointFormatError(f"malformed path kind {kind!r}")
    return _PURE_PATHS[kind](node["v"])


_PURE_PATHS = {"PurePosixPath": PurePosixPath, "PureWindowsPath": PureWindowsPath}


def decode(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """Rebuild the value that :func:`encode` split; tensors come from ``tensors``.

    Raises:
        CheckpointFormatError: the skeleton is malformed, nested deeper than ``MAX_DEPTH``,
            names a non-numeric numpy dtype, or names a tensor that is absent.
    """
    try:
        return _decode(skeleton, tensors, 0)
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as err:
        raise CheckpointFormatError(f"malformed state skeleton ({type(err).__name__}: {str(err)[:200]})") from None


_SCALARS = frozenset({type(None), bool, int, str, float})
#: the largest integer a state may hold: below the 4,300 decimal digits Python writes to (and reads from) JSON
MAX_INT_BITS = 14_000


def _decode(node: Any, tensors: Mapping[str, Any], depth: int) -> Any:
    if isinstance(node, (type(None), bool, int, str, float)):
        return node
    if isinstance(node, list):
        raise CheckpointFormatError("malformed state skeleton: bare list")
    kind = node["t"]
    if kind in _CONTAINERS and depth >= MAX_DEPTH:
        raise CheckpointFormatError(f"malformed state skeleton: nested more than {MAX_DEPTH} levels deep")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise CheckpointFormatError(f"unknown state entry kind {kind!r}")
    return decoder(node, tensors, depth + 1)


def _decode_tensor(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    if "stride" in node:
        node_spec(node)  # (every field checked: its stride against its shape)
    else:
        grad_flag(node)
    if isinstance(tensors, TensorSink):
        return tensors.take(node)
    key = node["key"] if node["t"] != "xref" else xref_key(node["component"], node["key"])
    if key not in tensors:
        raise CheckpointFormatError(f"the state names tensor {key!r}, which was not loaded")
    return tensors[key]


def _decode_ndarray(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    dtype = np_dtype_from_name(node["np_dtype"])  # checked before anything is read (planning decodes too)
    tensor = _decode(node["tensor"], tensors, depth)
    saved = getattr(tensor, "dtype", None)  # (a TensorSpec while planning: checked then, and by verify)
    if saved is not None and _numpy_dtype(saved) != dtype.newbyteorder("="):  # a save records the array's own dtype
        raise CheckpointFormatError(  # (byte order aside): another kind or size would be a cast, never done
            f"numpy dtype {dtype.str!r} does not match the saved tensor's dtype {dtype_name(saved)}"
        )
    if not isinstance(tensor, torch.Tensor):  # a placeholder (e.g. a TensorSpec) while planning
        return tensor
    return tensor.cpu().numpy().astype(dtype, copy=False)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype torch's ``.numpy()`` gives a tensor of ``dtype`` (``None``: none, e.g. bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def _decode_mapping(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    kind = node["t"]
    out: dict[Any, Any] = (
        {}
        if kind == "dict"
        else OrderedDict()
        if kind == "odict"
        else Counter()
        if kind == "counter"
        else _default_dict(node)
    )
    items = node["items"]
    counts: dict[int, int] | None = {} if len(items) > HASHES_CHECKED_FROM else None
    # a tensor value (the common non-scalar one) taken here, without the two calls of a decode (5,000 tensors:
    # ~2 ms less a load); anything unusual (a missing key) goes through _decode, which explains it
    take = tensors.take if isinstance(tensors, TensorSink) else None
    for item in items:
        if type(item) is not list or len(item) != 2:  # (a 2-key dict unpacked as its keys: values lost silently)
            raise ValueError(f"a mapping item must be a [key, value] pair, got {type(item).__name__}")
        k, v = item  # string keys and scalar values (the common case) without a call
        # (str hashes are randomized: no forger makes them collide; an int below 2**61 is its own hash and its own
        # decoding: the common other key, an index, skips both)
        if type(k) is not str and (type(k) is not int or not -HASH_MODULUS < k < HASH_MODULUS):
            k = _decode(k, tensors, depth)
            if counts is not None:
                count_hash(counts, k, len(items))
        if type(v) in _SCALARS:
            out[k] = v
        elif type(v) is dict and v.get("t") == "tensor" and "grad" not in v and "stride" not in v:
            if take is not None:
                out[k] = take(v)
            else:
                key = v.get("key")
                out[k] = tensors[key] if type(key) is str and key in tensors else _decode(v, tensors, depth)
        else:
            out[k] = _decode(v, tensors, depth)
    if len(out) != len(items):  # a key twice: the last would win, silently (no save writes one: a dict cannot hold it)
        raise ValueError(f"a mapping holds the key {_repeated_key(items)} twice, which no save writes")
    if "metadata" in node:
        out._metadata = _decode(node["metadata"], tensors, depth)  # type: ignore[attr-defined]
    return out


def _repeated_key(items: list[Any]) -> str:
    """The first key of ``items`` (``[key, value]`` pairs) that an earlier one repeats, as the manifest spells it."""
    seen: set[str] = set()
    for key, _ in items:
        spelled = repr(key) if type(key) in (str, int) else json.dumps(key, sort_keys=True)
        if spelled in seen:
            return spelled
        seen.add(spelled)
    return "(two keys equal once decoded)"


def _decode_sequence(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    items = [_decode(v, tensors, depth) for v in node["items"]]
    kind = node["t"]
    if len(items) > HASHES_CHECKED_FROM and kind in ("set", "frozenset"):
        check_hashes(items)
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)


def _default_dict(node: dict[str, Any]) -> defaultdict:
    factory = node.get("factory")
    if (factory is not None and type(factory) is not str) or factory not in DEFAULT_FACTORIES:
        raise CheckpointFormatError(
            f"malformed defaultdict: factory {factory!r} is none of {sorted(n for n in DEFAULT_FACTORIES if n)}"
        )
    return defaultdict(DEFAULT_FACTORIES[factory])


def _decode_deque(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    maxlen = node["maxlen"]
    items = node["items"]
    if maxlen is not None and (type(maxlen) is not int or not 0 <= maxlen or len(items) > maxlen):
        raise CheckpointFormatError(f"malformed deque: maxlen {maxlen!r} for {len(items)} items")
    return deque((_decode(v, tensors, depth) for v in items), maxlen=maxlen)


def _decode_device(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    try:
        return torch.device(node["v"])
    except RuntimeError as err:  # torch says "Invalid device string" with a RuntimeError
        raise ValueError(str(err)) from None


def _decode_np_scalar(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    return decode_np_scalar(node, _decode(node["v"], tensors, depth))


def _decode_bytes(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    raw = base64.b64decode(node["v"], validate=True)
    return raw if node["t"] == "bytes" else bytearray(raw)


def _decode_sparse(node: dict[str, Any], tensors: Mapping[str, Any], depth: int) -> Any:
    out = build_sparse(node, _decode(node["indices"], tensors, depth), _decode(node["values"], tensors, depth))
    if isinstance(tensors, TensorSink):
        tensors.saw_sparse(node)
    return out


_DECODERS: dict[str, Any] = {
    "tensor": _decode_tensor,
    "dtensor": _decode_tensor,
    "alias": _decode_tensor,
    "xref": _decode_tensor,
    "ndarray": _decode_ndarray,
    "sparse_coo": _decode_sparse,
    "dict": _decode_mapping,
    "odict": _decode_mapping,
    "counter": _decode_mapping,
    "defaultdict": _decode_mapping,
    "list": _decode_sequence,
    "tuple": _decode_sequence,
    "set": _decode_sequence,
    "frozenset": _decode_sequence,
    "deque": _decode_deque,
    "enum": lambda node, tensors, depth: decode_enum(node),
    "float": lambda node, tensors, depth: decode_float(node),
    "size": lambda node, tensors, depth: torch.Size([int(v) for v in node["v"]]),
    "dtype": lambda node, tensors, depth: dtype_from_name(node["v"]),
    "device": _decode_device,
    "np": _decode_np_scalar,
    "complex": lambda node, tensors, depth: complex(*(_decode(v, tensors, depth) for v in node["v"])),
    "bytes": _decode_bytes,
    "bytearray": _decode_bytes,
    "slice": lambda node, tensors, depth: slice(*(_decode(v, tensors, depth) for v in node["v"])),
    "range": lambda node, tensors, depth: range(*(int(v) for v in node["v"])),
    "path": _decode_path,
    "ellipsis": lambda node, tensors, depth: Ellipsis,
}


def _set_order(value: Any) -> str:
    """The key a set's items are encoded in order of: the same on every rank and in every process. ``repr`` of a
    frozenset (or a tuple holding one) follows its hash order, which string hashing randomises per process: equal
    replicated sets were refused as different, depending on ``PYTHONHASHSEED``."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({','.join(sorted(map(_set_order, value)))})"
    if isinstance(value, tuple):
        return f"({','.join(map(_set_order, value))})"
    return repr(value)
