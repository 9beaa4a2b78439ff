"""Replay-buffer list storages (``ListStorage``, the default of ``ReplayBuffer()``, and ``LazyStackStorage``).

A list storage holds one Python object per transition. Those built of tensors,
TensorDicts, NumPy arrays, numbers, strings and lists, tuples and dicts of them (what
torchrl's collectors and the DQN-style ``(obs, action, reward)`` tuples put there) are
saved without pickle: every TensorDict as its nested state (batch size, device,
non-tensor entries), everything else through the JSON value codec, every tensor as a
checkpoint tensor of its own. Any other object is refused at save time, naming its
position and type. Each transition's tensors are separate tensors of the checkpoint:
fine for thousands of transitions; a large buffer saves and loads much faster in a
``LazyTensorStorage`` or ``LazyMemmapStorage`` (one tensor per field).

Example:
    >>> import torch, tempfile, torchrl_dcp as tdcp
    >>> from torchrl.data import ReplayBuffer
    >>> rb = ReplayBuffer(batch_size=2)  # a ListStorage
    >>> _ = rb.extend([(torch.ones(2), 0), (torch.zeros(2), 1)])
    >>> path = tdcp.DistributedCheckpoint(buffer=rb).save(tempfile.mkdtemp() + "/c")
    >>> fresh = ReplayBuffer(batch_size=2)
    >>> _ = tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    >>> fresh[1]
    (tensor([0., 0.]), 1)
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase, is_non_tensor
from torchrl.data.replay_buffers.storages import ListStorage

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.tensordict import tensordict_from_state, tensordict_state
from torchrl_dcp.errors import CheckpointFormatError, EncodingError, IncompatibleComponentError

LIST_KIND = "list"


def is_list_storage(storage: Any) -> bool:
    """A list storage whose transitions this module saves (not the byte-compressing ``CompressedListStorage``)."""
    return isinstance(storage, ListStorage) and not type(storage).__name__.startswith("Compressed")


def list_storage_state(storage: ListStorage) -> dict[str, Any]:
    """The storage's transitions, each ``{"td": state}`` (a TensorDict) or ``{"value": value}`` (codec values)."""
    items = []
    for i, item in enumerate(storage._storage):
        entry = _entry(item)
        if entry is None:
            raise EncodingError(
                f"replay buffer storage entry {i} is a {type(item).__module__}.{type(item).__qualname__}"
                f"{_inner(item)}, which cannot be saved without pickle: store tensors, TensorDicts, arrays, numbers, "
                "strings (or lists, tuples and dicts of them)"
            )
        items.append(entry)
    return {
        "type": type(storage).__name__,
        "kind": LIST_KIND,
        "initialized": bool(items),
        "len": len(items),
        "max_size": int(storage.max_size),
        "items": items,
    }


def _entry(item: Any, depth: int = 0) -> dict[str, Any] | None:
    """One transition (or a part of one) as saved: ``{"td": state}`` for a TensorDict, ``{"value": value}`` for what
    the JSON value codec stores, ``{"seq": {"tuple": bool, "items": [entries]}}`` / ``{"map": [[key, entry], ...]}``
    for a list, tuple or dict holding TensorDicts (``(td, info)``); ``None`` for anything else."""
    if isinstance(item, TensorDictBase) and not is_non_tensor(item):
        return {"td": tensordict_state(item)}
    if _codec_value(item):
        return {"value": item}
    if depth > MAX_NESTING:
        return None
    if type(item) in (list, tuple):
        inner = [_entry(v, depth + 1) for v in item]
        return None if None in inner else {"seq": {"tuple": type(item) is tuple, "items": inner}}
    if type(item) is dict and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in item):
        pairs = [[k, _entry(v, depth + 1)] for k, v in item.items()]
        return None if any(e is None for _, e in pairs) else {"map": pairs}
    return None


def _inner(item: Any, depth: int = 0) -> str:
    """What inside a list, tuple or dict cannot be saved (`` holding a set``), or ``""``."""
    if depth > MAX_NESTING or type(item) not in (list, tuple, dict):
        return ""
    values = item.values() if type(item) is dict else item
    for v in values:
        if _entry(v, depth + 1) is None:
            return _inner(v, depth + 1) or f" holding a {type(v).__module__}.{type(v).__qualname__}"
    return ""


MAX_NESTING = 16  # lists, tuples and dicts holding TensorDicts, nested at most this deep


def _codec_value(value: Any, depth: int = 0) -> bool:
    """Whether the JSON value codec stores ``value`` (checked here to name the transition that is not)."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, np.ndarray, np.generic)):
        return True
    if depth > 50:
        return False
    if isinstance(value, (list, tuple)):
        return all(_codec_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _codec_value(v, depth + 1) for k, v in value.items())
    return False


def check_list_destination(storage: Any, saved: dict[str, Any], name: str) -> None:
    """While planning: the live buffer has a list storage with room for the saved transitions."""
    if not is_list_storage(storage):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds a {saved['type']} (one object per transition), the buffer's "
            f"storage is a {type(storage).__name__}; build the buffer with a ListStorage"
        )
    if saved["len"] > int(storage.max_size):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds {saved['len']} transitions, the buffer's storage has room "
            f"for {int(storage.max_size)}; build the buffer with a larger capacity"
        )


def list_items(saved: dict[str, Any], ctx: AdapterContext | None = None) -> list[Any]:
    """The saved transitions, rebuilt (their tensors are the load's fresh tensors)."""
    items = saved.get("items")
    if not isinstance(items, list) or len(items) != saved.get("len"):
        raise CheckpointFormatError("malformed list storage state")
    return [_item(entry, ctx, 0) for entry in items]


def check_list_entries(saved: dict[str, Any]) -> None:
    """The saved transitions' structure (what :func:`list_items` rebuilds), checked without rebuilding them: what
    ``verify`` and a load's planning check of every saved buffer."""
    items = saved.get("items")
    if not isinstance(items, list) or len(items) != saved.get("len"):
        raise ValueError("its list storage state is malformed")
    try:
        for entry in items:
            _item(entry, None, 0, build=False)
    except CheckpointFormatError as err:  # (an adapter's check says ValueError: the load names the component)
        raise ValueError(f"its list storage: {err.message}") from None


def _item(entry: Any, ctx: AdapterContext | None, depth: int, build: bool = True) -> Any:
    """A saved entry (:func:`_entry`) rebuilt (``build=False``: its structure checked, nothing built)."""
    if not isinstance(entry, dict) or len(entry) != 1 or not ({"td", "value", "seq", "map"} >= set(entry)):
        raise CheckpointFormatError("malformed list storage entry")
    if "td" in entry:
        if not build:
            return None
        return tensordict_from_state(entry["td"], ctx)
    if "value" in entry:
        return entry["value"]
    if depth > MAX_NESTING:
        raise CheckpointFormatError(f"list storage entry nested more than {MAX_NESTING} deep")
    if "seq" in entry:
        seq = entry["seq"]
        if (
            not isinstance(seq, dict)
            or set(seq) != {"tuple", "items"}
            or type(seq["tuple"]) is not bool
            or not isinstance(seq["items"], list)
        ):
            raise CheckpointFormatError("malformed list storage entry")
        values = [_item(e, ctx, depth + 1, build) for e in seq["items"]]
        return tuple(values) if seq["tuple"] is True else values
    pairs = entry["map"]
    ok = isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in pairs
    )
    if not ok or len({p[0] for p in pairs}) != len(pairs):
        raise CheckpointFormatError("malformed list storage entry")
    return {k: _item(e, ctx, depth + 1, build) for k, e in pairs}


def restore_list_storage(storage: ListStorage, items: list[Any]) -> None:
    """Replace the storage's transitions (a new list: a rollback puts the old one back)."""
    storage._storage = list(items)
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()
