"""Replay buffers after a world-size change: the saved shards' transitions redistributed over the new ranks.

The saved shards are concatenated in rank order, each oldest first, and cut into
``world_size`` contiguous, nearly equal parts (:func:`split`); new rank ``r`` takes part
``r`` with the transitions' priorities (sum/min-tree leaves), max-value heap ranks and, for a
``ConsumingSampler``, how often each was sampled (consumed transitions stay consumed).

Example:
    >>> from torchrl_dcp.adapters.buffer_reshard import split
    >>> split([5, 3], rank=1, world=2)  # 8 transitions over 2 ranks: rank 1 gets saved rank 1's 3 and rank 0's last 1
    [(0, 4, 5), (1, 0, 3)]
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import is_tensor_collection
from torchrl.data.replay_buffers import ReplayBuffer
from torchrl.data.replay_buffers.samplers import (
    ConsumingSampler,
    PrioritizedSampler,
    SliceSampler,
    StalenessAwareSampler,
)
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.buffer_state import (
    allocate,
    check_no_other_entries,
    flatten,
    initialized_buffer,
    live_leaf,
    restore_buffer_settings,
)
from torchrl_dcp.adapters.buffer_transforms import check_transform_layout, held_back_counts, restore_transform_states
from torchrl_dcp.adapters.list_storage import LIST_KIND, is_list_storage, list_items, restore_list_storage
from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning


def _age_order(saved: Mapping[str, Any]) -> torch.Tensor:
    """Storage positions of a saved shard, oldest transition first."""
    n = saved["storage"]["len"]
    writer = saved["writer"]
    cursor = writer.get("cursor") if writer["kind"] == "max_value" else writer["state"].get("_cursor")
    order = torch.arange(n)
    if writer["kind"] != "max_value" and isinstance(cursor, int) and n == saved["storage"]["max_size"] and n:
        order = (order + cursor) % n
    return order


def split(lengths: list[int], rank: int, world: int) -> list[tuple[int, int, int]]:
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
    """Saved shards new rank ``ctx.rank`` takes transitions from (see :func:`reshard_buffer`).

    Refused here, while planning: storages with ``ndim > 1``, and transitions a ``MultiStepTransform`` of any saved
    rank holds back (they continue that rank's env stream, which no new rank resumes: no place for them is exact).
    """
    for r, state in saved.items():
        if state["storage"]["initialized"] and state["storage"].get("ndim", 1) != 1:
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: storages with ndim > 1 cannot be resharded (saved rank {r})"
            )
    for r, state in saved.items():
        held = held_back_counts(state.get("transforms") or {})
        if held:
            where = ", ".join(f"{n} at transform {w}" for w, n in held.items())
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: saved rank {r}'s MultiStepTransform holds transitions back ({where}) until "
                "its env stream's next steps complete their n-step returns; after a world-size change no rank "
                "continues that stream, so they cannot be placed exactly: resume with the saved number of ranks"
            )
    # (by saved rank: a rank that held no such buffer, saved absent and left out of ``saved``, holds no transition)
    lengths = [saved[r]["storage"]["len"] if r in saved else 0 for r in range(max(saved) + 1)]
    ctx.plan["lengths"] = lengths
    sources = [src for src, _, _ in split(lengths, ctx.rank, ctx.world_size)]
    held = sorted(saved)
    return sources or [held[ctx.rank % len(held)]]  # nothing to receive: still take transforms/config from one


def check_reshard(rb: ReplayBuffer, saved: dict[int, Any], ctx: AdapterContext) -> None:
    """While planning: the live buffer can take this rank's part exactly (else ``IncompatibleComponentError``).

    The storage kind is the saved one (a list storage for list shards, a tensor storage of one batch dimension for
    tensor shards); the shards this rank reads hold the same entries, and an initialised storage holds these
    entries with the saved item shapes and dtypes and no other; a slice sampler receives a single saved shard's
    transitions (the joins of two shards carry no end of trajectory); the buffer has room for every transition
    received (its storage and a prioritized sampler's trees: :func:`check_room`), and prioritized shards have the
    same ``alpha``, ``beta`` and ``eps``; consuming shards the same ``max_sample_count``; staleness-aware shards the
    same ``consumer_version`` and ``max_staleness``.
    """
    rb = initialized_buffer(rb)
    storage, name = rb._storage, ctx.name
    pieces = split(ctx.plan["lengths"], ctx.rank, ctx.world_size)
    check_room(rb, sum(hi - lo for _, lo, hi in pieces), ctx)
    if isinstance(rb._sampler, SliceSampler) and len(pieces) > 1:
        raise IncompatibleComponentError(
            f"component {name!r}: rank {ctx.rank} would receive the transitions of saved ranks "
            f"{[src for src, _, _ in pieces]} after resharding, and its {type(rb._sampler).__name__} would sample "
            "slices across the join of two ranks' unrelated trajectories (nothing in the stored data ends a "
            "trajectory there): reshard only onto a number of ranks whose every part falls inside one saved shard "
            "(docs/components/resharding.md), or resume with the saved number of ranks"
        )
    _check_prioritized_settings(saved, name)
    _check_state_dict_settings(rb._sampler, saved, ctx)
    lists = sorted(r for r, s in saved.items() if s["storage"].get("kind") == LIST_KIND)
    tensors = sorted(
        r for r, s in saved.items() if s["storage"].get("kind") != LIST_KIND and s["storage"]["initialized"]
    )
    if lists and tensors:
        raise IncompatibleComponentError(
            f"component {name!r}: saved ranks {lists} hold list storages, saved ranks {tensors} tensor storages: "
            "their transitions cannot be joined into one buffer"
        )
    if lists and not is_list_storage(storage):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds list storages (one object per transition), the buffer's "
            f"storage is a {type(storage).__name__}; build the buffer with a ListStorage"
        )
    if not tensors:
        return
    if not isinstance(storage, TensorStorage):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds tensor storages, the buffer's storage "
            f"{type(storage).__name__} is not a tensor storage; build it with a LazyTensorStorage or LazyMemmapStorage"
        )
    if int(storage.ndim) != 1:
        raise IncompatibleComponentError(
            f"component {name!r}: storages with ndim > 1 cannot be resharded (the buffer's has ndim {storage.ndim})"
        )
    indexed = all(_writes_index(saved[r]["writer"]) for r in tensors)
    entries = {r: _entries(saved[r]["storage"], indexed) for r in tensors}
    first = entries[tensors[0]]
    index_alike = _index_specs({r: saved[r] for r in tensors}, indexed) is not None
    for r in tensors[1:]:
        if entries[r] != first or not index_alike:
            differ = sorted(set(entries[r][1]) ^ set(first[1])) or [(("index",), "", "of other shapes or dtypes")]
            named = ", ".join(f"{'.'.join(k) or '<tensor>'} {list(shape)} {dtype}" for k, shape, dtype in differ[:4])
            raise IncompatibleComponentError(
                f"component {name!r}: saved ranks {tensors[0]} and {r} hold different storage entries (keys, item "
                f"shapes or dtypes; in one of them only: {named or 'a TensorDict and a tensor'}): their transitions "
                "cannot be joined into one buffer"
            )
    if not storage.initialized:
        return
    flat = flatten(saved[tensors[0]]["storage"]["data"])
    live = storage._storage
    if is_tensor_collection(live) != bool(saved[tensors[0]]["storage"].get("is_tensordict")):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint's storage holds "
            f"{'a TensorDict' if saved[tensors[0]]['storage'].get('is_tensordict') else 'a tensor'}, the buffer's "
            f"holds {'a TensorDict' if is_tensor_collection(live) else 'a tensor'}"
        )
    check_no_other_entries(storage, flat, name)
    for key, spec in flat.items():
        leaf = live if not key else live.get(key, None)
        if leaf is None:
            continue  # added at the fill, as torchrl's first write does
        tail, dtype = tuple(spec.shape[1:]), spec.dtype
        if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape[1:]) != tail or leaf.dtype != dtype:
            found = (tuple(leaf.shape[1:]), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise IncompatibleComponentError(
                f"component {name!r}: storage entry {'.'.join(key) or '<tensor>'} was saved as {tail} {dtype}, the "
                f"buffer holds {found}"
            )


def _entries(saved_storage: Mapping[str, Any], indexed: bool = False) -> tuple[Any, ...]:
    """A saved storage's kind and entries (key, item shape, dtype); ``indexed`` (every shard's writer stores each
    row's position in ``"index"``): without that entry, which a storage the user allocated lacks until the buffer's
    first write (:func:`_index_specs`)."""
    flat = flatten(saved_storage["data"])
    return (
        bool(saved_storage.get("is_tensordict")),
        tuple(sorted((k, tuple(v.shape[1:]), str(v.dtype)) for k, v in flat.items() if not (indexed and k == _INDEX))),
    )


_INDEX = ("index",)


def _index_specs(states: Mapping[int, Any], indexed: bool) -> dict[tuple[str, ...], Any] | None:
    """``{("index",): (item shape, dtype)}`` when some shards written by a TensorDict writer hold the ``"index"`` entry
    it adds at its first write and the others (a storage the user allocated, never written) lack it: their rows get
    zeros, as torchrl's first write allocates them; ``{}`` when there is nothing to add; ``None`` when the shards
    holding it disagree on its shape or dtype."""
    if not indexed:
        return {}
    found = {
        (tuple(v.shape[1:]), v.dtype)
        for state in states.values()
        if isinstance(state["storage"].get("data"), Mapping)
        for v in [flatten(state["storage"]["data"]).get(_INDEX)]
        if isinstance(v, torch.Tensor)
    }
    if len(found) > 1:
        return None
    return {_INDEX: next(iter(found))} if found else {}


def _with_index(rows: Any, specs: Mapping[tuple[str, ...], Any], n: int) -> Any:
    """``rows`` (``n`` rows of a TensorDict storage) with the writer's ``"index"`` entry as zeros where they lack it."""
    if not specs or not isinstance(rows, Mapping) or "index" in rows:
        return rows
    tail, dtype = specs[_INDEX]
    return {**rows, "index": torch.zeros((n, *tail), dtype=dtype)}


def _check_prioritized_settings(saved: dict[int, Any], name: str) -> None:
    """The saved prioritized shards agree on ``alpha``, ``beta`` and ``eps`` (the tree leaves are
    ``priority ** alpha``: leaves of other exponents cannot be mixed, nor one ``beta`` chosen over another)."""
    found = {
        r: tuple(s["sampler"].get(k) for k in ("alpha", "beta", "eps"))
        for r, s in saved.items()
        if isinstance(s.get("sampler"), Mapping) and s["sampler"].get("kind") == "prioritized"
    }
    if len(set(found.values())) > 1:
        raise IncompatibleComponentError(
            f"component {name!r}: the saved prioritized samplers differ in (alpha, beta, eps): {found}; their "
            "priorities cannot be joined into one buffer exactly"
        )


def check_room(rb: ReplayBuffer, n: int, ctx: AdapterContext) -> None:
    """The (initialised) buffer holds the ``n`` transitions this rank receives: its storage's ``max_size``, and a
    prioritized sampler's sum/min-tree leaves (its ``max_capacity`` can be smaller than the storage's: the leaves of
    the rows past it would wrap around onto others). One error names every capacity that is short."""
    short = []
    if n > int(rb._storage.max_size):
        short.append(
            f"its storage holds {int(rb._storage.max_size)} (build the buffers with a capacity of at least {n})"
        )
    sampler = rb._sampler
    if isinstance(sampler, PrioritizedSampler) and n > int(sampler._max_capacity):
        short.append(
            f"its {type(sampler).__name__} holds {int(sampler._max_capacity)} priorities (build the samplers with a "
            f"max_capacity of at least {n})"
        )
    if short:
        raise IncompatibleComponentError(
            f"component {ctx.name!r}: rank {ctx.rank} receives {n} transitions after resharding, and "
            f"{'; and '.join(short)}; or resume with the saved number of ranks"
        )


#: What the shards of a sampler saved by its ``state_dict`` must agree on to be joined on one rank: the settings a
#: reshard carries over (one value per new rank).
_SHARED_SETTINGS = {
    ConsumingSampler: ("max_sample_count",),
    StalenessAwareSampler: ("consumer_version", "max_staleness"),
}


def _shared_settings(sampler: Any) -> tuple[str, ...]:
    return next((keys for cls, keys in _SHARED_SETTINGS.items() if isinstance(sampler, cls)), ())


def _check_state_dict_settings(sampler: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
    """The saved shards this rank reads agree on the sampler settings it carries over (:data:`_SHARED_SETTINGS`)."""
    keys = _shared_settings(sampler)
    found = {
        r: tuple(_plain(s["sampler"]["state"].get(k)) for k in keys)
        for r, s in saved.items()
        if keys and isinstance(s.get("sampler"), Mapping) and isinstance(s["sampler"].get("state"), Mapping)
    }
    if len(set(found.values())) > 1:
        raise IncompatibleComponentError(
            f"component {ctx.name!r}: rank {ctx.rank} would receive the transitions of saved ranks {sorted(found)}, "
            f"whose {type(sampler).__name__}s differ in ({', '.join(keys)}): {found}; its one sampler cannot keep "
            f"each shard's value exactly: give every rank's sampler the same {' and '.join(keys)} before saving, or "
            "resume with the saved number of ranks"
        )


def _plain(value: Any) -> Any:
    """A setting as a comparable value (a one-element tensor as its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type != "meta":
        return value.item()
    return value


def reshard_buffer(rb: ReplayBuffer, states: dict[int, Any], ctx: AdapterContext) -> None:
    """Fill ``rb`` with this rank's part of the saved shards (their transitions, priorities, heap ranks).

    The saved shards are concatenated in rank order, each oldest-first, and cut into
    ``world_size`` contiguous, nearly equal parts: new rank ``r`` receives part ``r``.
    Every transition lands on exactly one rank with its priority (sum/min-tree
    leaves) and, for a max-value writer, its rank in the heap; a consuming sampler's
    sample counts follow their transitions, and a staleness-aware sampler keeps the
    saved ``consumer_version``. Samplers without replacement start a new epoch; a
    buffer's own generator is re-seeded from the saved one and the new rank.
    """
    rb = initialized_buffer(rb)
    first = states[min(states)]
    check_transform_layout(rb, first.get("transforms") or {}, ctx)
    _check_state_dict_settings(rb._sampler, states, ctx)  # (again, with the values of settings saved as tensors)
    consuming = isinstance(rb._sampler, ConsumingSampler)
    part = _received(states, split(ctx.plan["lengths"], ctx.rank, ctx.world_size), ctx, consuming)
    check_room(rb, part.n, ctx)  # (checked while planning: check_reshard)
    _fill_storage(rb._storage, part, ctx)
    _warn_open_episode(rb._sampler, part, ctx)
    _reset_writer(rb._writer, part, int(rb._storage.max_size))
    _reset_sampler(rb._sampler, part, states)
    restore_buffer_settings(rb, first, reseed_for=(ctx.rank, ctx.world_size))
    if first.get("transforms"):  # nothing held back (reshard_sources refuses otherwise): the transforms hold nothing
        restore_transform_states(rb, first["transforms"], ctx)


@dataclass
class _Received:
    """What a new rank receives from the saved shards, in age order."""

    datas: list[Any] = field(default_factory=list)
    sums: list[torch.Tensor] = field(default_factory=list)
    mins: list[torch.Tensor] = field(default_factory=list)
    heap: list[tuple[float, int]] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)  # a consuming sampler's: times each was sampled
    live: list[torch.Tensor] = field(default_factory=list)  # ... and whether it can still be sampled
    free: list[int] = field(default_factory=list)  # ... its consumed rows, in the order the writer reuses them
    generations: list[torch.Tensor] = field(default_factory=list)  # a generation-tracking writer's slot stamps
    n: int = 0


def _writes_index(saved_writer: Mapping[str, Any]) -> bool:
    """Whether the saved writer is one of torchrl's TensorDict writers, which store each row's position in it as
    ``"index"`` (any other writer's rows hold the user's own ``"index"``, if any: never renumbered)."""
    kind = saved_writer.get("kind")
    return kind == "max_value" or (kind == "state_dict" and saved_writer.get("type") == "TensorDictRoundRobinWriter")


def _renumbered(data: Any, positions: torch.Tensor, start: int) -> Any:
    """``data`` (rows taken at the saved ``positions``) with the ``"index"`` entry a TensorDict writer stores in each
    row (its storage position, which ``update_tensordict_priority`` writes priorities at) set to the rows' new
    positions ``start, start + 1, ...``, in each row whose entry is its saved position: the rows the writer wrote (a
    storage allocated by the user holds rows it never wrote, whose entries are left as they are)."""
    index = data.get("index") if isinstance(data, Mapping) else None
    if not isinstance(index, torch.Tensor) or index.dtype != torch.long or index.shape[:1] != positions.shape:
        return data
    saved = positions.to(index.device).reshape(-1, *([1] * (index.ndim - 1)))
    new = torch.arange(start, start + len(positions), dtype=torch.long, device=index.device)
    written = index == saved
    if not bool(written.any()):
        return data
    return {**data, "index": torch.where(written, new.reshape(saved.shape), index)}


def _received(
    states: dict[int, Any], pieces: list[tuple[int, int, int]], ctx: AdapterContext, consuming: bool = False
) -> _Received:
    out = _Received()
    tensors = {r: st for r, st in states.items() if st["storage"].get("kind") != LIST_KIND}
    index_specs = _index_specs(tensors, all(_writes_index(st["writer"]) for st in tensors.values())) or {}
    for src, lo, hi in pieces:
        state = states[src]
        positions = _age_order(state)[lo:hi]
        if state["storage"].get("kind") == LIST_KIND:  # one object per transition
            items = list_items(state["storage"], ctx)
            out.datas.append([items[p] for p in positions.tolist()])
        else:
            rows = _map_tree(state["storage"]["data"], lambda t, p=positions: t[p])
            rows = _with_index(rows, index_specs, len(positions))
            out.datas.append(_renumbered(rows, positions, out.n) if _writes_index(state["writer"]) else rows)
        generations = (state["writer"].get("state") or {}).get("_generation")
        if isinstance(generations, torch.Tensor):  # (a RoundRobinWriter(track_generations=True)'s slot stamps)
            known = positions < generations.numel()
            stamps = torch.full((len(positions),), -1, dtype=torch.int64)
            stamps[known] = generations.reshape(-1)[positions[known]].to(torch.int64).cpu()
            out.generations.append(stamps)
        if state["sampler"]["kind"] == "prioritized":
            out.sums.append(state["sampler"]["sum"][positions])
            out.mins.append(state["sampler"]["min"][positions])
        if state["writer"]["kind"] == "max_value":
            new_pos = {int(p): out.n + i for i, p in enumerate(positions.tolist())}
            for rank_value, index in zip(state["writer"]["heap_rank"].tolist(), state["writer"]["heap_index"].tolist()):
                if index in new_pos:
                    out.heap.append((rank_value, new_pos[index]))
        if consuming:  # (the saved sampler of the buffer's class: validate)
            _receive_consumption(out, state["sampler"]["state"], positions)
        out.n += hi - lo
    return out


def _receive_consumption(out: _Received, saved: Mapping[str, Any], positions: torch.Tensor) -> None:
    """A consuming sampler's state of the received rows (``positions``, saved storage positions in age order), at
    their new positions ``out.n + i``. Rows the saved sampler had not seen yet are live and never sampled (as its
    next ``sample`` would have made them)."""
    limit = int(saved["max_sample_count"])
    counts = torch.zeros(len(positions), dtype=torch.long)
    live = torch.ones(len(positions), dtype=torch.bool)
    saved_counts, saved_live = saved.get("_sample_count"), saved.get("_live_mask")
    if isinstance(saved_counts, torch.Tensor) and isinstance(saved_live, torch.Tensor):
        known = min(int(saved["_known_storage_len"]), saved_counts.numel(), saved_live.numel())
        seen = positions < known
        counts[seen] = saved_counts.reshape(-1)[positions[seen]].to(torch.long).cpu()
        live[seen] = saved_live.reshape(-1)[positions[seen]].to(torch.bool).cpu()
    live &= counts < limit
    new_pos = {int(p): out.n + i for i, p in enumerate(positions.tolist())}
    consumed = {out.n + i for i in torch.nonzero(~live).flatten().tolist()}
    freed = saved.get("_free_indices")
    order = [new_pos.get(int(p)) for p in freed.reshape(-1).tolist()] if isinstance(freed, torch.Tensor) else []
    order += sorted(consumed)  # (any the saved free list lacks: oldest first, as torchrl rebuilds it)
    taken: set[int] = set()
    for p in order:
        if p in consumed and p not in taken:
            taken.add(p)
            out.free.append(p)
    out.counts.append(counts)
    out.live.append(live)


def _fill_storage(storage: Any, part: _Received, ctx: AdapterContext) -> None:
    n = part.n
    received_lists = any(isinstance(items, list) for items in part.datas)
    if received_lists != is_list_storage(storage) and n:  # (checked while planning: check_reshard)
        raise IncompatibleComponentError(
            f"component {ctx.name!r}: the checkpoint holds {'list' if received_lists else 'tensor'} storages, the "
            f"buffer's storage is a {type(storage).__name__}"
        )
    if is_list_storage(storage):
        if n > int(storage.max_size):
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: rank {ctx.rank} receives {n} transitions after resharding, its buffer "
                f"holds {int(storage.max_size)}; build the buffers with a capacity of at least {n}"
            )
        restore_list_storage(storage, [item for items in part.datas for item in items])
        return
    if n:
        data = _cat_trees(part.datas)
        flat_specs = flatten(data)
        if not storage.initialized:
            allocate(storage, flat_specs, isinstance(data, Mapping), 1)
        live = storage._storage
        capacity = int(live.shape[0])
        if n > capacity:
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: rank {ctx.rank} receives {n} transitions after resharding, its buffer "
                f"holds {capacity}; build the buffers with a capacity of at least {n}"
            )
        for key, tensor in flat_specs.items():
            leaf = live_leaf(storage, key, tuple(tensor.shape[1:]), tensor.dtype)
            if (
                not isinstance(leaf, torch.Tensor)
                or tuple(leaf.shape[1:]) != tuple(tensor.shape[1:])
                or leaf.dtype != tensor.dtype
            ):
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: storage entry {'.'.join(key) or '<tensor>'} was saved as "
                    f"{tuple(tensor.shape[1:])} {tensor.dtype}, the buffer holds "
                    f"{tuple(leaf.shape[1:]) if isinstance(leaf, torch.Tensor) else type(leaf).__name__}"
                )
            leaf[:n].copy_(tensor)
        storage._len = n
        storage.initialized = True
        _set_last_cursor(storage, torch.arange(n))  # as an extend of the n rows into an empty storage leaves it
    elif storage.initialized:
        storage._len = 0
        _set_last_cursor(storage, None)
    bump = getattr(storage, "_bump_mutation_revision", None)
    if bump is not None:
        bump()


def _warn_open_episode(sampler: Any, part: _Received, ctx: AdapterContext) -> None:
    """A slice sampler's received part whose newest row does not end an episode by the sampler's end flag(s)
    (``end_keys``, ``end_key``, ``("next", "done")``): the next rows written (a new episode: collectors start fresh
    after a reshard) continue it in the sampler's eyes, so slices span both until those rows are overwritten."""
    pieces = [d for d in part.datas if not isinstance(d, list) and isinstance(d, Mapping)]
    if not isinstance(sampler, SliceSampler) or not part.n or not pieces or len(pieces) != len(part.datas):
        return
    keys = sampler.end_keys or ((sampler.end_key or ("next", "done")),)
    ended = False
    for key in keys:
        value: Any = pieces[-1]
        for part_key in (key,) if isinstance(key, str) else key:
            value = value.get(part_key) if isinstance(value, Mapping) else None
        if isinstance(value, torch.Tensor) and value.shape[:1] and value.shape[0]:
            ended = ended or bool(value[-1].bool().any())
    if not ended:
        warnings.warn(
            f"component {ctx.name!r} (loading): the newest transition rank {ctx.rank} receives does not end an "
            f"episode (no end flag at {keys[0]!r}): the slice sampler takes the next rows written (a new episode after "
            "a reshard) as its continuation, and samples slices spanning both until they are overwritten; reshard a "
            "checkpoint saved at episode ends, or resume with the saved number of ranks, for exact slices",
            InexactResumeWarning,
            stacklevel=2,
        )


def _set_last_cursor(storage: Any, cursor: Any) -> None:
    """The storage's last cursor (a full storage's slice sampler ends a trajectory there) and its shared index."""
    set_cursor = getattr(storage, "_set_last_cursor", None)
    if callable(set_cursor):
        set_cursor(cursor)
    else:
        storage._last_cursor = cursor


def _reset_writer(writer: Any, part: _Received, capacity: int) -> None:
    if isinstance(writer, TensorDictMaxValueWriter):
        heapq.heapify(part.heap)
        writer._current_top_values = part.heap
    if hasattr(writer, "_cursor"):
        writer._cursor = part.n % capacity
        writer._write_count = part.n
    if getattr(writer, "_track_generations", False) or getattr(writer, "_generation", None) is not None:
        # the received rows keep their slots' stamps (-1 where none was saved); every other slot is unwritten
        live = writer._generation
        stamps = torch.full((max(part.n, 0 if live is None else live.numel()),), -1, dtype=torch.int64)
        if part.generations:
            stamps[: part.n] = torch.cat(part.generations)
        writer._generation = stamps.to(live.device) if live is not None else stamps


def _reset_sampler(sampler: Any, part: _Received, states: dict[int, Any]) -> None:
    if isinstance(sampler, ConsumingSampler):
        _restore_consumption(sampler, part, states)
        return
    if isinstance(sampler, StalenessAwareSampler):  # (its settings the same in every shard read: check_reshard)
        sampler.load_state_dict(states[min(states)]["sampler"]["state"])
        return
    if not isinstance(sampler, PrioritizedSampler):
        if hasattr(sampler, "_empty"):
            sampler._empty()
        return
    saved = [s["sampler"] for s in states.values() if s["sampler"]["kind"] == "prioritized"]
    if saved:  # (the same in every shard: check_reshard)
        sampler._alpha, sampler._beta, sampler._eps = saved[0]["alpha"], saved[0]["beta"], saved[0]["eps"]
    sampler._empty()
    if part.n and part.sums:
        index = torch.arange(part.n)
        sampler._sum_tree[index] = torch.cat(part.sums)
        sampler._min_tree[index] = torch.cat(part.mins)
    if sampler._max_priority_within_buffer:
        sampler._recompute_max_priority_from_tree()
    else:
        values = [s["sampler"]["max_priority"][0] for s in states.values() if s["sampler"]["kind"] == "prioritized"]
        values = [torch.as_tensor(v) for v in values if v is not None]
        sampler._max_priority = (torch.stack(values).max(), None) if values else (None, None)


def _restore_consumption(sampler: ConsumingSampler, part: _Received, states: dict[int, Any]) -> None:
    """The received rows' sample counts and live flags at their new positions; consumed rows are reused first by the
    next writes, in their saved order (each saved shard's in turn)."""
    saved = states[min(states)]["sampler"]["state"]  # (max_sample_count the same in every shard read: check_reshard)
    counts = torch.cat(part.counts) if part.counts else torch.zeros(0, dtype=torch.long)
    live = torch.cat(part.live) if part.live else torch.zeros(0, dtype=torch.bool)
    sampler.load_state_dict(
        {
            "max_sample_count": int(saved["max_sample_count"]),
            "_sample_count": counts,
            "_live_mask": live,
            "_known_storage_len": part.n,
            "_free_indices": torch.tensor(part.free, dtype=torch.long) if part.free else None,
            "_free_head": 0,
            "_ran_out": bool(part.n) and not bool(live.any()),
        }
    )
