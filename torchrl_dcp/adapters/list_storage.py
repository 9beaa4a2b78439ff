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
        if isinstance(item, TensorDictBase) and not is_non_tensor(item):
            items.append({"td": tensordict_state(item)})
        elif _codec_value(item):
            items.append({"value": item})
        else:
            raise EncodingError(
                f"replay buffer storage entry {i} is a {type(item).__module__}.{type(item).__qualname__}, which "
                "cannot be saved without pickle: store tensors, TensorDicts, arrays, numbers, strings (or lists, "
                "tuples and dicts of them)"
            )
    return {
        "type": type(storage).__name__,
        "kind": LIST_KIND,
        "initialized": bool(items),
        "len": len(items),
        "max_size": int(storage.max_size),
        "items": items,
    }


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
    out = []
    for entry in items:
        if not isinstance(entry, dict) or len(entry) != 1 or not ({"td", "value"} >= set(entry)):
            raise CheckpointFormatError("malformed list storage entry")
        out.append(tensordict_from_state(entry["td"], ctx) if "td" in entry else entry["value"])
    return out


def restore_list_storage(storage: ListStorage, items: list[Any]) -> None:
    """Replace the storage's transitions (a new list: a rollback puts the old one back)."""
    storage._storage = list(items)
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()
