"""Tensors read in place that share memory now but were saved apart: refused before a load changes anything.

Two live tensors on one memory (tied weights, a dict beside the module that owns the tensor,
``TensorDict.from_module(policy)``) would both be filled by a load; that is right only where the checkpoint
holds the same bytes for both (or one tensor under two names). :func:`refuse_conflicting_live` finds the
other case and names it.

Example (one process):
    >>> import torch
    >>> from torchrl_dcp.live_sharing import one_view
    >>> w = torch.zeros(2, 3)
    >>> one_view({"a": w, "b": w}, [("m", "a"), ("m", "b")]), one_view({"a": w, "b": w.t()}, [("m", "a"), ("m", "b")])
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.codec import is_dtensor

if TYPE_CHECKING:
    from torchrl_dcp.load_plan import LoadPlan


def refuse_conflicting_live(
    plan: LoadPlan,
    saved_crcs: Callable[[str], Any],
    source: Any,
    read_saved: Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Refuse tensors read in place that overlap in memory (a dict and a module holding one tensor,
    ``TensorDict.from_module(policy)`` beside a policy, tied weights, a view of a row of another tensor) where the
    checkpoint holds different bytes for the overlap (saved from objects that did not share it): both reads would
    land on the same bytes, the last one read winning.

    Tensors that are one view of their memory (tied weights) compare the CRCs their records hold (``saved_crcs(key)``;
    ``None``: unknown): a save of shared memory holds it once (an ``xref``) or twice with the same bytes. Tensors that
    overlap otherwise (``w`` and ``w.t()`` in two components, a row of a matrix) compare the saved values
    themselves, read by ``read_saved({key: (shape, dtype)})``: laid into one scratch copy of the memory they span,
    each must read back as saved. One component's views of one memory in other layouts are saved as views: not
    compared. Checked before anything changes; named alike on every rank."""
    owners = [c for c in plan.components.values() if c.in_place]
    if not owners:
        return
    live = {k: memory(t) for k, t in plan.live.items()}  # (a DTensor's: its local shard, perhaps empty)
    storages = [t.untyped_storage().data_ptr() for t in live.values() if t.numel()]
    if len(set(storages)) == len(storages):  # (no two live tensors in one storage: none overlap, the common case)
        return
    by_storage: dict[tuple[str, int], int] = {}
    for t in live.values():
        if t.numel():
            where = (str(t.device), t.untyped_storage().data_ptr())
            by_storage[where] = by_storage.get(where, 0) + 1
    readers: dict[tuple[str, int], list[tuple[int, int, str, str]]] = {}  # storage: (start, end, component, key)
    for comp in owners:
        for state in comp.sources.values():
            for spec in state.specs:
                key = f"{state.prefix}/{spec.key}"
                t = live.get(key)
                if t is None or not t.numel():
                    continue
                where = (str(t.device), t.untyped_storage().data_ptr())
                if by_storage.get(where, 0) > 1:
                    start, end = _extent(t)
                    readers.setdefault(where, []).append((start, end, comp.name, key))
    conflicts = []
    for group in readers.values():
        for overlapping in _overlapping(group):
            if _conflict(overlapping, live, saved_crcs, read_saved):
                conflicts.append(sorted((name, key) for _, _, name, key in overlapping))
    if conflicts:
        (a, key_a), (b, key_b) = min(conflicts)[:2]
        who = f"components {a!r} and {b!r} share" if a != b else f"component {a!r} holds tensors that share"
        raise IncompatibleComponentError(
            f"{who} memory now ({key_a!r} and {key_b!r}: tied, or one tensor in two places), which the "
            "checkpoint holds as two different tensors (saved from objects that did not share it): one read would "
            "overwrite the other. Load into objects that do not share that memory (untie the weights), or "
            "load one of them (components=[...])",
            path=source,
        )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements span in memory."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlapping(group: list[tuple[int, int, str, str]]) -> list[list[tuple[int, int, str, str]]]:
    """The sets of two or more readers whose extents overlap, one after another (a sweep over the starts)."""
    out: list[list[tuple[int, int, str, str]]] = []
    current: list[tuple[int, int, str, str]] = []
    end = -1
    for reader in sorted(group):
        if current and reader[0] < end:
            current.append(reader)
            end = max(end, reader[1])
            continue
        if len({key for *_, key in current}) > 1:
            out.append(current)
        current, end = [reader], reader[1]
    if len({key for *_, key in current}) > 1:
        out.append(current)
    return out


def _conflict(
    readers: list[tuple[int, int, str, str]],
    live: Mapping[str, torch.Tensor],
    saved_crcs: Callable[[str], Any],
    read_saved: Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]] | None,
) -> bool:
    """Whether overlapping readers would leave a tensor other than as saved."""
    names = {name for _, _, name, _ in readers}
    pairs = [(name, key) for _, _, name, key in readers]
    if one_view(live, pairs):
        crcs = [saved_crcs(key) for key in {key for _, key in pairs}]
        # (unknown CRCs, a checkpoint of DCP's own record layout, format 1: a conflict across components only;
        # within one, tied weights saved tied then read alike)
        return (any(c is None for c in crcs) and len(names) > 1) or len({c for c in crcs if c is not None}) > 1
    if len(names) < 2:
        return False  # (one component's views of one memory in other layouts, ``w`` and ``w.t()``: saved as views)
    return read_saved is None or not _consistent(readers, live, read_saved)


def _consistent(
    readers: list[tuple[int, int, str, str]],
    live: Mapping[str, torch.Tensor],
    read_saved: Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]],
) -> bool:
    """Whether the saved values of overlapping tensors agree on every byte they share: each laid, in turn, into one
    scratch copy of the memory they span reads back as saved (any order then leaves every tensor as saved)."""
    keys = sorted({key for *_, key in readers})
    try:
        saved = read_saved({k: (tuple(live[k].shape), live[k].dtype) for k in keys})
    except Exception:  # noqa: BLE001 - (a value that cannot be read here: a reference, a damaged file) is no proof
        return False
    low, high = min(r[0] for r in readers), max(r[1] for r in readers)
    scratch = torch.zeros(high - low, dtype=torch.uint8)
    views = {}
    for key in keys:
        t, size = live[key], live[key].element_size()
        offset = t.data_ptr() - low
        if offset % size:
            return False  # (not aligned to its elements in the span: no proof either)
        typed = scratch[: (high - low) // size * size].view(t.dtype)  # (its storage offset counts its elements)
        views[key] = typed.as_strided(tuple(t.shape), t.stride(), offset // size)  # (its extent: inside the span)
        views[key].copy_(saved[key])
    return all(torch.equal(_bytes(views[key]), _bytes(saved[key])) for key in keys)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as bytes, in order (``torch.equal`` holds a NaN unequal to itself: bytes compare it)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def memory(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory a read in place fills: a DTensor's local shard (its own ``data_ptr`` and ``numel``
    say nothing of it), any other tensor itself."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # (the common case, without a call)
        return t
    return t.to_local() if is_dtensor(t) else t


def one_view(live: Mapping[str, torch.Tensor], readers: list[tuple[str, str]]) -> bool:
    """Whether the live tensors of ``readers`` are one view of their memory (tied weights: one tensor under two
    keys), not views in other layouts."""
    views = {(tuple(live[key].shape), live[key].stride(), live[key].dtype) for _, key in readers}
    return len(views) == 1
