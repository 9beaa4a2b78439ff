"""Reading a saved state into the tensors of a live one: which live tensor receives which saved tensor's bytes.

Shared by the adapters that read in place into tensors they do not allocate (an object's own ``state_dict()``, a
registered dict or list, a TensorDict): the saved state, its tensors as :class:`~torchrl_dcp.format.codec.TensorSpec`,
is paired with the live state position by position, and a live tensor receives the bytes of the saved tensor at its
position when

- the two states have the same shape: the same keys in every mapping, the same lengths of every list and tuple (a
  registered dict or TensorDict, whose restore replaces what differs: the same key path, lists of the same length);
- it is a plain dense tensor, contiguous or laid out densely in another order (a transpose, channels-last) (``torch.Tensor`` or ``nn.Parameter``, not an inference tensor nor the
  result of an autograd op, not conjugated or negated) with the saved dtype and shape, on the device the saved one
  maps to, holding at least one element;
- no two such tensors share memory, except one tensor under several keys that the save stored once.

Anything else is read into fresh tensors. Snapshots for a rollback keep the tensors read in place by reference
(:func:`copy_except`): a load failing during the final in-place read leaves them with loaded values
(docs/reliability.md).

Example:
    >>> import torch
    >>> w = torch.zeros(2)
    >>> kept = copy_except({"w": w, "b": torch.ones(1)}, {id(w)})
    >>> kept["w"] is w
    True
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.format.codec import TensorSpec
from torchrl_dcp.format.tensor_nodes import dense_layout

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_IMMUTABLE = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


def is_expanded(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (an ``expand``-ed tensor: a stride of 0 along a dimension of more than
    one element): nothing can be copied into it (torch refuses the write). A sparse tensor never is (its
    ``stride()`` says 0s: its values are a tensor of their own)."""
    if t.layout != torch.strided:
        return False
    stride = t.stride()
    return 0 in stride and any(s == 0 and n > 1 for s, n in zip(stride, t.shape))  # (the first test: fast, in C)


def pair_tensors(live: Any, saved: Any, found: dict[str, list[tuple[TensorSpec, Any]]]) -> bool:
    """Collect ``(spec, live value)`` by saved key into ``found``; ``False`` where the states differ in keys or
    lengths."""
    return _pair(live, saved, found, 0)


def copy_except(value: Any, keep: set[int]) -> Any:
    """A deep copy of ``value`` in which the tensors whose ids are in ``keep`` are the same objects."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor) and id(value) in keep:
        return value
    if type(value) is dict:  # state dicts: a plain dict, often of thousands of tensors
        return {k: v if id(v) in keep else copy_except(v, keep) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(copy_except(v, keep) for v in value)
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


def in_place_tensors(live: Any, saved: Any, ctx: AdapterContext, *, partial: bool = False) -> dict[str, torch.Tensor]:
    """``{saved tensor key: live tensor}`` for every saved tensor that can be read where the live one is.

    ``live`` is the object's state now, ``saved`` the saved state with :class:`TensorSpec` leaves. Empty when the
    two differ in shape (keys, lengths), for an object's ``load_state_dict`` may refuse such a state; ``partial``
    (a restore that replaces what differs: a dict's items, a TensorDict's entries): the tensors at the positions both
    hold. See the module's docstring for what each tensor must be.

    Example:
        >>> import torch
        >>> live = {"w": torch.zeros(3), "n": 1}
        >>> saved = {"w": TensorSpec("w", (3,), torch.float32, "cpu"), "n": 5}
        >>> list(in_place_tensors(live, saved, AdapterContext("x")))
        ['w']
    """
    found: dict[str, list[tuple[TensorSpec, Any]]] = {}
    if not _pair(live, saved, found, 0, partial):
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
            and (t.is_contiguous() or dense_layout(t.shape, t.stride()))  # (a transpose, channels-last: in place too)
            and t.grad_fn is None
            and not t.is_inference()
            and not t.is_conj()
            and not t.is_neg()
            and t.numel()
        ):
            out[key] = t
    return _without_overlaps(out)


def _pair(
    live: Any, saved: Any, found: dict[str, list[tuple[TensorSpec, Any]]], depth: int, partial: bool = False
) -> bool:
    """Collect ``(spec, live value)`` by saved key; ``False`` where the states differ in keys or lengths (``partial``:
    such a difference only leaves that mapping's other keys, or that list, unpaired)."""
    if type(saved) is TensorSpec:
        found.setdefault(saved.key, []).append((saved, live))
        return True
    if isinstance(saved, Mapping):
        if not isinstance(live, Mapping) or depth > 64 or (len(live) != len(saved) and not partial):
            return partial
        for k, v in saved.items():
            if k not in live:
                if partial:
                    continue
                return False
            if type(v) is TensorSpec:  # the common leaf, without a call (5,000 tensors: 2 ms a walk)
                pairs = found.get(v.key)
                if pairs is None:
                    found[v.key] = [(v, live[k])]
                else:
                    pairs.append((v, live[k]))
            elif not _pair(live[k], v, found, depth + 1, partial):
                return False
        return True
    if isinstance(saved, (list, tuple)):
        if not isinstance(live, (list, tuple)) or len(live) != len(saved) or depth > 64:
            return partial
        return all(_pair(lv, sv, found, depth + 1, partial) for lv, sv in zip(live, saved))
    return True  # a value (or a set): load_state_dict takes it as saved


def same_memory(pairs: list[tuple[TensorSpec, Any]] | None, t: torch.Tensor) -> bool:
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
