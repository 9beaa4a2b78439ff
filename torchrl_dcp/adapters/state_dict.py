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

from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.in_place import copy_except, in_place_tensors, pair_tensors, same_memory
from torchrl_dcp.adapters.state_kinds import check_kinds, check_no_shadowing
from torchrl_dcp.format.codec import TensorSpec


class StateDictAdapter(Adapter):
    """``obj.state_dict(*save_args, **save_kwargs)`` / ``obj.load_state_dict(state, *load_args, **load_kwargs)``.

    ``in_place=False``: always read into fresh tensors (see the module's docstring for when reading in place
    differs).
    """

    adapter_id = "torchrl_dcp.state_dict"
    state_is_state_dict = True
    version = 1

    def __init__(self, in_place: bool = True) -> None:
        self.in_place = in_place

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return obj.state_dict(*(ctx.options.save_args or ()), **(ctx.options.save_kwargs or {}))

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        obj.load_state_dict(state, *(ctx.options.load_args or ()), **(ctx.options.load_kwargs or {}))
        return None

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Every saved state holds the kinds of value the live object's does, and no key naming one of its methods
        (:mod:`~torchrl_dcp.adapters.state_kinds`); notes (once, before the snapshot) the live tensors that will
        receive the saved bytes in place."""
        ctx.plan.pop("in_place", None)
        try:
            live = self.state(obj, ctx)
        except Exception:  # (an object whose state() fails before its first use: its load_state_dict decides)
            live = None
        for view in saved.values():
            check_kinds(view, live, f"component {ctx.name!r}", tensors=False)  # (its load_state_dict may cast)
            check_no_shadowing(view, live, obj, f"component {ctx.name!r}")
        if not self.in_place or getattr(self, "restore_last", False) or len(saved) != 1 or live is None:
            return  # RNG-like state is restored with the streams; several saved states: resharded, fresh
        if ctx.saved_world_size is not None and ctx.saved_world_size != ctx.world_size:
            return  # possibly resharded (the plan then reads into fresh tensors): the snapshot must copy
        current = live
        (view,) = saved.values()
        ctx.plan["current"] = current
        found = in_place_tensors(current, view, ctx)
        ctx.plan["copies"] = set()
        if found:  # only the object's own tensors: copies gain nothing, and keep its restore before the in-place read
            again: dict[str, list[tuple[TensorSpec, Any]]] = {}
            if not pair_tensors(self.state(obj, ctx), view, again):
                again.clear()
            own = {k: t for k, t in found.items() if same_memory(again.get(k), t)}
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
        return copy_except(current, keep)


class ParameterSchedulerAdapter(StateDictAdapter):
    """torchrl's replay-buffer parameter schedulers (``LinearScheduler``, ``StepScheduler``, ``LambdaScheduler``:
    a prioritized sampler's ``beta`` annealed): their ``state_dict`` without the functions they were built with
    (``StepScheduler.operator``, a NumPy ufunc; ``LambdaScheduler.lambda_fn``), which are configuration and stay the
    live scheduler's; the step count and values are saved (the same payload as :class:`StateDictAdapter`'s, which
    saved the others already, under its id). A load refuses, while planning, what no save of this scheduler writes:
    a key it keeps no state under (its functions, its sampler), another ``param_name`` or ``mode`` than the live
    scheduler's (the parameter it anneals, the operator it was built with), a step count that is no count, a
    period below one step.

    Example:
        >>> from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
        >>> from torchrl.data.replay_buffers.scheduler import StepScheduler
        >>> rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.4, storage=LazyTensorStorage(4))
        >>> sorted(ParameterSchedulerAdapter().state(StepScheduler(rb, "beta", 1.1, 2), AdapterContext("s")))[:3]
        ['_max_val', '_min_val', '_step_cnt']
    """

    state_is_state_dict = False  # (its state leaves out the functions it was built with)

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return {k: v for k, v in super().state(obj, ctx).items() if not callable(v)}

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        super().validate(obj, saved, ctx)
        live = self.state(obj, ctx)
        for view in saved.values():
            _check_scheduler_state(view, live, type(obj).__name__, ctx.name)


def _check_scheduler_state(view: Any, live: dict[str, Any], kind: str, name: str) -> None:
    """A saved parameter scheduler's state is one this live scheduler's own save writes (else
    :class:`~torchrl_dcp.errors.IncompatibleComponentError`, checked while planning: the load names the file)."""
    from torchrl_dcp.errors import IncompatibleComponentError

    where = f"component {name!r}"
    if not isinstance(view, dict):
        raise IncompatibleComponentError(f"{where}: the checkpoint holds a {type(view).__name__}, not a {kind}'s state")
    other = sorted(set(view) - set(live))
    if other:
        raise IncompatibleComponentError(
            f"{where}: the checkpoint's state holds {other}, which this {kind} keeps no state under (its functions and "
            "its sampler are its own): it was saved by another kind of scheduler, or is damaged"
        )
    for key in ("param_name", "mode"):
        if key in view and view[key] != live.get(key):
            raise IncompatibleComponentError(
                f"{where}: the checkpoint's {kind} has {key}={view[key]!r}, this one {live.get(key)!r} (the parameter "
                "it anneals, the operator it was built with): build it as it was saved"
            )
    for key, least in (("_step_cnt", 0), ("n_steps", 1), ("num_steps", 1)):
        value = view.get(key, least)
        if type(value) is not int or value < least:
            raise IncompatibleComponentError(
                f"{where}: the checkpoint's {kind} holds {key}={value!r}, which no save writes (an integer of at "
                f"least {least}): the checkpoint is damaged or forged"
            )
