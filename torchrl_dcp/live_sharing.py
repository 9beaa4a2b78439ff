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


def refuse_conflicting_live(plan: LoadPlan, saved_crcs: Callable[[str], Any], source: Any) -> None:
    """Refuse tensors read in place that are the same memory (a dict and a module holding one tensor,
    ``TensorDict.from_module(policy)`` beside a policy, a module whose two weights are tied now) where the checkpoint
    holds two different tensors for them (saved from objects that did not share it): both reads would land on the
    same bytes, the last one read winning. ``saved_crcs(key)``: the CRCs recorded in a tensor's records (``None``:
    unknown). A save of shared memory holds it once (an ``xref``, an alias) or twice with the same bytes (per-rank
    components, two views of one tensor): those load. Checked before anything changes; named alike on every rank."""
    owners = [c for c in plan.components.values() if c.in_place]
    if not owners:
        return
    live = {k: memory(t) for k, t in plan.live.items()}  # (a DTensor's: its local shard, perhaps empty)
    pointers = [t.data_ptr() for t in live.values() if t.numel()]
    if len(set(pointers)) == len(pointers):  # (no two live tensors start at one address: none shared, the common case)
        return
    keyed = [
        (comp.name, f"{state.prefix}/{spec.key}")
        for comp in owners
        for state in comp.sources.values()
        for spec in state.specs
    ]
    spans: dict[tuple[Any, int, int], list[tuple[str, str]]] = {}  # one memory extent: (component, key) reading it
    for name, key in keyed:
        t = live.get(key)
        if t is None or not t.numel():
            continue
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        start = t.data_ptr()
        spans.setdefault((str(t.device), start, start + extent * t.element_size()), []).append((name, key))
    conflicts = []
    for readers in spans.values():
        if len({key for _, key in readers}) < 2:
            continue
        readers.sort()
        if len({name for name, _ in readers}) < 2 and not one_view(live, readers):
            continue  # (one component's views of one memory in other layouts, ``w`` and ``w.t()``: saved as views)
        crcs = [saved_crcs(key) for _, key in readers]
        one_component = len({name for name, _ in readers}) < 2
        if (any(c is None for c in crcs) and not one_component) or len({c for c in crcs if c is not None}) > 1:
            # (unknown CRCs, a checkpoint of DCP's own record layout, format 1: a conflict across components only;
            # within one, tied weights saved tied then read alike)
            conflicts.append(readers)
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
