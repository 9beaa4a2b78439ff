"""Adapter for ``TensorDict`` (and nested TensorDicts, non-tensor entries).

The state keeps what ``TensorDict.state_dict()`` hides in an attribute that JSON
would lose: nesting, every level's ``batch_size``, ``device`` and dimension names. Loading
restores into the registered TensorDict: its tensors receive the saved bytes where they
are when they match (:mod:`~torchrl_dcp.adapters.in_place`), the other entries are
replaced (written into, when it is locked).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_dcp.adapters import TensorDictAdapter, AdapterContext
    >>> td = TensorDict({"obs": torch.zeros(4, 3)}, batch_size=[4])
    >>> TensorDictAdapter().state(td, AdapterContext("td"))["batch_size"]
    [4]
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.in_place import copy_except, in_place_tensors, is_expanded
from torchrl_dcp.errors import CheckpointFormatError, EncodingError, IncompatibleComponentError


def tensordict_state(td: TensorDictBase) -> dict[str, Any]:
    """Nested plain state of a TensorDict: tensors, sub-TensorDicts and non-tensor values; a lazy stack as the
    states of its TensorDicts (they may differ in shape: ragged transitions)."""
    if isinstance(td, LazyStackedTensorDict):
        if not td.tensordicts:
            raise _empty_stack(td)
        return {"stack_dim": int(td.stack_dim), "tensordicts": [tensordict_state(t) for t in td.tensordicts]}
    entries: dict[str, Any] = {}
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, TensorDictBase) and not _is_non_tensor(value):
            entries[key] = {"td": tensordict_state(value)}
        elif _is_non_tensor(value):
            if _is_stack(value):  # one value per element (``get_non_tensor`` gives the list of them)
                entries[key] = {"stack": _stack_state(value)}
            else:  # (its data itself: ``get_non_tensor`` gives a list of ``None`` per element for a ``None``)
                entries[key] = {"value": value.data}
        else:
            entries[key] = {"tensor": value}
    out = {
        "batch_size": list(td.batch_size),
        "device": None if td.device is None else str(td.device),
        "entries": entries,
    }
    names = td._maybe_names() if hasattr(td, "_maybe_names") else None
    if names is not None and any(n is not None for n in names):
        out["names"] = list(names)  # dimension names (only when some are set: older states have none)
    return out


def _is_stack(value: Any) -> bool:
    from tensordict import NonTensorStack

    return isinstance(value, NonTensorStack)


def _stack_state(value: Any) -> dict[str, Any]:
    """A ``NonTensorStack`` as the states of what it stacks (values, or stacks of them), with each value's batch
    size: ``tolist()`` would not tell a stack's rows from values that are lists."""
    if not value.tensordicts:
        raise _empty_stack(value)
    parts = []
    for part in value.tensordicts:
        if _is_stack(part):
            parts.append({"stack": _stack_state(part)})
        else:
            parts.append({"value": part.data, "batch_size": list(part.batch_size)})
    return {"stack_dim": int(value.stack_dim), "parts": parts}


def _empty_stack(stack: Any) -> EncodingError:
    """Why an empty stack (no part, e.g. the rows of ``td[mask]`` where no row is selected) is not saved: tensordict
    cannot put one back into a TensorDict (its ``set`` and ``update`` ask the first part for its dimension names), so
    the checkpoint could never load."""
    return EncodingError(
        f"an empty {type(stack).__name__} of batch size {list(stack.batch_size)} (no row along its stack dimension): "
        "tensordict cannot set one into a TensorDict again, so no load could restore it; save the TensorDict before "
        "selecting no row, or without the empty entry (td.exclude(key)), or as td.to_tensordict() where its entries "
        "are tensors"
    )


#: nested non-tensor stacks (one per batch dimension a stack spans): tensordict builds each level again for every
#: level above it (22 levels: 4 s), so a forged nesting is refused first
MAX_STACK_DEPTH = 12


def _stack_from_state(state: Any, depth: int = 0) -> Any:
    from tensordict import NonTensorData, NonTensorStack

    if (
        not isinstance(state, dict)
        or type(state.get("stack_dim")) is not int
        or not isinstance(state.get("parts"), list)
        or not state["parts"]
        or depth >= MAX_STACK_DEPTH
    ):
        raise CheckpointFormatError("malformed non-tensor stack in a TensorDict state")
    parts = []
    for part in state["parts"]:
        if isinstance(part, dict) and "stack" in part:
            parts.append(_stack_from_state(part["stack"], depth + 1))
        elif isinstance(part, dict) and "value" in part and isinstance(part.get("batch_size"), list):
            parts.append(NonTensorData(part["value"], batch_size=torch.Size(part["batch_size"])))
        else:
            raise CheckpointFormatError("malformed non-tensor stack in a TensorDict state")
    try:
        return NonTensorStack(*parts, stack_dim=state["stack_dim"])
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise CheckpointFormatError(f"malformed non-tensor stack in a TensorDict state ({err})") from None


def tensordict_from_state(state: dict[str, Any], ctx: AdapterContext | None = None) -> TensorDict:
    """Inverse of :func:`tensordict_state`."""
    if isinstance(state, dict) and isinstance(state.get("tensordicts"), list) and type(state.get("stack_dim")) is int:
        parts = [tensordict_from_state(s, ctx) for s in state["tensordicts"]]
        if not parts or not 0 <= state["stack_dim"] <= parts[0].batch_dims:
            raise CheckpointFormatError("malformed lazily stacked TensorDict state")
        return LazyStackedTensorDict(*parts, stack_dim=state["stack_dim"])
    if not isinstance(state, dict) or not isinstance(state.get("entries"), dict):
        raise CheckpointFormatError("malformed TensorDict state")
    device = _saved_device(state.get("device"))
    if device is not None and ctx is not None:
        device = ctx.device_for(device)
    out = TensorDict({}, batch_size=torch.Size(state["batch_size"]), device=device)
    for key, entry in state["entries"].items():
        if "td" in entry:
            out.set(key, tensordict_from_state(entry["td"], ctx))
        elif "value" in entry:
            out.set_non_tensor(key, entry["value"])
        elif "stack" in entry:
            out.set(key, _stack_from_state(entry["stack"]))
        else:
            out.set(key, entry["tensor"])
    names = state.get("names")
    if names is not None:
        if not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names):
            raise CheckpointFormatError("malformed TensorDict dimension names")
        try:
            out.names = names
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            raise CheckpointFormatError(f"malformed TensorDict dimension names ({err})") from None
    return out


def _saved_device(device: Any) -> str | None:
    """A saved TensorDict's ``device``: ``None`` or the name of a device, as a save writes it (``str(td.device)``);
    anything else is refused as malformed (an int was taken for a CUDA index)."""
    if device is None:
        return None
    try:
        if type(device) is not str:
            raise TypeError(f"a {type(device).__name__}")
        torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise CheckpointFormatError(f"malformed TensorDict device {device!r} ({err}): no save writes it") from None
    return device


def _is_non_tensor(value: Any) -> bool:
    from tensordict import is_non_tensor

    return is_non_tensor(value)


class TensorDictAdapter(Adapter):
    """Any ``TensorDictBase`` with its nesting, batch sizes and devices."""

    adapter_id = "torchrl_dcp.tensordict"
    version = 1

    def state(self, obj: TensorDictBase, ctx: AdapterContext) -> Any:
        return tensordict_state(obj)

    def snapshot(self, obj: TensorDictBase, ctx: AdapterContext) -> Any:
        """Tensors read in place are kept by reference; a locked TensorDict's others are copied (``update_`` writes
        into them), an unlocked one's kept too (its entries are replaced by a restore, never written into)."""
        state = tensordict_state(obj)
        if obj.is_locked:
            return copy_except(state, {id(t) for t in (ctx.plan.get("in_place") or {}).values()})
        return state

    def validate(self, obj: TensorDictBase, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """A locked TensorDict is restored in place (``update_``, which skips keys it lacks and casts dtypes): it
        must hold exactly the saved keys, each tensor of the saved dtype and shape (checked before anything
        changes); an unlocked one is rebuilt as saved. A TensorDict on the meta device, or a locked one holding meta
        tensors, would keep no loaded byte (the restore moves the saved tensors onto its device, or writes into tensors
        with no memory): refused."""
        _check_materialised(obj, ctx.name, "")
        for state in saved.values():
            _check_locked(obj, state, ctx.name, "")
        _refuse_repeated(obj, ctx.name)
        for state in saved.values():  # the restore's own construction, on meta tensors: refused before any read
            _check_restorable(obj, state, ctx.name)
        ctx.plan["in_place"] = {}
        if len(saved) == 1 and (ctx.saved_world_size is None or ctx.saved_world_size == ctx.world_size):
            (view,) = saved.values()
            ctx.plan["in_place"] = in_place_tensors(tensordict_state(obj), view, ctx, partial=True)

    def destinations(self, obj: TensorDictBase, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        """The TensorDict's own tensors, read in place where they match the saved ones
        (:mod:`~torchrl_dcp.adapters.in_place`): a ``TensorDict.from_module(policy)`` restores the policy's
        parameters, which stay its entries."""
        return ctx.plan.get("in_place") or None

    def restore(self, obj: TensorDictBase, state: Any, ctx: AdapterContext) -> Any:
        _restore_into(obj, tensordict_from_state(state, ctx), ctx.name)
        return None


def _on_meta(state: Any) -> Any:
    """A saved state (tensors as :class:`~torchrl_dcp.format.codec.TensorSpec`) with meta tensors for its tensors
    and no device: what :func:`tensordict_from_state` builds from it, without memory."""
    from torchrl_dcp.format.codec import TensorSpec

    if type(state) is TensorSpec:
        return torch.empty(state.shape, dtype=state.dtype, device="meta")
    if isinstance(state, dict):
        return {k: (_saved_device(v) and None if k == "device" else _on_meta(v)) for k, v in state.items()}
    if isinstance(state, list):
        return [_on_meta(v) for v in state]
    return state


def meta_tensordict(state: Any) -> TensorDict:
    """The TensorDict a saved state (tensors as :class:`~torchrl_dcp.format.codec.TensorSpec`) restores, built on
    meta tensors (no memory): its keys, batch size, dtypes and shapes, to check before anything is read."""
    return tensordict_from_state(_on_meta(state))


def saved_keys(state: Any) -> set[Any]:
    """The leaf keys (nested ones as tuples) of the TensorDict a saved state (tensors as
    :class:`~torchrl_dcp.format.codec.TensorSpec`) restores, built on meta tensors (no memory)."""
    return set(meta_tensordict(state).keys(include_nested=True, leaves_only=True))


def _check_restorable(obj: Any, state: Any, name: str) -> None:
    """Build what the restore builds from ``state`` (on meta tensors) and compare it with ``obj`` as the restore
    does: a malformed or forged state (names, stacks, batch sizes, nesting) is refused while the load is planned,
    before any of the TensorDict's tensors is read in place."""
    try:
        new = tensordict_from_state(_on_meta(state))
        _check_stacks(obj, new, name)
    except CheckpointFormatError as err:
        err.reword(f"component {name!r}: {err.message}")
        raise
    except IncompatibleComponentError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, OverflowError) as err:
        raise CheckpointFormatError(
            f"component {name!r}: its saved TensorDict state cannot be rebuilt ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}): damaged or forged"
        ) from None


def _check_stacks(obj: Any, new: Any, name: str) -> None:
    """What :func:`_restore_into` refuses of lazy stacks, checked without changing anything."""
    if isinstance(obj, LazyStackedTensorDict):
        parts = new.tensordicts if isinstance(new, LazyStackedTensorDict) else None
        if parts is None or len(parts) != len(obj.tensordicts) or new.stack_dim != obj.stack_dim:
            found = f"{len(parts)} along dim {new.stack_dim}" if parts is not None else "a TensorDict that is no stack"
            raise IncompatibleComponentError(
                f"component {name!r} holds {len(obj.tensordicts)} stacked TensorDicts along dim {obj.stack_dim}, "
                f"the checkpoint {found}"
            )
        for live, saved in zip(obj.tensordicts, parts):
            _check_stacks(live, saved, name)


def _refuse_repeated(obj: Any, name: str) -> None:
    """Refuse a TensorDict holding one TensorDict at two places (two keys, or twice in a lazy stack): each place is
    restored where it is, so the second would overwrite the first."""
    seen: dict[int, str] = {}

    def walk(td: Any, at: str, depth: int) -> None:
        if depth > 64 or not isinstance(td, TensorDictBase) or _is_non_tensor(td):
            return
        where = at or "<root>"
        if id(td) in seen:
            raise IncompatibleComponentError(
                f"component {name!r} holds one TensorDict at {seen[id(td)]} and at {where}: a load restores each "
                "place where it is, the second over the first; build it from distinct TensorDicts"
            )
        seen[id(td)] = where
        if isinstance(td, LazyStackedTensorDict):
            for i, part in enumerate(td.tensordicts):
                walk(part, f"{at}[{i}]", depth + 1)
            return
        for key in td.keys():
            value = td.get(key)
            if isinstance(value, TensorDictBase):
                walk(value, f"{at}.{key}" if at else str(key), depth + 1)

    walk(obj, "", 0)


def _check_materialised(obj: Any, name: str, at: str) -> None:
    """Refuse a TensorDict (at any level) whose restore would leave meta tensors: one whose ``device`` is meta (the
    saved tensors would be moved there), or a locked one holding a meta tensor (``update_`` writes into it). An
    unlocked TensorDict without a device replaces its meta tensors by the loaded ones: accepted."""
    if isinstance(obj, LazyStackedTensorDict):
        for i, part in enumerate(obj.tensordicts):
            _check_materialised(part, name, f"{at}[{i}]")
        return
    if not isinstance(obj, TensorDictBase):
        return
    where = f" at {at}" if at else ""
    if obj.device is not None and obj.device.type == "meta":
        raise IncompatibleComponentError(
            f"component {name!r}: the TensorDict{where} is on the meta device (its tensors have no memory; the load "
            "would move the saved tensors there, keeping nothing): build it on a real device before loading (an "
            "unlocked TensorDict with device=None is rebuilt as saved)"
        )
    for key in obj.keys():
        value = obj.get(key)
        path = f"{at}.{key}" if at else str(key)
        if isinstance(value, TensorDictBase) and not _is_non_tensor(value):
            _check_materialised(value, name, path)
        elif obj.is_locked and isinstance(value, torch.Tensor) and value.is_meta:
            raise IncompatibleComponentError(
                f"component {name!r}: the locked TensorDict holds {path!r} on the meta device (no memory to load "
                "into): build it on a real device, or unlock it, before loading"
            )


def _check_locked(obj: Any, state: Any, name: str, at: str) -> None:
    """Where ``obj`` (or a stacked or nested TensorDict of it) is locked, ``state`` (a saved state, tensors as
    :class:`~torchrl_dcp.format.codec.TensorSpec`) has exactly its keys, and each tensor its dtype and shape."""
    if not isinstance(state, dict):
        return  # (a malformed state is refused by the restore)
    if isinstance(obj, LazyStackedTensorDict):
        parts = state.get("tensordicts")
        if isinstance(parts, list) and len(parts) == len(obj.tensordicts):  # (else refused by the restore)
            for i, (live, part) in enumerate(zip(obj.tensordicts, parts)):
                _check_locked(live, part, name, f"{at}[{i}]")
        return
    entries = state.get("entries")
    if not isinstance(obj, TensorDictBase) or not isinstance(entries, dict):
        return
    if not obj.is_locked:  # rebuilt from the saved state, whatever it held
        return

    def refuse(why: str) -> IncompatibleComponentError:
        return IncompatibleComponentError(
            f"component {name!r}: the locked TensorDict{' at ' + at if at else ''} {why}; it is restored in place, "
            "so it must hold the saved keys, dtypes and shapes: unlock it (or build it as saved) before loading"
        )

    live_keys, saved_keys = set(obj.keys()), set(entries)
    if live_keys != saved_keys:
        raise refuse(
            f"holds keys {sorted(live_keys - saved_keys)[:5]} the checkpoint lacks and lacks "
            f"{sorted(saved_keys - live_keys)[:5]}"
        )
    for key, entry in entries.items():
        value = obj.get(key)
        if isinstance(entry, dict) and "td" in entry:
            _check_locked(value, entry["td"], name, f"{at}.{key}" if at else key)
            continue
        spec = entry.get("tensor") if isinstance(entry, dict) else None
        if spec is not None and isinstance(value, torch.Tensor) and not _is_non_tensor(value):
            if value.dtype != spec.dtype or tuple(value.shape) != tuple(spec.shape):
                raise refuse(
                    f"holds {key!r} as {value.dtype} {list(value.shape)}, the checkpoint as {spec.dtype} "
                    f"{list(spec.shape)}"
                )
            if is_expanded(value) or (value.is_inference() and not torch.is_inference_mode_enabled()):
                # (update_ would fail on it half-way, after the other entries and components were read in place)
                what = "an expanded view (its elements share memory)" if is_expanded(value) else "an inference tensor"
                raise refuse(
                    f"holds {key!r} as {what}, which no load can write into (build it with memory of its own, "
                    "outside torch.inference_mode(): e.g. value.clone())"
                )


def _restore_into(obj: TensorDictBase, new: TensorDictBase, name: str) -> None:
    if isinstance(obj, LazyStackedTensorDict):  # each stacked TensorDict in turn, where it is
        _check_stacks(obj, new, name)  # (checked while planning too: a rollback's snapshot comes here unchecked)
        for live, saved in zip(obj.tensordicts, new.tensordicts):
            _restore_into(live, saved, name)
        return
    names = new._maybe_names()
    if obj._maybe_names() != names:  # dimension names as saved (none saved: none); others are cleared first (an
        obj.names = [None] * obj.batch_dims  # update, or setting names, over other names refines them: refused)
    if obj.is_locked:
        with torch.no_grad():  # (parameters: a leaf that requires grad takes no in-place copy under autograd)
            obj.update_(new)
        _restore_non_tensors(obj, new)
    else:
        drop_unsaved(obj, new)
        if obj.batch_size != new.batch_size:
            for key in list(obj.keys()):
                del obj[key]
            obj.batch_size = new.batch_size
        obj.update(new)
        if obj.device != new.device:  # (update merges entries, never the device: set as saved, its entries are)
            obj._device = new.device
    if names is not None and obj._maybe_names() != names:
        obj.names = names


def _restore_non_tensors(obj: TensorDictBase, new: TensorDictBase) -> None:
    """Set a locked TensorDict's non-tensor entries as saved (``update_`` writes tensors only), at every level
    ``update_`` reaches (nested TensorDicts; lazy stacks are restored part by part)."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(td: Any, prefix: tuple[str, ...]) -> None:
        for key in td.keys():
            value = td.get(key)
            if _is_non_tensor(value):
                found.append(((*prefix, key), value))
            elif isinstance(value, TensorDict):
                walk(value, (*prefix, key))

    walk(new, ())
    if found:
        with obj.unlock_():
            for key, value in found:
                obj.set(key, value)


def drop_unsaved(obj: TensorDictBase, new: TensorDictBase) -> None:
    """Remove from an unlocked ``obj`` the keys ``new`` lacks, at every level ``update`` merges (nested
    TensorDicts), so that the update leaves exactly the saved keys."""
    if obj.is_locked:  # (a locked one keeps its keys: the TensorDict adapter checks them while planning)
        return
    for key in list(obj.keys()):
        if key not in new.keys():
            del obj[key]
            continue
        current, saved = obj.get(key), new.get(key)
        if (
            type(current) is TensorDict
            and type(saved) is TensorDict
            and not current.is_locked
            and current.batch_size == saved.batch_size
        ):
            drop_unsaved(current, saved)
