"""Adapter for any object with ``state_dict()`` / ``load_state_dict()`` (DCP's ``Stateful``).

The state may nest dicts, lists and tuples of tensors and JSON-safe values (LR
schedulers, loss modules' extra state, custom counters, ...).

**Read in place.** The tensors the object's ``state_dict()`` returns receive the saved bytes where they are (as a
module's weights do), and ``load_state_dict`` is then given those same tensors, where that leaves the object as a
restore from freshly read tensors would:

- the saved state has the live state's shape: the same keys in every mapping, the same lengths of every list and
  tuple (a state ``load_state_dict`` would refuse for its keys is read into fresh tensors, so that refusal changes
  nothing);
- each tensor is a plain dense contiguous tensor (``torch.Tensor`` or ``nn.Parameter``, not an inference tensor nor
  the result of an autograd op) with the saved dtype and shape, on the device the saved one maps to;
- no two tensors of the state share memory, except one tensor under several keys that the save stored once;
- they are the object's own: a second ``state_dict()`` returns the same memory (a ``state_dict()`` that returns
  copies gains nothing from it; its restore then stays with the components restored before the in-place read, and
  its snapshot is those copies).

Anything else is read into fresh tensors. The object ends as a normal restore leaves it: ``load_state_dict`` copies
the tensors onto themselves, or keeps them. One case differs: an object whose ``load_state_dict`` *replaces* its
tensors instead of copying into them, and whose tensors are shared with other objects, would see those objects take
the loaded values too. Register such an object with ``adapter=StateDictAdapter(in_place=False)``.

**Rollback.** The snapshot taken while planning keeps the tensors read in place by reference (no copy of the state)
and copies the rest: a load failing before the final in-place read (planning, verification, reading, restoring other
components, on any rank) leaves the object exactly as it was; one failing during that read, or the object's own
``load_state_dict`` raising after it, leaves those tensors, and those of the other components read in place (a
module's weights), with loaded values, as a module's failing restore does (docs/reliability.md).

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import StateDictAdapter, AdapterContext
    >>> sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 2)
    >>> StateDictAdapter().state(sched, AdapterContext("sched"))["step_size"]
    2
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.format.codec import TensorSpec

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_IMMUTABLE = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


class StateDictAdapter(Adapter):
    """``obj.state_dict(*save_args, **save_kwargs)`` / ``obj.load_state_dict(state, *load_args, **load_kwargs)``.

    ``in_place=False``: always read into fresh tensors (see the module's docstring for when reading in place
    differs).
    """

    adapter_id = "torchrl_dcp.state_dict"
    version = 1

    def __init__(self, in_place: bool = True) -> None:
        self.in_place = in_place

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return obj.state_dict(*(ctx.options.save_args or ()), **(ctx.options.save_kwargs or {}))

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        obj.load_state_dict(state, *(ctx.options.load_args or ()), **(ctx.options.load_kwargs or {}))
        return None

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Notes (once, before the snapshot) the live tensors that will receive the saved bytes in place."""
        ctx.plan.pop("in_place", None)
        if not self.in_place or getattr(self, "restore_last", False) or len(saved) != 1:
            return  # RNG-like state is restored with the streams; several saved states: resharded, fresh
        if ctx.saved_world_size is not None and ctx.saved_world_size != ctx.world_size:
            return  # possibly resharded (the plan then reads into fresh tensors): the snapshot must copy
        current = self.state(obj, ctx)
        (view,) = saved.values()
        ctx.plan["current"] = current
        found = in_place_tensors(current, view, ctx)
        ctx.plan["copies"] = set()
        if found:  # only the object's own tensors: copies gain nothing, and keep its restore before the in-place read
            again: dict[str, list[tuple[TensorSpec, Any]]] = {}
            if not _pair(self.state(obj, ctx), view, again, 0):
                again.clear()
            own = {k: t for k, t in found.items() if _same_memory(again.get(k), t)}
            ctx.plan["copies"] = {id(t) for k, t in found.items() if k not in own}
            found = own
        ctx.plan["in_place"] = found

    def destinations(self, obj: Any, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        return ctx.plan.get("in_place") or None

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        """A copy of the state in which the tensors that will be read in place are kept by reference."""
        current = ctx.plan.get("current")
        if current is None:
            return super().snapshot(obj, ctx)
        keep = {id(t) for t in ctx.plan["in_place"].values()} | ctx.plan["copies"]  # copies: a copy already
        return _copy_except(current, keep)


def _copy_except(value: Any, keep: set[int]) -> Any:
    """A deep copy of ``value`` in which the tensors whose ids are in ``keep`` are the same objects."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor) and id(value) in keep:
        return value
    if type(value) is dict:  # state dicts: a plain dict, often of thousands of tensors
        return {k: v if id(v) in keep else _copy_except(v, keep) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy_except(v, keep) for v in value)
    return _deepcopy_keeping(value, keep)


def _deepcopy_keeping(value: Any, keep: set[int]) -> Any:
    """``copy.deepcopy`` of any other value, the kept tensors it reaches shared rather than copied."""
    memo: dict[int, Any] = {}
    _remember(value, keep, memo, 0)
    return copy.deepcopy(value, memo)


def _remember(value: Any, keep: set[int], memo: dict[int, Any], depth: int) -> None:
    if depth > 64:
        return
    if isinstance(value, torch.Tensor):
        if id(value) in keep:
            memo[id(value)] = value
    elif isinstance(value, Mapping):
        for v in value.values():
            _remember(v, keep, memo, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _remember(v, keep, memo, depth + 1)


def in_place_tensors(live: Any, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """``{saved tensor key: live tensor}`` for every saved tensor that can be read where the live one is.

    ``live`` is the object's state now, ``saved`` the saved state with :class:`TensorSpec` leaves. Empty when the
    two differ in shape (keys, lengths); see the module's docstring for what each tensor must be.

    Example:
        >>> import torch
        >>> live = {"w": torch.zeros(3), "n": 1}
        >>> saved = {"w": TensorSpec("w", (3,), torch.float32, "cpu"), "n": 5}
        >>> list(in_place_tensors(live, saved, AdapterContext("x")))
        ['w']
    """
    found: dict[str, list[tuple[TensorSpec, Any]]] = {}
    if not _pair(live, saved, found, 0):
        return {}
    devices: dict[str, torch.device] = {}
    out: dict[str, torch.Tensor] = {}
    for key, pairs in found.items():
        spec, t = pairs[0]
        if len(pairs) > 1 and not _one_tensor(pairs):
            continue  # one saved tensor, several live ones (or one key for two saved tensors): fresh
        device = devices.get(spec.device)
        if device is None:
            device = devices[spec.device] = ctx.device_for(spec.device)
        if (
            type(t) in _PLAIN
            and t.dtype == spec.dtype
            and t.shape == spec.shape
            and t.device == device
            and t.layout == torch.strided
            and t.is_contiguous()
            and t.grad_fn is None
            and not t.is_inference()
            and not t.is_conj()
            and not t.is_neg()
            and t.numel()
        ):
            out[key] = t
    return _without_overlaps(out)


def _pair(live: Any, saved: Any, found: dict[str, list[tuple[TensorSpec, Any]]], depth: int) -> bool:
    """Collect ``(spec, live value)`` by saved key; ``False`` where the states differ in keys or lengths."""
    if type(saved) is TensorSpec:
        found.setdefault(saved.key, []).append((saved, live))
        return True
    if isinstance(saved, Mapping):
        if not isinstance(live, Mapping) or len(live) != len(saved) or depth > 64:
            return False
        for k, v in saved.items():
            if k not in live:
                return False
            if type(v) is TensorSpec:  # the common leaf, without a call (5,000 tensors: 2 ms a walk)
                pairs = found.get(v.key)
                if pairs is None:
                    found[v.key] = [(v, live[k])]
                else:
                    pairs.append((v, live[k]))
            elif not _pair(live[k], v, found, depth + 1):
                return False
        return True
    if isinstance(saved, (list, tuple)):
        if not isinstance(live, (list, tuple)) or len(live) != len(saved) or depth > 64:
            return False
        return all(_pair(lv, sv, found, depth + 1) for lv, sv in zip(live, saved))
    return True  # a value (or a set): load_state_dict takes it as saved


def _same_memory(pairs: list[tuple[TensorSpec, Any]] | None, t: torch.Tensor) -> bool:
    """Whether a second ``state_dict()`` gave, for the same saved tensor, a tensor at ``t``'s memory."""
    u = pairs[0][1] if pairs else None
    return isinstance(u, torch.Tensor) and u.data_ptr() == t.data_ptr()


def _one_tensor(pairs: list[tuple[TensorSpec, Any]]) -> bool:
    """One saved tensor (an alias: the same spec) and one live tensor (the same view of the same memory)."""
    spec, t = pairs[0]
    if not isinstance(t, torch.Tensor):
        return False
    ident = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    return all(
        s is spec and isinstance(u, torch.Tensor) and (u.data_ptr(), u.shape, u.stride(), u.dtype, u.device) == ident
        for s, u in pairs[1:]
    )


def _without_overlaps(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` less every pair whose memory overlaps (two saved tensors would be read into the same bytes)."""
    by_device: dict[torch.device, list[tuple[int, int, str]]] = {}
    for k, t in tensors.items():
        start = t.data_ptr()
        spans = by_device.get(t.device)
        if spans is None:
            spans = by_device[t.device] = []
        spans.append((start, start + t.nbytes, k))
    bad: set[str] = set()
    for spans in by_device.values():
        spans.sort()
        end, last = -1, ""
        for start, stop, key in spans:
            if start < end:
                bad.update((key, last))
            if stop > end:
                end, last = stop, key
    return {k: t for k, t in tensors.items() if k not in bad} if bad else tensors
