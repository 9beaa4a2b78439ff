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
import math
import numbers
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
from torchrl_dcp.errors import EncodingError, IncompatibleComponentError
from torchrl_dcp.format.codec import TensorSpec


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
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()


def _indices_within(index: Any, size: int) -> bool:
    """Whether ``index`` (an int, or a tensor of integers) indexes a dimension of ``size`` (negative ones from the
    end, as Python's)."""
    if isinstance(index, torch.Tensor) and not index.dtype.is_floating_point and not index.dtype.is_complex:
        values = index.reshape(-1).tolist()
    else:
        values = [index]
    return all(type(v) is int and -size <= v < size for v in values)


def row_capacity(storage: Mapping[str, Any]) -> int | None:
    """How many rows (along dim 0) a saved tensor storage holds at most: ``max_size`` counts every element, so a
    storage of ``ndim`` 2 holds ``max_size`` over the size of its second dimension (``None``: no integer
    ``max_size``). What its cursors index."""
    max_size, ndim = storage.get("max_size"), storage.get("ndim", 1)
    if type(max_size) is not int:
        return None
    specs = _specs(storage.get("data"))
    if type(ndim) is not int or ndim <= 1 or not specs or len(specs[0].shape) < ndim:
        return max(max_size, 1)
    inner = math.prod(specs[0].shape[1:ndim])
    return max(-(-max_size // inner), 1) if inner else max(max_size, 1)  # (rounded up, as torchrl's rows)


def check_buffer_values(saved: Mapping[str, Any], read: Any) -> None:
    """Indices a saved buffer holds as tensors point inside it, as every write leaves them: the storage's last
    cursor within its rows (a mask aside), a max-value writer's heap within them, a prioritized sampler's
    max-priority index within its capacity (the sampler, writer and storage would write there).
    ``read(spec)``: a tensor's value."""
    storage, sampler, writer = saved.get("storage"), saved.get("sampler"), saved.get("writer")
    rows = row_capacity(storage) if isinstance(storage, Mapping) and storage.get("kind") != LIST_KIND else None
    if rows is not None and storage.get("initialized") is True:
        last = _read(storage.get("last_cursor"), read)
        if last is not None and not (isinstance(last, torch.Tensor) and last.dtype == torch.bool):
            if not _indices_within(last, rows):
                raise ValueError(f"its storage's last cursor is {last!r}, outside its {rows} rows")
    if rows is not None and isinstance(writer, Mapping) and writer.get("kind") == "max_value":
        heap = _read(writer.get("heap_index"), read)
        if isinstance(heap, torch.Tensor) and heap.numel() and not _indices_within(heap, rows):
            raise ValueError(f"its max-value writer's heap holds row {heap.max().item()}, past its {rows} rows")
    if not (isinstance(sampler, Mapping) and sampler.get("kind") == "prioritized"):
        return
    max_priority, capacity = sampler.get("max_priority"), sampler.get("capacity")
    if max_priority is None or type(capacity) is not int:
        return
    if not isinstance(max_priority, (tuple, list)) or len(max_priority) != 2:
        raise ValueError(f"its prioritized sampler's max_priority is a {type(max_priority).__name__}, not a pair")
    index = max_priority[1]
    parts = list(index) if isinstance(index, (tuple, list)) else [index]
    if parts == [None]:
        return
    for part in parts:
        if not _indices_within(_read(part, read), capacity):
            raise ValueError(
                f"its prioritized sampler's max_priority index is {_read(part, read)!r}, outside its capacity of "
                f"{capacity}"
            )


def _read(value: Any, read: Any) -> Any:
    return read(value) if isinstance(value, TensorSpec) else value


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


def restore_sampler(sampler: Any, saved: Mapping[str, Any], name: str) -> None:
    if type(sampler).__name__ != saved["type"]:
        raise IncompatibleComponentError(
            f"component {name!r}: sampler was {saved['type']}, the buffer has {type(sampler).__name__}"
        )
    if saved["kind"] == "prioritized":
        capacity = saved["capacity"]
        if int(sampler._max_capacity) != capacity:
            raise IncompatibleComponentError(
                f"component {name!r}: prioritized sampler capacity was {capacity}, the buffer's is {sampler._max_capacity}"
            )
        max_priority = saved["max_priority"]  # (its index checked with the values read: check_values)
        sampler._alpha, sampler._beta, sampler._eps = saved["alpha"], saved["beta"], saved["eps"]
        sampler._empty()
        index = torch.arange(capacity)
        sampler._sum_tree[index] = saved["sum"]
        sampler._min_tree[index] = saved["min"]
        sampler._max_priority = tuple(max_priority) if isinstance(max_priority, list) else max_priority
        if "slice" in saved:
            from torchrl.data.replay_buffers.samplers import SliceSampler

            SliceSampler.load_state_dict(sampler, saved["slice"])
        return
    sampler.load_state_dict(saved["state"])
    for attr, value in saved.get("extra", {}).items():
        if attr in SAMPLER_EXTRA_ATTRIBUTES:
            setattr(sampler, attr, value)


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


def _writer_counts(writer: Any) -> tuple[Any, Any] | None:
    """``(cursor, write count)`` of a saved round-robin or max-value writer (``None``: a writer without them)."""
    if not isinstance(writer, Mapping):
        return None
    if writer.get("kind") == "max_value":
        return writer.get("cursor"), writer.get("write_count")
    state = writer.get("state")
    if isinstance(state, Mapping) and "_cursor" in state:
        return state.get("_cursor"), state.get("_write_count")
    return None


def _check_other_capacity(rb: ReplayBuffer, state: Mapping[str, Any], name: str) -> None:
    """Same world size, a buffer of another capacity than saved: exact only while no saved transition was
    overwritten (the buffer then continues as one of the new capacity would after the same writes); a buffer that
    wrapped around lost its oldest transitions to its capacity, which a larger (or smaller) one would have kept."""
    saved_storage = state.get("storage")
    counts = _writer_counts(state.get("writer"))
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


def _continue_in_other_capacity(rb: ReplayBuffer, state: Mapping[str, Any]) -> None:
    """After :func:`_check_other_capacity` accepted another capacity: the writer's cursor after the saved rows."""
    storage = rb._storage
    counts = _writer_counts(state["writer"])
    if counts is None or int(storage.max_size) == state["storage"]["max_size"] or state["storage"].get("ndim", 1) != 1:
        return
    rb._writer._cursor = state["storage"]["len"] % int(storage.max_size)


# --------------------------------------------------------------------------- adapter
class ReplayBufferAdapter(Adapter):
    """A torchrl replay buffer and everything it needs to sample the same batches after a restore."""

    adapter_id = "torchrl_dcp.replay_buffer"
    version = 1
    default_placement = "per_rank"
    can_reshard = True
    allocates_when_planned = True  # an uninitialised storage is allocated from the saved shapes

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return buffer_reshard.reshard_sources(saved, ctx)

    def reshard(self, rb: ReplayBuffer, states: dict[int, Any], ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True  # (what rollback puts back from here on: the settings too)
        buffer_reshard.reshard_buffer(rb, states, ctx)
        return None

    def state(self, rb: ReplayBuffer, ctx: AdapterContext) -> Any:
        rb = initialized_buffer(rb)
        warn_unsaved_transforms(rb, ctx.name, "saving")
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
        return storage_destinations(initialized_buffer(rb)._storage, saved["storage"], ctx.name)

    def restore(self, rb: ReplayBuffer, state: Any, ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True  # (what rollback puts back from here on: the settings too)
        rb = initialized_buffer(rb)
        warn_unsaved_transforms(rb, ctx.name, "loading")
        items = list_items(state["storage"], ctx) if state["storage"].get("kind") == LIST_KIND else None
        restore_sampler(rb._sampler, state["sampler"], ctx.name)
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
        """What every save writes: a tensor storage of one batch dimension holds ``len == rows <= max_size``
        transitions, ``rows`` in each tensor, an uninitialised one none; a round-robin or max-value writer's cursor
        lies in its rows, its write count is ``>= 0``; the settings are of their kinds; the sampler's and writer's
        tensors are their own; a prioritized sampler's trees have ``capacity`` leaves."""
        storage, sampler = saved["storage"], saved["sampler"]
        if not isinstance(storage, Mapping):
            raise ValueError("its storage state is not a mapping")
        _check_saved_storage(storage)
        _check_saved_writer(saved.get("writer"), storage)
        _check_settings(saved)
        _check_own_tensors(saved, storage)
        if isinstance(sampler, Mapping) and sampler.get("kind") == "prioritized":
            capacity = sampler.get("capacity")
            for tree in ("sum", "min"):
                shape = getattr(sampler.get(tree), "shape", None)
                if shape is not None and tuple(shape) != (capacity,):
                    raise ValueError(
                        f"its prioritized sampler says capacity {capacity!r}, its {tree} tree {list(shape)}"
                    )

    def check_values(self, saved: Any, read: Any) -> None:
        """Indices held as tensors point inside the buffer (:func:`check_buffer_values`)."""
        check_buffer_values(saved, read)

    def validate(self, rb: ReplayBuffer, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """The sampler's capacity must be the buffer's (checked while planning, before any row is read); after a
        world-size change, this rank's buffer must hold the transitions it receives."""
        lengths = ctx.plan.get("lengths")
        live = initialized_buffer(rb)
        sampler = live._sampler
        for state in saved.values():  # the restore's checks of kinds, made before anything is read
            _check_kinds(live, state, ctx.name)
        for state in saved.values() if lengths is None else ():  # (resharding rebuilds the sampler's trees)
            saved_sampler = state.get("sampler") if isinstance(state, Mapping) else None
            if isinstance(saved_sampler, Mapping) and saved_sampler.get("kind") == "prioritized":
                capacity = saved_sampler.get("capacity")
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
        capacity = int(initialized_buffer(rb)._storage.max_size)
        if n > capacity:
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: rank {ctx.rank} receives {n} transitions after resharding, its buffer "
                f"holds {capacity}; build the buffers with a capacity of at least {n}"
            )

    def snapshot(self, rb: ReplayBuffer, ctx: AdapterContext) -> Any:
        """Everything but the storage rows (read in place, never copied): the storage's own attributes, the
        sampler, writer, transforms, batch size and generator."""
        rb = initialized_buffer(rb)
        storage = rb._storage
        return {
            "storage": {a: getattr(storage, a, None) for a in _STORAGE_ATTRS},
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
        if isinstance(rb._storage, TensorStorage) and not snapshot["storage"]["initialized"]:
            rb._storage._storage = snapshot["storage"]["_storage"]
            rb._storage.initialized = False
        if not ctx.plan.get("restored"):
            return
        settings = snapshot["settings"]
        restore_sampler(rb._sampler, settings["sampler"], ctx.name)
        restore_writer(rb._writer, settings["writer"], ctx.name)
        restore_buffer_settings(rb, settings)


_STORAGE_ATTRS = ("_storage", "initialized", "_len", "_last_cursor")


def _check_saved_writer(writer: Any, storage: Mapping[str, Any]) -> None:
    """A saved round-robin or max-value writer's cursor is an int in ``[0, rows)`` (the storage's rows:
    :func:`row_capacity`), at most the storage's length while the storage was never full, and its write count an int
    ``>= 0``; a max-value writer's heap holds as many ranks as rows: what every save writes (a cursor outside the
    storage would write past its rows; one past the length would make unwritten rows part of the buffer at the next
    write)."""
    counts = _writer_counts(writer)
    if counts is None:
        return
    cursor, write_count = counts
    rows = row_capacity(storage)  # (a list storage: its max_size)
    max_size, n = storage.get("max_size"), storage.get("len")
    if type(cursor) is not int or cursor < 0 or (rows is not None and cursor >= rows):
        raise ValueError(f"its writer's cursor is {cursor!r}, its storage's rows {rows!r} (max_size {max_size!r})")
    one_dim = storage.get("ndim") == 1 and storage.get("kind") != LIST_KIND
    if one_dim and type(n) is int and type(max_size) is int and n < max_size and cursor > n:
        raise ValueError(
            f"its writer's cursor is {cursor}, past the {n} rows of a storage that was never full (max_size {max_size})"
        )
    if type(write_count) is not int or write_count < 0:
        raise ValueError(f"its writer's write count is {write_count!r}")
    if writer.get("kind") == "max_value":
        shapes = [tuple(getattr(writer.get(k), "shape", ())) for k in ("heap_rank", "heap_index")]
        if len(shapes[0]) != 1 or shapes[0] != shapes[1]:
            raise ValueError(f"its max-value writer's heap holds ranks of shape {shapes[0]}, rows of {shapes[1]}")


def _check_saved_storage(storage: Mapping[str, Any]) -> None:
    """Counts of a saved storage: integers; ``len == rows <= max_size`` for one batch dimension, each tensor
    holding ``rows``; an uninitialised tensor storage saved without rows."""
    counts = [storage.get(k) for k in ("len", "rows", "max_size")]
    initialized = storage.get("initialized")
    if storage.get("kind") != LIST_KIND and initialized is not True:  # (uninitialised: saved without rows)
        if initialized is not False or storage.get("len") != 0 or "data" in storage or "rows" in storage:
            raise ValueError(f"its storage says initialized {initialized!r}, len {storage.get('len')!r}")
    for key in ("len", "rows", "max_size", "ndim"):  # what every save writes as an int (a float here disarms the
        if key in storage and type(storage[key]) is not int:  # checks below)
            raise ValueError(f"its storage's {key} is {storage[key]!r}, not an integer")
    if storage.get("ndim") == 1 and all(type(c) is int for c in counts):  # (ndim > 1: len counts elements)
        n, rows, max_size = counts
        if not 0 <= n == rows <= max_size:  # (a save writes the filled rows: rows == len)
            raise ValueError(f"its storage says len {n}, rows {rows}, max_size {max_size}")
        for spec in _specs(storage.get("data")):
            if not spec.shape or spec.shape[0] != rows:
                raise ValueError(f"its storage says {rows} rows, a tensor holds {list(spec.shape)}")


def _check_own_tensors(saved: Mapping[str, Any], storage: Mapping[str, Any]) -> None:
    """The sampler's, the writer's and the last cursor's tensors are their own, never one of the storage's rows
    (read in place after the values are checked)."""
    rows_keys = {spec.key for spec in _specs(storage.get("data")) if isinstance(spec, TensorSpec)}
    for what in ("sampler", "writer"):
        shared = sorted(rows_keys & {spec.key for spec in _all_specs(saved.get(what))})
        if shared:
            raise ValueError(f"its {what} holds the storage's tensor {shared[0]!r}")
    last = storage.get("last_cursor")
    if isinstance(last, TensorSpec) and last.key in rows_keys:
        raise ValueError(f"its storage's last cursor is the storage's tensor {last.key!r}")


def _all_specs(node: Any) -> list[TensorSpec]:
    """Every tensor spec in a saved value (mappings, lists and tuples walked)."""
    if isinstance(node, TensorSpec):
        return [node]
    if isinstance(node, Mapping):
        return [s for v in node.values() for s in _all_specs(v)]
    if isinstance(node, (list, tuple)):
        return [s for v in node for s in _all_specs(v)]
    return []


def _number(value: Any) -> bool:
    """A finite real number (NumPy's too), or a tensor (its value unknown while planning)."""
    if isinstance(value, TensorSpec):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_settings(saved: Mapping[str, Any]) -> None:
    """The buffer's batch size (``None`` or an int >= 1), a prioritized sampler's ``alpha``, ``beta`` and ``eps``
    (finite numbers >= 0, as torchrl's setters demand) and the writer's kind: what every save writes."""
    batch = saved.get("batch_size")
    if isinstance(batch, TensorSpec):  # (a tensor batch size, torchrl samples with it: its value unknown here)
        if batch.shape or batch.dtype.is_floating_point or batch.dtype.is_complex:
            raise ValueError(f"its batch size is a {batch.dtype} tensor of shape {list(batch.shape)}")
    elif batch is not None and (not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"its batch size is {batch!r}")
    sampler, writer = saved.get("sampler"), saved.get("writer")
    if isinstance(sampler, Mapping) and sampler.get("kind") == "prioritized":
        for key in ("alpha", "beta", "eps"):
            value = sampler.get(key)
            if not _number(value) or (not isinstance(value, TensorSpec) and value < 0):
                raise ValueError(f"its prioritized sampler's {key} is {sampler.get(key)!r}")
    if isinstance(writer, Mapping) and writer.get("kind") not in ("max_value", "state_dict"):
        raise ValueError(f"its writer's kind is {writer.get('kind')!r}")


def _specs(node: Any) -> list[Any]:
    """The tensor specs in a storage's saved ``data`` (a spec, or nested mappings of them)."""
    if isinstance(node, Mapping):
        return [s for v in node.values() for s in _specs(v)]
    return [node] if hasattr(node, "shape") else []
