"""What every save of a replay buffer writes, checked on a saved state: counts, cursors, settings, the tensors its
sampler and writer own, and (on the values read) the indices it holds as tensors.

:func:`check_saved_buffer` runs on a state with :class:`~torchrl_dcp.format.codec.TensorSpec` leaves (a load while
planning, ``verify``); :func:`check_buffer_values` on the values of the few tensors it asks for, before anything is
restored. Both raise ``ValueError`` saying what no save writes.

Example:
    >>> row_capacity({"max_size": 20, "ndim": 1})
    20
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchrl_dcp.adapters.list_storage import LIST_KIND, check_list_entries
from torchrl_dcp.adapters.state_kinds import integral_dtype
from torchrl_dcp.format.codec import TensorSpec


def check_saved_buffer(saved: Any) -> None:
    """What every save writes: a tensor storage of one batch dimension holds ``len == rows <= max_size``
    transitions, ``rows`` in each tensor, an uninitialised one none; a round-robin or max-value writer's cursor
    lies in its rows, its write count is ``>= 0``; the settings are of their kinds; the sampler's and writer's
    tensors are their own; a prioritized sampler's trees have ``capacity`` leaves."""
    check_structure(saved)
    storage, sampler = saved["storage"], saved["sampler"]
    _check_saved_storage(storage)
    if storage.get("kind") == LIST_KIND:
        check_list_entries(storage)
    _check_saved_writer(saved.get("writer"), storage)
    _check_settings(saved)
    _check_own_tensors(saved, storage)
    _check_sample_list(sampler, storage)
    if isinstance(sampler, Mapping) and sampler.get("kind") == "prioritized":
        capacity = sampler.get("capacity")
        for tree in ("sum", "min"):
            shape = getattr(sampler.get(tree), "shape", None)
            if shape is not None and tuple(shape) != (capacity,):
                raise ValueError(f"its prioritized sampler says capacity {capacity!r}, its {tree} tree {list(shape)}")


def _tensor(value: Any) -> bool:
    return isinstance(value, (TensorSpec, torch.Tensor))  # (a spec while planning; the tensor once read)


#: the entries a restore reads from every saved buffer state, and what each must be (``None``: present, any value)
_REQUIRED: dict[str, Any] = {
    "storage": Mapping,
    "sampler": Mapping,
    "writer": Mapping,
    "transform": (type(None), Mapping),
    "batch_size": None,
    "generator": (type(None), Mapping),
}
_PRIORITIZED = ("alpha", "beta", "eps", "max_priority", "capacity", "sum", "min")


def check_structure(saved: Any) -> None:
    """Every entry the restore reads is there, of the kind every save writes: the storage, sampler, writer,
    transform, batch size and generator; the sampler's and writer's kinds and the entries of each kind (a prioritized
    sampler's settings and trees, a max-value writer's cursor, count and heap, another's ``state``). Checked while
    planning (and by ``verify``): a state missing one failed the restore after other components' tensors were read
    in place."""
    if not isinstance(saved, Mapping):
        raise ValueError("its state is not a mapping")
    for key, kind in _REQUIRED.items():
        if key not in saved:
            raise ValueError(f"its state holds no {key!r}, which every save writes")
        if kind is not None and not isinstance(saved[key], kind):
            raise ValueError(f"its {key!r} is a {type(saved[key]).__name__}, not what a save writes")
    generator = saved["generator"]
    if generator is not None and not (isinstance(generator.get("device"), str) and _tensor(generator.get("state"))):
        raise ValueError("its generator is not a device and a state tensor")
    storage, sampler, writer = saved["storage"], saved["sampler"], saved["writer"]
    if type(storage.get("initialized")) is not bool or (storage["initialized"] and type(storage.get("len")) is not int):
        raise ValueError(f"its storage says initialized {storage.get('initialized')!r}, len {storage.get('len')!r}")
    _check_sampler_structure(sampler)
    if writer.get("kind") == "max_value":
        if not all(_tensor(writer.get(k)) for k in ("heap_rank", "heap_index")) or not all(
            k in writer for k in ("cursor", "write_count")
        ):
            raise ValueError("its max-value writer holds no cursor, write count and heap")
    elif not isinstance(writer.get("type"), str) or not isinstance(writer.get("state"), Mapping):
        raise ValueError("its writer's type and state are not a name and a mapping")


def _check_sampler_structure(sampler: Mapping[str, Any]) -> None:
    if not isinstance(sampler.get("type"), str) or sampler.get("kind") not in ("prioritized", "state_dict"):
        raise ValueError(f"its sampler's type and kind are {sampler.get('type')!r} and {sampler.get('kind')!r}")
    if sampler["kind"] == "prioritized":
        missing = [k for k in _PRIORITIZED if k not in sampler]
        if missing:
            raise ValueError(f"its prioritized sampler holds no {missing}")
        if type(sampler["capacity"]) is not int or not (_tensor(sampler["sum"]) and _tensor(sampler["min"])):
            raise ValueError("its prioritized sampler's capacity is not an integer, or a tree not a tensor")
        if not isinstance(sampler.get("slice", {}), Mapping):
            raise ValueError("its prioritized slice sampler's state is not a mapping")
    elif not isinstance(sampler.get("state"), Mapping) or not isinstance(sampler.get("extra", {}), Mapping):
        raise ValueError("its sampler's state is not a mapping")


#: keys torchrl's writers put in their ``state_dict`` only once used (a generation-tracking writer's stamps, after
#: its first write): a state saved before holds none, and the live object's may
KEYS_ONCE_USED = frozenset({"_generation"})


def check_live_keys(saved: Any, live: Any, what: str) -> None:
    """A saved ``state_dict`` holds every key the live object's does (what its ``load_state_dict`` reads: a writer's
    ``_cursor``, a sampler's ``len_storage``), but for :data:`KEYS_ONCE_USED`, else ``ValueError``; checked while
    planning, before anything is read."""
    if isinstance(saved, Mapping) and isinstance(live, Mapping):
        missing = sorted(str(k) for k in live.keys() - saved.keys() - KEYS_ONCE_USED)
        if missing:
            raise ValueError(f"its {what} holds no {missing}, which this buffer's {what} has")


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


def _check_saved_writer(writer: Any, storage: Mapping[str, Any]) -> None:
    """A saved round-robin or max-value writer's cursor is an int in ``[0, rows)`` (the storage's rows:
    :func:`row_capacity`), the storage's length while the storage was never full, and its write count an int
    ``>= 0``; a max-value writer's heap holds as many ranks as rows: what every save writes (a cursor outside the
    storage would write past its rows; one past the length would make unwritten rows part of the buffer at the next
    write)."""
    counts = writer_counts(writer)
    if counts is None:
        return
    cursor, write_count = counts
    rows = row_capacity(storage)  # (a list storage: its max_size)
    max_size, n = storage.get("max_size"), storage.get("len")
    if type(cursor) is not int or cursor < 0 or (rows is not None and cursor >= rows):
        raise ValueError(f"its writer's cursor is {cursor!r}, its storage's rows {rows!r} (max_size {max_size!r})")
    one_dim = storage.get("ndim") == 1 and storage.get("kind") != LIST_KIND
    if one_dim and type(n) is int and type(max_size) is int and n < max_size and cursor != n:
        where = "past" if cursor > n else "inside"  # (inside: the next write overwrites rows, and counts new ones)
        raise ValueError(
            f"its writer's cursor is {cursor}, {where} the {n} rows of a storage that was never full (max_size "
            f"{max_size}): a writer that never filled its storage is at its end"
        )
    if type(write_count) is not int or write_count < 0:
        raise ValueError(f"its writer's write count is {write_count!r}")
    if write_count > write_count_limit():
        raise ValueError(
            f"its writer's write count is {write_count}, more than torchrl's writers hold ({write_count_limit()}): "
            "restored, it would silently become another number"
        )
    if writer.get("kind") == "max_value":
        shapes = [tuple(getattr(writer.get(k), "shape", ())) for k in ("heap_rank", "heap_index")]
        if len(shapes[0]) != 1 or shapes[0] != shapes[1]:
            raise ValueError(f"its max-value writer's heap holds ranks of shape {shapes[0]}, rows of {shapes[1]}")


@functools.cache
def write_count_limit() -> int:
    """The largest write count torchrl's writers hold: they keep it in a ``multiprocessing.Value`` of a C ``int``
    (torchrl 0.14: ``2**31 - 1``), which wraps what does not fit (``2**62`` becomes 0) instead of raising.

    Example:
        >>> write_count_limit() >= 2**31 - 1
        True
    """
    from torchrl.data.replay_buffers.writers import RoundRobinWriter

    probe = RoundRobinWriter()
    probe._write_count = 2**63 - 1  # (a future torchrl may hold a 64-bit count)
    return 2**63 - 1 if probe._write_count == 2**63 - 1 else 2**31 - 1


def _epoch(sampler: Any) -> Mapping[str, Any] | None:
    """The saved state of a sampler without replacement (``SamplerWithoutReplacement`` and the slice one): its epoch's
    remaining permutation ``_sample_list`` and the length it was drawn for ``len_storage``; ``None`` for others."""
    if not isinstance(sampler, Mapping) or sampler.get("kind") != "state_dict":
        return None
    state = sampler.get("state")
    return state if isinstance(state, Mapping) and "_sample_list" in state else None


def _check_sample_list(sampler: Any, storage: Mapping[str, Any]) -> None:
    """A sampler without replacement draws a permutation of ``len_storage`` indices (an int ``>= 0``, at most the
    storage's length: a storage never shrinks) and hands it out from the front: what is left is ``None`` or a
    one-dimensional integer tensor of at most ``len_storage`` indices; its flags are booleans."""
    state = _epoch(sampler)
    if state is None:
        return
    n, left = state.get("len_storage"), state.get("_sample_list")
    stored = storage.get("len")
    if type(n) is not int or n < 0 or (type(stored) is int and storage.get("ndim") == 1 and n > stored):
        raise ValueError(f"its sampler drew its epoch for len_storage {n!r}, its storage holds {stored!r}")
    if left is not None:
        tensor = isinstance(left, (TensorSpec, torch.Tensor))  # (a spec while planning; the tensor once restored)
        if not tensor or len(left.shape) != 1 or not integral_dtype(left.dtype):
            what = f"a {left.dtype} tensor of shape {list(left.shape)}" if tensor else repr(left)
            raise ValueError(f"its sampler's remaining epoch is {what}, not a list of indices")
        if left.shape[0] > n:
            raise ValueError(f"its sampler's remaining epoch holds {left.shape[0]} indices of {n}")
    for flag in ("drop_last", "_ran_out"):
        if flag in state and type(state[flag]) is not bool:
            raise ValueError(f"its sampler's {flag} is {state[flag]!r}")


def _check_sample_list_values(sampler: Any, read: Any) -> None:
    """A sampler without replacement's remaining epoch: distinct indices in ``0..len_storage - 1``."""
    epoch = _epoch(sampler)
    if epoch is None or epoch.get("_sample_list") is None:
        return
    left, n = _read(epoch["_sample_list"], read), epoch.get("len_storage")
    if not isinstance(left, torch.Tensor):
        return
    values = left.reshape(-1)
    outside = values[(values < 0) | (values >= n)]
    if outside.numel():
        raise ValueError(f"its sampler's remaining epoch holds index {outside[0].item()}, outside 0..{n - 1}")
    if values.unique().numel() != values.numel():
        raise ValueError("its sampler's remaining epoch holds an index twice (a permutation never does)")


def _check_settings(saved: Mapping[str, Any]) -> None:
    """The buffer's batch size (``None`` or an int >= 1), a prioritized sampler's ``alpha``, ``beta`` and ``eps``
    (finite numbers >= 0, as torchrl's setters demand) and the writer's kind: what every save writes."""
    batch = saved.get("batch_size")
    if isinstance(batch, (TensorSpec, torch.Tensor)):  # (a tensor batch size, torchrl samples with it)
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
    max-priority index within its capacity (the sampler, writer and storage would write there), a sampler without
    replacement's remaining epoch distinct indices below its ``len_storage``.
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
    _check_sample_list_values(sampler, read)
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


def writer_counts(writer: Any) -> tuple[Any, Any] | None:
    """``(cursor, write count)`` of a saved round-robin or max-value writer (``None``: a writer without them)."""
    if not isinstance(writer, Mapping):
        return None
    if writer.get("kind") == "max_value":
        return writer.get("cursor"), writer.get("write_count")
    state = writer.get("state")
    if isinstance(state, Mapping) and "_cursor" in state:
        return state.get("_cursor"), state.get("_write_count")
    return None


def _indices_within(index: Any, size: int) -> bool:
    """Whether ``index`` (an int, or a tensor of integers) indexes a dimension of ``size`` (negative ones from the
    end, as Python's)."""
    if isinstance(index, torch.Tensor) and not index.dtype.is_floating_point and not index.dtype.is_complex:
        values = index.reshape(-1).tolist()
    else:
        values = [index]
    return all(type(v) is int and -size <= v < size for v in values)


def _read(value: Any, read: Any) -> Any:
    return read(value) if isinstance(value, TensorSpec) else value


def _all_specs(node: Any) -> list[TensorSpec]:
    """Every tensor spec in a saved value (mappings, lists and tuples walked)."""
    if isinstance(node, TensorSpec):
        return [node]
    if isinstance(node, Mapping):
        return [s for v in node.values() for s in _all_specs(v)]
    if isinstance(node, (list, tuple)):
        return [s for v in node for s in _all_specs(v)]
    return []


def _specs(node: Any) -> list[Any]:
    """The tensor specs in a storage's saved ``data`` (a spec, or nested mappings of them)."""
    if isinstance(node, Mapping):
        return [s for v in node.values() for s in _specs(v)]
    return [node] if hasattr(node, "shape") else []


def _number(value: Any) -> bool:
    """A finite real number (NumPy's too), or a tensor (its value unknown while planning)."""
    if isinstance(value, TensorSpec):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def refuse_overfull_sampler(rb: Any, name: str) -> None:
    """Refuse to save a buffer whose prioritized sampler has fewer slots (``max_capacity``) than the rows written:
    torchrl writes the priorities of the rows past them outside the sampler's sum tree (memory it does not own,
    unchecked), so no save can hold them, and a load refused the max-priority index it records as forged."""
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler

    from torchrl_dcp.errors import EncodingError

    sampler, storage = rb._sampler, rb._storage
    capacity = getattr(sampler, "_max_capacity", None)
    if not isinstance(sampler, PrioritizedSampler) or type(capacity) is not int:
        return
    rows = len(storage)
    if rows > capacity:
        raise EncodingError(
            f"component {name!r}: its {type(sampler).__name__} has max_capacity={capacity} but the buffer holds "
            f"{rows} rows (its storage up to {storage.max_size}): torchrl writes the priorities of the rows past "
            f"{capacity} outside the sampler's sum tree, where no save can read them back; build the sampler with "
            f"max_capacity of at least the storage's max_size ({storage.max_size})"
        )
