"""Skeleton nodes of leaf values that are not plain JSON: non-finite floats, NumPy scalars and enum members.

Each keeps what its plain JSON form would lose: a NaN its sign and payload (``bits``), a NumPy scalar its dtype (and
a narrow float's NaN its bits: its Python float is a float64, whose conversion quiets a signalling NaN), an enum
member its class. Decoding refuses what no save writes (bits of a number, a value the dtype cannot hold exactly, a
class that is no enum), and never imports a module: an enum's class is looked up in the modules imported already.

Example:
    >>> import numpy as np
    >>> node = float_node(float("-inf"))
    >>> node, decode_float(node)
    ({'t': 'float', 'v': '-inf'}, -inf)
    >>> decode_np_scalar({"t": "np", "dtype": "<i2", "v": 3}, 3)
    np.int16(3)
"""

from __future__ import annotations

import enum
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from torchrl_dcp.errors import CheckpointFormatError

_NP_KINDS = "biufc"  # numeric numpy kinds: bool, int, uint, float, complex
_NP_MAX_ITEMSIZE = 32  # complex256, the widest numeric numpy scalar
_NAN_BITS = struct.pack(">d", math.nan)


class UnstorableLeaf(ValueError):
    """A leaf no node stores (the message says why, for the encoder's error naming the value and its path)."""


def float_node(value: float) -> dict[str, Any]:
    """A non-finite float's node; a NaN other than Python's own keeps its bits (sign and payload)."""
    bits = struct.pack(">d", value)
    if value != value and bits != _NAN_BITS:
        return {"t": "float", "v": "nan", "bits": bits.hex()}
    return {"t": "float", "v": repr(value)}


def decode_float(node: dict[str, Any]) -> float:
    v = node["v"]
    if v not in ("nan", "inf", "-inf"):
        raise CheckpointFormatError(f"malformed float {v!r}")
    bits = node.get("bits")
    if bits is None:
        return float(v)
    try:
        value = struct.unpack(">d", bytes.fromhex(bits))[0] if isinstance(bits, str) and len(bits) == 16 else 0.0
    except ValueError:
        value = 0.0
    if v != "nan" or value == value:
        raise CheckpointFormatError(f"malformed NaN bits {bits!r}")
    return value


def np_scalar_node(value: np.generic, encode_item: Callable[[Any], Any]) -> dict[str, Any]:
    """A NumPy scalar's node: its dtype and its Python value (``encode_item`` encodes it), and the bytes of a
    narrow float's NaN. Raises :class:`UnstorableLeaf` for a scalar with no exact Python value."""
    if value.dtype.kind not in _NP_KINDS:
        raise UnstorableLeaf("")
    item = value.item()
    if type(item) not in (bool, int, float, complex):  # (longdouble: no exact Python value)
        raise UnstorableLeaf(f"numpy scalar of dtype {value.dtype}: no exact Python value")
    if isinstance(item, complex):
        item = [item.real, item.imag]
    node = {"t": "np", "dtype": value.dtype.str, "v": encode_item(item)}
    part = value.dtype.itemsize // (2 if value.dtype.kind == "c" else 1)  # (a float64 part keeps its bits)
    if value.dtype.kind in "fc" and part != 8 and np.isnan(value):
        node["bits"] = value.tobytes().hex()  # (its Python float quiets a float32 signalling NaN)
    return node


def decode_np_scalar(node: dict[str, Any], item: Any) -> Any:
    """The NumPy scalar of ``node``, whose ``v`` decoded to ``item``."""
    dtype = np_dtype_from_name(node["dtype"])
    if isinstance(item, list):
        item = complex(*item)
    if not isinstance(item, (bool, int, float, complex)):
        raise CheckpointFormatError(f"numpy scalar of dtype {dtype.str!r} holds {type(item).__name__}")
    bits = node.get("bits")
    if bits is None:
        return _exact_np_scalar(dtype, item)
    # a NaN of a narrower float (sign, payload, signalling bit) as saved; only where its Python value is a NaN too
    try:
        raw = bytes.fromhex(bits) if isinstance(bits, str) and len(bits) == 2 * dtype.itemsize else None
    except ValueError:
        raw = None
    value = np.frombuffer(raw, dtype=dtype)[0] if raw is not None and dtype.kind in "fc" else None
    if value is None or not np.isnan(value) or not np.isnan(dtype.type(item)):
        raise CheckpointFormatError(f"malformed NaN bits {bits!r} of a numpy scalar of dtype {dtype.str!r}")
    return value


def _exact_np_scalar(dtype: np.dtype, item: Any) -> Any:
    """``dtype.type(item)`` when it holds ``item`` exactly, as a save writes it (``item`` is the scalar's own
    ``.item()``); a value of another kind or one the cast changes (1.5 as int16, 1e300 as float32, 2 as bool) is
    refused, where numpy would cast it."""
    kinds = {"b": (bool,), "i": (int,), "u": (int,), "f": (float, int), "c": (complex, float, int)}[dtype.kind]
    if type(item) not in kinds or (dtype.kind in "iu" and type(item) is bool):
        raise CheckpointFormatError(f"numpy scalar of dtype {dtype.str!r} holds {type(item).__name__} {item!r}")
    with np.errstate(all="ignore"):
        value = dtype.type(item)
    back = value.item()
    same = back == item or (isinstance(item, float) and item != item and back != back)
    if dtype.kind == "c" and not same:  # (a NaN part: equal parts elsewhere, both NaN there)
        pairs = ((back.real, item.real), (back.imag, item.imag)) if isinstance(item, complex) else ()
        same = bool(pairs) and all(b == i or (b != b and i != i) for b, i in pairs)
    if not same:
        raise CheckpointFormatError(f"numpy scalar of dtype {dtype.str!r} cannot hold {item!r} exactly")
    return value


def np_dtype_from_name(name: Any) -> np.dtype:
    """A numeric numpy dtype named in a checkpoint (kinds ``biufc``, at most 32 bytes), else a format error.

    Example:
        >>> np_dtype_from_name("<f4")
        dtype('float32')
    """
    try:
        dtype = np.dtype(name) if isinstance(name, str) and len(name) <= 16 else None
    except (TypeError, ValueError, SyntaxError):  # numpy parses dtype strings (SyntaxError for some shapes)
        dtype = None
    if dtype is None or dtype.kind not in _NP_KINDS or dtype.itemsize > _NP_MAX_ITEMSIZE or dtype.shape:
        raise CheckpointFormatError(
            f"numpy dtype {str(name)[:40]!r} in the state is not a numeric dtype of at most {_NP_MAX_ITEMSIZE} bytes "
            "(torchrl_dcp only saves bool, integer, float and complex arrays and scalars): the manifest is damaged "
            "or forged"
        )
    return dtype


def enum_node(value: enum.Enum) -> dict[str, Any]:
    """An enum member by its class and name: a load finds the class among the modules imported (it never
    imports one) and takes the member by name (no code of the class runs). Raises :class:`UnstorableLeaf` for a
    class defined in a function or a combination of flags."""
    cls = type(value)
    if "<locals>" in cls.__qualname__:
        raise UnstorableLeaf("an enum class defined inside a function: a load cannot find it")
    if not isinstance(value.name, str) or cls._member_map_.get(value.name) is not value:
        raise UnstorableLeaf("a combination of flags: store its .value")
    return {"t": "enum", "cls": f"{cls.__module__}:{cls.__qualname__}", "name": value.name}


def decode_enum(node: dict[str, Any]) -> Any:
    """The member named, of an enum class of a module imported already (looked up in the module's and classes'
    own dicts: no module is imported, no attribute hook runs)."""
    spec, name = node["cls"], node["name"]
    if not isinstance(spec, str) or not isinstance(name, str) or spec.count(":") != 1:
        raise CheckpointFormatError(f"malformed enum entry {str(spec)[:100]!r}")
    module_name, qualname = spec.split(":")
    owner: Any = sys.modules.get(module_name)
    if owner is None:
        raise CheckpointFormatError(
            f"the state holds a member of the enum {spec}, whose module is not imported: import {module_name} "
            "before loading (a load never imports a module)"
        )
    for part in qualname.split("."):
        owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
    if not (isinstance(owner, type) and issubclass(owner, enum.Enum)):
        where = (
            " (the script that saved it defined it: load from that script, or define the enum in a module and import"
            " it)"
            if module_name == "__main__"
            else ""
        )
        raise CheckpointFormatError(f"the state names {spec} as an enum class: there is none of that name{where}")
    member = owner._member_map_.get(name)
    if member is None:
        raise CheckpointFormatError(f"the enum {spec} has no member {name!r} (renamed since the save?)")
    return member
