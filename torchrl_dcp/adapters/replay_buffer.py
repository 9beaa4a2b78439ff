"""Replay buffers (``ReplayBuffer``, ``TensorDictReplayBuffer``, ``TensorDictPrioritizedReplayBuffer``).

Saved through DCP tensors, never through ``dumps()`` pickles: the storage's filled
rows, the sampler (prioritized sum/min-tree leaves, the without-replacement
permutation, ...), the writer (cursor, write count, the max-value heap), the
buffer's transforms, batch size and its own ``generator``. Placed ``per_rank`` by
default: each rank holds its own shard.

Loading allocates a lazily built storage from the saved shapes first (a
``LazyMemmapStorage`` in its own ``scratch_dir``), then DCP reads the rows
straight into it: no second copy in memory. Memmap rows are written straight from
their files.

Example:
    >>> import torch, tempfile
    >>> from tensordict import TensorDict
    >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    >>> import torchrl_dcp as tdcp
    >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
    >>> _ = rb.extend(TensorDict({"obs": torch.randn(10, 3)}, [10]))
    >>> path = tdcp.DistributedCheckpoint(buffer=rb).save(tempfile.mkdtemp() + "/c")
    >>> rb2 = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
    >>> _ = tdcp.DistributedCheckpoint(buffer=rb2).load(path)
    >>> len(rb2)
    10
"""

from __future__ import annotations

import copy
import heapq
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import MemoryMappedTensor, is_tensor_collection
from torchrl.data.replay_buffers import ReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler
from torchrl.data.replay_buffers.storages import ListStorage, TensorStorage
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

from torchrl_dcp.adapters import buffer_reshard
from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.buffer_checks import (
    check_buffer_values,
    check_live_keys,
    check_saved_buffer,
    refuse_overfull_sampler,
    writer_counts,
)
from torchrl_dcp.adapters.buffer_state import (
    allocate,
    buffer_settings,
    check_no_other_entries,
    flatten,
    initialized_buffer,
    live_leaf,
    restore_buffer_settings,
)
from torchrl_dcp.adapters.buffer_transforms import (
    check_held_states,
    restore_transform_states,
    transform_states,
    warn_unsaved_transforms,
)
from torchrl_dcp.adapters.list_storage import (
    LIST_KIND,
    check_list_destination,
    is_list_storage,
    list_items,
    list_storage_state,
    restore_list_storage,
)
from torchrl_dcp.errors import EncodingError, IncompatibleComponentError, InexactResumeWarning


# --------------------------------------------------------------------------- storage
def _leading_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows, without copying: memmap rows are re-mapped from their file."""
    if rows == tensor.shape[0]:
        return tensor
    try:
        filename = getattr(tensor, "filename", None)
    except RuntimeError:  # tensordict: "The MemoryMappedTensor has no file associated" (scratch_dir=None)
        filename = None
    if isinstance(tensor, MemoryMappedTensor) and filename and tensor.is_contiguous() and tensor.storage_offset() == 0:
        return MemoryMappedTensor.from_filename(filename=filename, dtype=tensor.dtype, shape=(rows, *tensor.shape[1:]))
    return tensor[:rows]


def _tensor_tree(data: Any, rows: int, where: str) -> Any:
    if isinstance(data, torch.Tensor):
        return _leading_rows(data, rows)
    if not is_tensor_collection(data):
        raise EncodingError(
            f"replay buffer storage {where} holds {type(data).__name__}s of tensors (a pytree), which cannot be "
            "saved: extend the buffer with TensorDicts (TensorDict(data, batch_size=[n])) or bare tensors"
        )
    out: dict[str, Any] = {}
    for key in data.keys():  # noqa: SIM118 (iterating a TensorDict walks its first dim, not its keys)
        value = data.get(key)
        if is_tensor_collection(value) and not _is_non_tensor(value):
            out[key] = _tensor_tree(value, rows, f"{where}/{key}")
        elif isinstance(value, torch.Tensor):
            out[key] = _leading_rows(value, rows)
        else:
            raise EncodingError(
                f"replay buffer storage entry {where}/{key} holds non-tensor data ({type(value).__name__}); "
                "store tensors only, or keep such data out of the buffer"
            )
    return out


def _is_non_tensor(value: Any) -> bool:
    from tensordict import is_non_tensor

    return is_non_tensor(value)


def storage_state(storage: Any) -> dict[str, Any]:
    if is_list_storage(storage):
        return list_storage_state(storage)
    if not isinstance(storage, TensorStorage):
        if type(storage).__name__ == "StorageEnsemble":
            raise EncodingError(
                "a ReplayBufferEnsemble cannot be saved as one component (its StorageEnsemble is not a tensor or "
                "list storage): register each of its buffers (ensemble[i]) as a component of its own"
            )
        what = "it holds compressed bytes" if isinstance(storage, ListStorage) else "it is not a tensor or list storage"
        raise EncodingError(
            f"a replay buffer storage {type(storage).__name__} cannot be saved ({what}): use ListStorage, "
            "LazyTensorStorage or LazyMemmapStorage"
        )
    state: dict[str, Any] = {
        "type": type(storage).__name__,
        "initialized": bool(storage.initialized),
        "len": int(storage._len) if storage.initialized else 0,
        "max_size": int(storage.max_size),
        "ndim": int(storage.ndim),
    }
    if not storage.initialized:
        return state
    data = storage._storage
    # ndim > 1: rows along dim 0 (each holds ``prod(shape[1:ndim])`` items); only the written ones
    rows = state["len"] if storage.ndim == 1 else min(int(data.shape[0]), int(storage._len_along_dim0 or 0))
    state["rows"] = rows
    state["is_tensordict"] = is_tensor_collection(data)
    state["data"] = _tensor_tree(data, rows, "storage")
    last = getattr(storage, "_last_cursor", None)
    state["last_cursor"] = last if last is None or isinstance(last, (int, torch.Tensor)) else None
    return state


def storage_destinations(storage: TensorStorage, saved: Mapping[str, Any], name: str) -> dict[str, torch.Tensor]:
    """Allocate (or check) the live storage from the saved shapes; return row views to read into."""
    if saved.get("kind") == LIST_KIND:  # one object per transition: its tensors are read into fresh buffers
        check_list_destination(storage, saved, name)
        return {}
    if not saved["initialized"]:
        return {}
    if not isinstance(storage, TensorStorage):
        raise IncompatibleComponentError(
            f"component {name!r}: the buffer's storage {type(storage).__name__} is not a tensor storage"
        )
    ndim, rows = saved["ndim"], saved["rows"]
    if ndim != storage.ndim:
        raise IncompatibleComponentError(f"component {name!r}: storage ndim was {ndim}, the buffer's is {storage.ndim}")
    flat = flatten(saved["data"])
    if not storage.initialized:
        allocate(storage, flat, saved["is_tensordict"], ndim)
    else:
        check_no_other_entries(storage, flat, name)
    live = storage._storage
    capacity = int(live.shape[0])
    if rows > capacity:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds {rows} rows, the buffer's storage has room for {capacity}; "
            "build the buffer with a larger capacity"
        )
    out: dict[str, torch.Tensor] = {}
    for key, spec in flat.items():
        leaf = live_leaf(storage, key, tuple(spec.shape[1:]), spec.dtype, allocate=rows > 0)
        if leaf is None and rows == 0:
            continue  # nothing saved to read in, and no saved byte backs its shape: torchrl adds it at its first write
        if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape[1:]) != spec.shape[1:] or leaf.dtype != spec.dtype:
            found = (tuple(leaf.shape[1:]), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise IncompatibleComponentError(
                f"component {name!r}: storage entry {'.'.join(key) or '<tensor>'} was saved as {spec.shape[1:]} "
                f"{spec.dtype}, the buffer holds {found}"
            )
        out[spec.key] = leaf[:rows]
    return out


def restore_storage(storage: TensorStorage, saved: Mapping[str, Any]) -> None:
    if saved["initialized"]:
        storage._len = saved["len"]
        storage.initialized = True
        if saved.get("last_cursor") is not None:
            set_cursor = getattr(storage, "_set_last_cursor", None)  # (torchrl 0.14: also its shared time index)
            if callable(set_cursor):
                set_cursor(saved["last_cursor"])
            else:
                storage._last_cursor = saved["last_cursor"]
    elif storage.initialized:
        storage._len = 0
        if _lazy_without_files(storage):  # as saved: never written (its next extend sets its entries again)
            storage._storage, storage.initialized = None, False
            set_cursor = getattr(storage, "_set_last_cursor", None)  # (torchrl 0.14: also its shared index, -1)
            if callable(set_cursor):
                set_cursor(None)
            storage._last_cursor = None
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()


def _lazy_without_files(storage: Any) -> bool:
    """A lazily allocated tensor storage that can be allocated again (a memmap storage with a ``scratch_dir``
    cannot: torchrl never writes over the memmap files it made there, so it stays allocated and empty, as torchrl's
    own ``empty()`` leaves a storage)."""
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage

    if isinstance(storage, LazyMemmapStorage):
        return not getattr(storage, "scratch_dir", None)
    return isinstance(storage, LazyTensorStorage)


# --------------------------------------------------------------------------- sampler
def sampler_state(sampler: Any) -> dict[str, Any]:
    if isinstance(sampler, PrioritizedSampler):
        capacity = int(sampler._max_capacity)
        index = torch.arange(capacity)
        state = {
            "kind": "prioritized",
            "type": type(sampler).__name__,
            "alpha": sampler._alpha,
            "beta": sampler._beta,
            "eps": sampler._eps,
            "max_priority": sampler._max_priority,
            "capacity": capacity,
            "sum": sampler._sum_tree[index],
            "min": sampler._min_tree[index],
        }
        extra = _slice_state(sampler)
        if extra is not None:
            state["slice"] = extra
        return state
    state = {"kind": "state_dict", "type": type(sampler).__name__, "state": sampler.state_dict()}
    extra = {a: vars(sampler)[a] for a in SAMPLER_EXTRA_ATTRIBUTES if a in vars(sampler)}
    if extra:
        state["extra"] = extra
    return state


#: What samplers set while sampling and their ``state_dict`` leaves out (torchrl 0.14): a buffer's prefetching
#: iterator reads ``SamplerWithoutReplacement._remaining_batches`` (the class default, int64 max, after a load).
SAMPLER_EXTRA_ATTRIBUTES = ("_remaining_batches",)


def _slice_state(sampler: Any) -> Any:
    from torchrl.data.replay_buffers.samplers import SliceSampler

    return SliceSampler.state_dict(sampler) if isinstance(sampler, SliceSampler) else None


def restore_sampler(sampler: Any, saved: Mapping[str, Any], name: str, rows: int | None = None) -> None:
    """Put a saved sampler state back. ``rows``: a prioritized sampler of another capacity than saved takes the
    priorities of the first ``rows`` transitions (a buffer that never wrapped around, loaded into another capacity:
    :func:`_check_other_capacity`); the others are refused."""
    if type(sampler).__name__ != saved["type"]:
        raise IncompatibleComponentError(
            f"component {name!r}: sampler was {saved['type']}, the buffer has {type(sampler).__name__}"
        )
    if saved["kind"] == "prioritized":
        capacity = saved["capacity"]
        leaves = capacity
        if int(sampler._max_capacity) != capacity:
            if rows is None or rows > int(sampler._max_capacity):
                raise IncompatibleComponentError(
                    f"component {name!r}: prioritized sampler capacity was {capacity}, the buffer's is "
                    f"{sampler._max_capacity}"
                )
            leaves = rows  # (the saved trees' other leaves hold no transition)
        max_priority = saved["max_priority"]  # (its index checked with the values read: check_values)
        sampler._alpha, sampler._beta, sampler._eps = saved["alpha"], saved["beta"], saved["eps"]
        sampler._empty()
        index = torch.arange(leaves)
        sampler._sum_tree[index] = saved["sum"][:leaves]
        sampler._min_tree[index] = saved["min"][:leaves]
        sampler._max_priority = tuple(max_priority) if isinstance(max_priority, list) else max_priority
        if "slice" in saved:
            from torchrl.data.replay_buffers.samplers import SliceSampler

            SliceSampler.load_state_dict(sampler, saved["slice"])
        return
    sampler.load_state_dict(saved["state"])
    extra = saved.get("extra", {})
    for attr in SAMPLER_EXTRA_ATTRIBUTES:
        if attr in extra:
            setattr(sampler, attr, extra[attr])
        else:
            vars(sampler).pop(attr, None)  # (saved before it was set: the class default, as then)


# --------------------------------------------------------------------------- writer
def writer_state(writer: Any) -> dict[str, Any]:
    if isinstance(writer, TensorDictMaxValueWriter):
        heap = writer._current_top_values
        return {
            "kind": "max_value",
            "cursor": int(writer._cursor),
            "write_count": int(writer._write_count),
            "heap_rank": _ranks(heap),
            "heap_index": torch.tensor([int(i) for _, i in heap], dtype=torch.int64),
        }
    return {"kind": "state_dict", "type": type(writer).__name__, "state": writer.state_dict()}


def _ranks(heap: list[tuple[Any, int]]) -> torch.Tensor:
    """A max-value writer's ranks, exactly: int64 when every rank is an integer (a rank key of integers, e.g.
    timestamps past 2**53, which float64 would round), float64 otherwise."""
    ranks = [r.item() if isinstance(r, torch.Tensor) else r for r, _ in heap]
    if ranks and all(isinstance(r, int) and not isinstance(r, bool) and -(2**63) <= r < 2**63 for r in ranks):
        return torch.tensor(ranks, dtype=torch.int64)
    return torch.tensor([float(r) for r in ranks], dtype=torch.float64)


def restore_writer(writer: Any, saved: Mapping[str, Any], name: str) -> None:
    if saved["kind"] == "max_value":
        if not isinstance(writer, TensorDictMaxValueWriter):
            raise IncompatibleComponentError(
                f"component {name!r}: writer was TensorDictMaxValueWriter, the buffer has {type(writer).__name__}"
            )
        writer._cursor = saved["cursor"]
        writer._write_count = saved["write_count"]
        heap = list(zip(saved["heap_rank"].tolist(), saved["heap_index"].tolist()))
        heapq.heapify(heap)  # already a heap when saved; heapify is a no-op then
        writer._current_top_values = heap
        return
    if type(writer).__name__ != saved["type"]:
        raise IncompatibleComponentError(
            f"component {name!r}: writer was {saved['type']}, the buffer has {type(writer).__name__}"
        )
    writer.load_state_dict(saved["state"])
    if "_generation" not in saved["state"] and getattr(writer, "_generation", None) is not None:
        writer._generation = None  # (saved before its first write: no stamps, where torchrl's load keeps the old)


def _check_kinds(rb: ReplayBuffer, state: Any, name: str) -> None:
    """The buffer's sampler and writer are of the saved classes (what :func:`restore_sampler` and
    :func:`restore_writer` refuse), checked while planning: before other components' tensors are read in place."""
    if not isinstance(state, Mapping):
        return
    sampler, writer = state.get("sampler"), state.get("writer")
    if isinstance(sampler, Mapping) and "type" in sampler and type(rb._sampler).__name__ != sampler["type"]:
        raise IncompatibleComponentError(
            f"component {name!r}: sampler was {sampler['type']}, the buffer has {type(rb._sampler).__name__}: build "
            "the buffer with the sampler it was saved with"
        )
    if not isinstance(writer, Mapping):
        return
    if writer.get("kind") == "max_value":
        expected = "TensorDictMaxValueWriter"
        ok = isinstance(rb._writer, TensorDictMaxValueWriter)
    else:
        expected = writer.get("type")
        ok = expected is None or type(rb._writer).__name__ == expected
    if not ok:
        raise IncompatibleComponentError(
            f"component {name!r}: writer was {expected}, the buffer has {type(rb._writer).__name__}: build the buffer "
            "with the writer it was saved with"
        )


def _check_restorable(rb: ReplayBuffer, state: Any, name: str) -> None:
    """The saved writer's and sampler's ``state_dict``s hold every key this buffer's do, and the saved transform's
    every key of its module (what their ``load_state_dict`` read): refused while planning, where a missing one failed
    the restore after other components' tensors were read in place."""
    if not isinstance(state, Mapping):
        return
    parts = [("writer", rb._writer), ("sampler", rb._sampler)]
    try:
        for what, live in parts:
            saved = state.get(what)
            if isinstance(saved, Mapping) and saved.get("kind") == "state_dict":
                check_live_keys(saved.get("state"), live.state_dict(), what)
        transform = getattr(rb, "_transform", None)
        if isinstance(transform, torch.nn.Module) and isinstance(state.get("transform"), Mapping):
            live_keys = transform.state_dict()
            check_live_keys(state["transform"], live_keys, "transform")
            extra = sorted(str(k) for k in state["transform"].keys() - live_keys.keys())
            if extra:
                raise ValueError(f"its transform holds {extra}, which this buffer's transform lacks")
    except ValueError as err:
        raise IncompatibleComponentError(
            f"component {name!r}: {err}: the checkpoint was saved from a buffer built otherwise (build it as when "
            "saved), or it is damaged or forged"
        ) from None


def _check_other_capacity(rb: ReplayBuffer, state: Mapping[str, Any], name: str) -> None:
    """Same world size, a buffer of another capacity than saved: exact only while no saved transition was
    overwritten (the buffer then continues as one of the new capacity would after the same writes); a buffer that
    wrapped around lost its oldest transitions to its capacity, which a larger (or smaller) one would have kept."""
    saved_storage = state.get("storage")
    counts = writer_counts(state.get("writer"))
    if not isinstance(saved_storage, Mapping) or counts is None or saved_storage.get("ndim", 1) != 1:
        return
    capacity, saved_capacity, n = int(rb._storage.max_size), saved_storage.get("max_size"), saved_storage.get("len")
    if capacity == saved_capacity or counts[1] == n:
        return
    raise IncompatibleComponentError(
        f"component {name!r}: the checkpoint's buffer of capacity {saved_capacity} wrote {counts[1]} transitions and "
        f"kept the last {n} (its writer wrapped around), the buffer's capacity is {capacity}: a buffer of another "
        f"capacity cannot continue it exactly; build the buffer with capacity {saved_capacity}"
    )


def _other_capacity_rows(rb: ReplayBuffer, state: Mapping[str, Any]) -> int | None:
    """The saved transitions of a one-dimensional buffer loaded into another capacity (accepted by
    :func:`_check_other_capacity`: it never wrapped around), else ``None``."""
    storage = state.get("storage")
    if not isinstance(storage, Mapping) or storage.get("ndim", 1) != 1 or writer_counts(state.get("writer")) is None:
        return None
    if int(rb._storage.max_size) == storage.get("max_size"):
        return None
    return storage.get("len") if type(storage.get("len")) is int else None


def _continue_in_other_capacity(rb: ReplayBuffer, state: Mapping[str, Any]) -> None:
    """After :func:`_check_other_capacity` accepted another capacity: the writer's cursor after the saved rows."""
    storage = rb._storage
    counts = writer_counts(state["writer"])
    if counts is None or int(storage.max_size) == state["storage"]["max_size"] or state["storage"].get("ndim", 1) != 1:
        return
    rb._writer._cursor = state["storage"]["len"] % int(storage.max_size)


def _entries(directory: str) -> set[str]:
    """The paths under ``directory`` (none when it does not exist), links not followed."""
    found: set[str] = set()
    for root, dirs, files in os.walk(directory):
        found.update(os.path.join(root, n) for n in dirs + files)
    return found


def _remove_new_entries(directory: str, before: set[str]) -> None:
    """Remove what a lazy memmap storage's allocation created under ``directory`` (its entries not in ``before``),
    files first, then the directories it made (only those, and only empty ones)."""
    made = sorted(_entries(directory) - before, key=len, reverse=True)
    for path in made:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            pass  # (something else is there now: left alone)


# --------------------------------------------------------------------------- adapter
class ReplayBufferAdapter(Adapter):
    """A torchrl replay buffer and everything it needs to sample the same batches after a restore."""

    adapter_id = "torchrl_dcp.replay_buffer"
    version = 1
    default_placement = "per_rank"
    can_reshard = True
    reshard_shares_out = True  # (the transitions: each new rank takes its part)
    allocates_when_planned = True  # an uninitialised storage is allocated from the saved shapes

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return buffer_reshard.reshard_sources(saved, ctx)

    def reshard(self, rb: ReplayBuffer, states: dict[int, Any], ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True  # (what rollback puts back from here on: the settings too)
        warn_unsaved_transforms(rb, ctx.name, "loading")  # (as a load at the saved world size warns)
        _warn_prefetch(rb, ctx.name, "loading")
        buffer_reshard.reshard_buffer(rb, states, ctx)
        return None

    def state(self, rb: ReplayBuffer, ctx: AdapterContext) -> Any:
        rb = initialized_buffer(rb)
        refuse_overfull_sampler(rb, ctx.name)
        warn_unsaved_transforms(rb, ctx.name, "saving")
        _warn_prefetch(rb, ctx.name, "saving")
        held = transform_states(rb)
        return {
            "type": type(rb).__name__,
            "storage": storage_state(rb._storage),
            "sampler": sampler_state(rb._sampler),
            "writer": writer_state(rb._writer),
            **buffer_settings(rb),
            **({"transforms": held} if held else {}),  # (buffers without n-step transforms: as before)
        }

    def row_changes(self, rb: ReplayBuffer, ctx: AdapterContext) -> dict[tuple[str, ...], Any] | None:
        storage = initialized_buffer(rb)._storage
        if not isinstance(storage, TensorStorage):
            return None
        from torchrl_dcp.tracking import track

        snap = track(storage).begin()
        data = storage._storage if storage.initialized else None
        if data is None:
            return {}
        if isinstance(data, torch.Tensor):
            return {("storage", "data"): snap}
        if not is_tensor_collection(data):  # (a pytree of tensors: its state says it cannot be saved)
            return None
        keys = data.keys(include_nested=True, leaves_only=True)
        return {("storage", "data", *((k,) if isinstance(k, str) else k)): snap for k in keys}

    def destinations(self, rb: ReplayBuffer, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        storage = initialized_buffer(rb)._storage
        scratch = getattr(storage, "scratch_dir", None) if not getattr(storage, "initialized", True) else None
        if scratch:  # an allocation writes memmap files there: what a rollback removes is what was not there before
            ctx.plan["scratch"] = (str(scratch), _entries(str(scratch)))
        return storage_destinations(storage, saved["storage"], ctx.name)

    def restore(self, rb: ReplayBuffer, state: Any, ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True  # (what rollback puts back from here on: the settings too)
        rb = initialized_buffer(rb)
        warn_unsaved_transforms(rb, ctx.name, "loading")
        _warn_prefetch(rb, ctx.name, "loading")
        items = list_items(state["storage"], ctx) if state["storage"].get("kind") == LIST_KIND else None
        other = _other_capacity_rows(rb, state)
        restore_sampler(rb._sampler, state["sampler"], ctx.name, rows=other)
        restore_writer(rb._writer, state["writer"], ctx.name)
        if items is not None:
            restore_list_storage(rb._storage, items)
        else:
            restore_storage(rb._storage, state["storage"])
        _continue_in_other_capacity(rb, state)
        restore_buffer_settings(rb, state)
        if state.get("transforms") or transform_states(rb):
            restore_transform_states(rb, state.get("transforms") or {}, ctx)
        return None

    def check_saved(self, saved: Any) -> None:
        """What every save writes (:func:`~torchrl_dcp.adapters.buffer_checks.check_saved_buffer`)."""
        check_saved_buffer(saved)

    def check_values(self, saved: Any, read: Any) -> None:
        """Indices held as tensors point inside the buffer (:func:`~torchrl_dcp.adapters.buffer_checks.check_buffer_values`)."""
        check_buffer_values(saved, read)

    def validate(self, rb: ReplayBuffer, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """The sampler's capacity must be the buffer's (checked while planning, before any row is read); after a
        world-size change, this rank's buffer must hold the transitions it receives."""
        lengths = ctx.plan.get("lengths")
        live = initialized_buffer(rb)
        sampler = live._sampler
        for state in saved.values():  # the restore's checks of kinds, made before anything is read
            _check_kinds(live, state, ctx.name)
            _check_restorable(live, state, ctx.name)
            if isinstance(state, Mapping) and state.get("transforms"):
                check_held_states(live, state["transforms"], state.get("storage"), ctx.name)
        for state in saved.values() if lengths is None else ():  # (resharding rebuilds the sampler's trees)
            saved_sampler = state.get("sampler") if isinstance(state, Mapping) else None
            if isinstance(saved_sampler, Mapping) and saved_sampler.get("kind") == "prioritized":
                capacity = saved_sampler.get("capacity")
                if _other_capacity_rows(live, state) is not None:
                    continue  # (another capacity, accepted below while nothing was overwritten)
                if hasattr(sampler, "_max_capacity") and int(sampler._max_capacity) != capacity:
                    raise IncompatibleComponentError(
                        f"component {ctx.name!r}: prioritized sampler capacity was {capacity}, the buffer's is "
                        f"{sampler._max_capacity}: build the buffer with the capacity it was saved with"
                    )
        if lengths is None:  # same world size: the destinations check the capacity
            for state in saved.values():
                if isinstance(state, Mapping):
                    _check_other_capacity(live, state, ctx.name)
            return
        buffer_reshard.check_reshard(live, saved, ctx)
        n = sum(hi - lo for _, lo, hi in buffer_reshard.split(lengths, ctx.rank, ctx.world_size))
        ctx.plan["reshard_rows"] = n  # (the rows the restore writes over: the snapshot copies them; room: checked)

    def snapshot(self, rb: ReplayBuffer, ctx: AdapterContext) -> Any:
        """The storage's own attributes, the sampler, writer, transforms, batch size and generator; the storage
        rows only where a reshard's restore writes over rows the buffer holds (the rows it receives: copied), never
        rows read in place (never copied)."""
        rb = initialized_buffer(rb)
        storage = rb._storage
        return {
            "storage": {a: getattr(storage, a, None) for a in _STORAGE_ATTRS},
            "rows": _rows_overwritten(storage, ctx.plan.get("reshard_rows")),
            "settings": copy.deepcopy(
                {"sampler": sampler_state(rb._sampler), "writer": writer_state(rb._writer), **buffer_settings(rb)}
            ),
        }

    def rollback(self, rb: ReplayBuffer, snapshot: Any, ctx: AdapterContext) -> None:
        """Put back the storage's attributes (a storage allocated by the load is dropped) and, once the restore ran,
        the settings (before it, nothing changed them: the sampler's trees stay the same objects).

        Rows already read in place keep what was read (docs/reliability.md)."""
        rb = initialized_buffer(rb)
        for attr, value in snapshot["storage"].items():
            if hasattr(rb._storage, attr) and value is not None:
                setattr(rb._storage, attr, value)
        set_cursor = getattr(rb._storage, "_set_last_cursor", None)  # (torchrl 0.14: its shared index too)
        if callable(set_cursor) and "_last_cursor" in snapshot["storage"]:
            set_cursor(snapshot["storage"]["_last_cursor"])
        if isinstance(rb._storage, TensorStorage) and not snapshot["storage"]["initialized"]:
            rb._storage._storage = snapshot["storage"]["_storage"]
            rb._storage.initialized = False
            if "scratch" in ctx.plan:  # the memmap files the allocation made (torchrl never writes over them)
                _remove_new_entries(*ctx.plan.pop("scratch"))
        rows = snapshot.get("rows")
        if rows is not None and isinstance(rb._storage, ListStorage):
            rb._storage._storage = rows
        elif rows is not None and rb._storage.initialized:
            rb._storage._storage[: len(rows)] = rows  # (the rows a reshard's restore wrote over)
        if not ctx.plan.get("restored"):
            return
        settings = snapshot["settings"]
        restore_sampler(rb._sampler, settings["sampler"], ctx.name)
        restore_writer(rb._writer, settings["writer"], ctx.name)
        restore_buffer_settings(rb, settings)


_STORAGE_ATTRS = ("_storage", "initialized", "_len", "_last_cursor")


def _rows_overwritten(storage: Any, rows: int | None) -> Any:
    """A copy of the rows a reshard's restore writes over (``rows``: how many it receives), ``None`` when it writes
    over none (a load at the same world size reads rows in place; an empty or unallocated storage holds none)."""
    if not rows:
        return None
    if isinstance(storage, ListStorage):
        return list(storage._storage)
    live = getattr(storage, "_storage", None) if getattr(storage, "initialized", False) else None
    if live is None:
        return None
    return live[: min(rows, int(live.shape[0]))].clone()


def _warn_prefetch(rb: Any, name: str, action: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` for a buffer that prefetches (``prefetch=``): batches
    drawn ahead in a thread, before the save, are not saved, and are drawn again after a restore."""
    if getattr(rb, "_prefetch_cap", 0):
        warnings.warn(
            f"component {name!r} ({action}): the replay buffer prefetches ({rb._prefetch_cap} batches drawn ahead "
            "in a thread): the batches drawn before a save are not saved and are drawn again after a restore, so "
            "samples after a restore differ from an uninterrupted run's; build the buffer without prefetch= where "
            "exact resume matters",
            InexactResumeWarning,
            stacklevel=3,
        )
