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

import heapq
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import MemoryMappedTensor, TensorDict, is_tensor_collection
from torchrl.data.replay_buffers import ReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler
from torchrl.data.replay_buffers.storages import ListStorage, TensorStorage
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.rng import derived_seed
from torchrl_dcp.errors import EncodingError, IncompatibleComponentError


def _buffer(rb: ReplayBuffer) -> ReplayBuffer:
    if not getattr(rb, "_initialized", True):
        rb._init()
    return rb


# --------------------------------------------------------------------------- storage
def _leading_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows, without copying: memmap rows are re-mapped from their file."""
    if rows == tensor.shape[0]:
        return tensor
    filename = getattr(tensor, "filename", None)
    if isinstance(tensor, MemoryMappedTensor) and filename and tensor.is_contiguous() and tensor.storage_offset() == 0:
        return MemoryMappedTensor.from_filename(filename=filename, dtype=tensor.dtype, shape=(rows, *tensor.shape[1:]))
    return tensor[:rows]


def _tensor_tree(data: Any, rows: int, where: str) -> Any:
    if isinstance(data, torch.Tensor):
        return _leading_rows(data, rows)
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
    if not isinstance(storage, TensorStorage):
        what = "ListStorage holds arbitrary Python objects" if isinstance(storage, ListStorage) else "this storage"
        raise EncodingError(
            f"{what} ({type(storage).__name__}) cannot be saved without pickle: use LazyTensorStorage or "
            "LazyMemmapStorage (both store TensorDicts and tensors)"
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


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Leaves of a nested mapping by key path (``()`` for a bare leaf)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, (*prefix, key)))
    return out


def _allocate(storage: TensorStorage, leaves: Mapping[tuple[str, ...], Any], is_tensordict: bool, ndim: int) -> None:
    """Initialise a lazy storage from saved leaves of shape ``[rows, *batch, *item]`` (``batch``: ``ndim - 1`` dims).

    torchrl's ``_init`` takes one row: a TensorDict with batch size ``batch`` whose
    leaves have shape ``[*batch, *item]`` (``leaf.shape[1:]``); with ``ndim > 1`` it
    sizes the storage to ``ceil(max_size / prod(batch))`` rows, as an ``extend`` would.
    """
    items = {k: torch.zeros(tuple(v.shape[1:]), dtype=v.dtype) for k, v in leaves.items()}
    batch = tuple(next(iter(leaves.values())).shape[1:ndim]) if leaves else ()
    storage._init(TensorDict(items, batch) if is_tensordict else items[()])


def storage_destinations(storage: TensorStorage, saved: Mapping[str, Any], name: str) -> dict[str, torch.Tensor]:
    """Allocate (or check) the live storage from the saved shapes; return row views to read into."""
    if not saved["initialized"]:
        return {}
    if not isinstance(storage, TensorStorage):
        raise IncompatibleComponentError(
            f"component {name!r}: the buffer's storage {type(storage).__name__} is not a tensor storage"
        )
    ndim, rows = saved["ndim"], saved["rows"]
    if ndim != storage.ndim:
        raise IncompatibleComponentError(f"component {name!r}: storage ndim was {ndim}, the buffer's is {storage.ndim}")
    flat = _flatten(saved["data"])
    if not storage.initialized:
        _allocate(storage, flat, saved["is_tensordict"], ndim)
    live = storage._storage
    capacity = int(live.shape[0])
    if rows > capacity:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds {rows} rows, the buffer's storage has room for {capacity}; "
            "build the buffer with a larger capacity"
        )
    out: dict[str, torch.Tensor] = {}
    for key, spec in flat.items():
        leaf = live.get(key) if key else live
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
            storage._last_cursor = saved["last_cursor"]
    elif storage.initialized:
        storage._len = 0
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()


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
    return {"kind": "state_dict", "type": type(sampler).__name__, "state": sampler.state_dict()}


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
        sampler._alpha, sampler._beta, sampler._eps = saved["alpha"], saved["beta"], saved["eps"]
        sampler._empty()
        index = torch.arange(capacity)
        sampler._sum_tree[index] = saved["sum"]
        sampler._min_tree[index] = saved["min"]
        max_priority = saved["max_priority"]
        sampler._max_priority = tuple(max_priority) if isinstance(max_priority, list) else max_priority
        if "slice" in saved:
            from torchrl.data.replay_buffers.samplers import SliceSampler

            SliceSampler.load_state_dict(sampler, saved["slice"])
        return
    sampler.load_state_dict(saved["state"])


# --------------------------------------------------------------------------- writer
def writer_state(writer: Any) -> dict[str, Any]:
    if isinstance(writer, TensorDictMaxValueWriter):
        heap = writer._current_top_values
        return {
            "kind": "max_value",
            "cursor": int(writer._cursor),
            "write_count": int(writer._write_count),
            "heap_rank": torch.tensor([float(r) for r, _ in heap], dtype=torch.float64),
            "heap_index": torch.tensor([int(i) for _, i in heap], dtype=torch.int64),
        }
    return {"kind": "state_dict", "type": type(writer).__name__, "state": writer.state_dict()}


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


def restore_buffer_settings(
    rb: ReplayBuffer, saved: Mapping[str, Any], reseed_for: tuple[int, int] | None = None
) -> None:
    """Transforms, batch size and the buffer's own generator (re-seeded for ``(rank, world)`` when resharding)."""
    transform = getattr(rb, "_transform", None)
    if saved["transform"] is not None and isinstance(transform, torch.nn.Module):
        transform.load_state_dict(saved["transform"])
    rb._batch_size = saved["batch_size"]
    generator = saved["generator"]
    if generator is None:
        return
    if getattr(rb, "_rng", None) is None:
        rb.set_rng(torch.Generator(device=generator["device"]))
    if reseed_for is None:
        rb._rng.set_state(generator["state"].cpu())
    else:
        rb._rng.manual_seed(derived_seed(generator["state"], *reseed_for))


# --------------------------------------------------------------------------- adapter
class ReplayBufferAdapter(Adapter):
    """A torchrl replay buffer and everything it needs to sample the same batches after a restore."""

    adapter_id = "torchrl_dcp.replay_buffer"
    version = 1
    default_placement = "per_rank"
    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return reshard_sources(saved, ctx)

    def reshard(self, rb: ReplayBuffer, states: dict[int, Any], ctx: AdapterContext) -> Any:
        reshard_buffer(rb, states, ctx)
        return None

    def state(self, rb: ReplayBuffer, ctx: AdapterContext) -> Any:
        rb = _buffer(rb)
        rng = getattr(rb, "_rng", None)
        transform = getattr(rb, "_transform", None)
        return {
            "type": type(rb).__name__,
            "storage": storage_state(rb._storage),
            "sampler": sampler_state(rb._sampler),
            "writer": writer_state(rb._writer),
            "transform": transform.state_dict() if isinstance(transform, torch.nn.Module) else None,
            "batch_size": rb._batch_size,
            "generator": None if rng is None else {"state": rng.get_state(), "device": str(rng.device)},
        }

    def destinations(self, rb: ReplayBuffer, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        return storage_destinations(_buffer(rb)._storage, saved["storage"], ctx.name)

    def restore(self, rb: ReplayBuffer, state: Any, ctx: AdapterContext) -> Any:
        rb = _buffer(rb)
        restore_sampler(rb._sampler, state["sampler"], ctx.name)
        restore_writer(rb._writer, state["writer"], ctx.name)
        restore_storage(rb._storage, state["storage"])
        restore_buffer_settings(rb, state)
        return None


# --------------------------------------------------------------------------- resharding
def _age_order(saved: Mapping[str, Any]) -> torch.Tensor:
    """Storage positions of a saved shard, oldest transition first."""
    n = saved["storage"]["len"]
    writer = saved["writer"]
    cursor = writer.get("cursor") if writer["kind"] == "max_value" else writer["state"].get("_cursor")
    order = torch.arange(n)
    if writer["kind"] != "max_value" and isinstance(cursor, int) and n == saved["storage"]["max_size"] and n:
        order = (order + cursor) % n
    return order


def _split(lengths: list[int], rank: int, world: int) -> list[tuple[int, int, int]]:
    """``(saved_rank, lo, hi)`` slices of the saved shards (in age order) that new ``rank`` receives."""
    total = sum(lengths)
    start, end = rank * total // world, (rank + 1) * total // world
    out, offset = [], 0
    for src, n in enumerate(lengths):
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            out.append((src, lo - offset, hi - offset))
        offset += n
    return out


def _map_tree(tree: Any, fn: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_tree(v, fn) for k, v in tree.items()}
    return fn(tree)


def _cat_trees(trees: list[Any]) -> Any:
    first = trees[0]
    if isinstance(first, Mapping):
        return {k: _cat_trees([t[k] for t in trees]) for k in first}
    return torch.cat(trees)


def reshard_sources(saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
    """Saved shards new rank ``ctx.rank`` takes transitions from (see :func:`reshard_buffer`)."""
    for r, state in saved.items():
        if state["storage"]["initialized"] and state["storage"]["ndim"] != 1:
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: storages with ndim > 1 cannot be resharded (saved rank {r})"
            )
    lengths = [saved[r]["storage"]["len"] for r in range(len(saved))]
    ctx.plan["lengths"] = lengths
    sources = [src for src, _, _ in _split(lengths, ctx.rank, ctx.world_size)]
    return sources or [ctx.rank % len(saved)]  # nothing to receive: still take transforms/config from one


def reshard_buffer(rb: ReplayBuffer, states: dict[int, Any], ctx: AdapterContext) -> None:
    """Fill ``rb`` with this rank's part of the saved shards (their transitions, priorities, heap ranks).

    The saved shards are concatenated in rank order, each oldest-first, and cut into
    ``world_size`` contiguous, nearly equal parts: new rank ``r`` receives part ``r``.
    Every transition lands on exactly one rank with its priority (sum/min-tree
    leaves) and, for a max-value writer, its rank in the heap. Samplers without
    replacement start a new epoch; a buffer's own generator is re-seeded from the
    saved one and the new rank.
    """
    rb = _buffer(rb)
    lengths = ctx.plan["lengths"]
    pieces = _split(lengths, ctx.rank, ctx.world_size)
    storage, sampler, writer = rb._storage, rb._sampler, rb._writer
    datas, sums, mins, heap = [], [], [], []
    offset = 0
    for src, lo, hi in pieces:
        state = states[src]
        positions = _age_order(state)[lo:hi]
        datas.append(_map_tree(state["storage"]["data"], lambda t, p=positions: t[p]))
        if state["sampler"]["kind"] == "prioritized":
            sums.append(state["sampler"]["sum"][positions])
            mins.append(state["sampler"]["min"][positions])
        if state["writer"]["kind"] == "max_value":
            new_pos = {int(p): offset + i for i, p in enumerate(positions.tolist())}
            for rank_value, index in zip(state["writer"]["heap_rank"].tolist(), state["writer"]["heap_index"].tolist()):
                if index in new_pos:
                    heap.append((rank_value, new_pos[index]))
        offset += hi - lo
    n = offset
    any_state = states[min(states)]
    if n:
        data = _cat_trees(datas)
        flat_specs = _flatten(data)
        if not storage.initialized:
            _allocate(storage, flat_specs, isinstance(data, Mapping), 1)
        live = storage._storage
        capacity = int(live.shape[0])
        if n > capacity:
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: rank {ctx.rank} receives {n} transitions after resharding, its buffer "
                f"holds {capacity}; build the buffers with a capacity of at least {n}"
            )
        for key, tensor in flat_specs.items():
            (live.get(key) if key else live)[:n].copy_(tensor)
        storage._len = n
        storage.initialized = True
    elif storage.initialized:
        storage._len = 0
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()
    capacity = int(storage.max_size)
    if isinstance(writer, TensorDictMaxValueWriter):
        writer._cursor = n % capacity
        writer._write_count = n
        heapq.heapify(heap)
        writer._current_top_values = heap
    elif hasattr(writer, "_cursor"):
        writer._cursor = n % capacity
        writer._write_count = n
    if isinstance(sampler, PrioritizedSampler):
        sampler._empty()
        if n and sums:
            index = torch.arange(n)
            sampler._sum_tree[index] = torch.cat(sums)
            sampler._min_tree[index] = torch.cat(mins)
        if sampler._max_priority_within_buffer:
            sampler._recompute_max_priority_from_tree()
        else:
            values = [s["sampler"]["max_priority"][0] for s in states.values() if s["sampler"]["kind"] == "prioritized"]
            values = [torch.as_tensor(v) for v in values if v is not None]
            sampler._max_priority = (torch.stack(values).max(), None) if values else (None, None)
    elif hasattr(sampler, "_empty"):
        sampler._empty()
    restore_buffer_settings(rb, any_state, reseed_for=(ctx.rank, ctx.world_size))
