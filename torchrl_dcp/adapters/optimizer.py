"""Adapter for ``torch.optim.Optimizer``: its ``state_dict()``, checked against the live optimizer before loading.

Optimizers use ``Optimizer.state_dict()``: the DCP helper ``get_optimizer_state_dict`` was
measured to *initialise* the state of an optimizer that has not stepped yet (it writes
``step``, ``exp_avg``, ... into it), so merely saving would change what training does
next. A load refuses, while planning, what ``load_state_dict`` would refuse later or what
the next ``step`` would fail on: other parameter groups, another kind of optimizer, state
of another model's shapes or of other kinds than a probe optimizer of the same kind
keeps, options torch's constructors refuse.

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import AdapterContext
    >>> opt = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
    >>> sorted(OptimizerAdapter().state(opt, AdapterContext("optim")))
    ['param_groups', 'state']
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.modules import plain_strided
from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.codec import is_dtensor, walk_nodes
from torchrl_dcp.format.manifest_depth import MAPPING_NODES
from torchrl_dcp.format.migrations import skeleton_dict


class OptimizerAdapter(Adapter):
    """``Optimizer.state_dict()`` / ``load_state_dict()`` (state allocated from the checkpoint)."""

    adapter_id = "torchrl_dcp.optimizer"
    state_is_state_dict = True
    version = 1
    shares_tensors = False

    def state(self, obj: torch.optim.Optimizer, ctx: AdapterContext) -> Any:
        return obj.state_dict()

    def destinations(
        self, obj: torch.optim.Optimizer, saved: Any, ctx: AdapterContext
    ) -> dict[str, torch.Tensor] | None:
        """DTensor destinations for state of DTensor (FSDP2) parameters, built from the parameters themselves.

        State the optimizer already holds (it has stepped) is read in place, into its own
        tensors. A freshly built optimizer has no state yet, so no live DTensor to read into: each
        saved per-parameter tensor with its parameter's shape is read into
        ``torch.empty_like(param)`` (the parameter's mesh and placements), which DCP fills
        with this rank's shard, at any world size. Scalars (``step``) and plain
        parameters are left to the checkpoint to allocate.
        """
        return {**_live_state_destinations(obj, saved), **optimizer_destinations(obj, saved)}

    def refused_repeats(self, skeleton: Any) -> list[str]:
        """Every repeated tensor but one hyperparameter tensor shared by several param groups (torch gives each group
        the constructor's ``lr`` tensor, one object: a scheduler's ``fill_`` then moves them all, so it is restored
        shared); none in ``state`` (an ``exp_avg_sq`` that would be its ``exp_avg``), no other component's."""
        refused = []
        for node in walk_nodes(skeleton):
            kind, key = node.get("t"), node.get("key")
            if kind == "xref" or (kind == "alias" and not (isinstance(key, str) and key.startswith("param_groups/"))):
                refused.append(key)
        state = skeleton_dict(skeleton).get("state") if _is_mapping_node(skeleton) else None
        refused += [node.get("key") for node in walk_nodes(state) if node.get("t") == "alias"]
        return refused

    def check_saved(self, saved: Any) -> None:
        """A parameter listed twice, or state for a parameter no group lists, or an option torch's constructors
        refuse: no ``state_dict()`` writes that."""
        _check_param_ids(saved)
        _check_option_values(saved)

    def check_values(self, saved: Any, read: Any) -> None:
        """Each parameter's ``step`` held as a tensor (a scalar) is a finite count ``>= 0``: torch's optimizers
        divide by functions of it (``-1``: a division by zero at the next step; NaN: NaN weights)."""
        from torchrl_dcp.format.codec import TensorSpec

        for pid, entries in (saved.get("state") or {}).items() if isinstance(saved, Mapping) else ():
            step = entries.get("step") if isinstance(entries, Mapping) else None
            if isinstance(step, TensorSpec) and step.shape == () and step.dtype.is_floating_point:
                value = float(read(step))
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"parameter {pid}'s step is {value}: no optimizer step leaves that")

    def validate(self, obj: torch.optim.Optimizer, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Refuses, while planning, what ``load_state_dict`` would refuse after other components were read (other
        parameter groups, other numbers of parameters per group); notes which state tensors will be read in place
        (the snapshot keeps those by reference)."""
        meta = [i for i, p in enumerate(p for g in obj.param_groups for p in g["params"]) if p.is_meta]
        if meta:  # load_state_dict moves the saved state onto the parameters' device: nothing would be kept
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: parameters {meta[:5]} of the optimizer are on the meta device (no memory; "
                "its state would be loaded onto them and lost): materialise the model first (module.to_empty("
                "device=...)), then build the optimizer over its parameters, then load"
            )
        for state in saved.values():
            _check_param_groups(obj, state, ctx.name)
            _check_same_kind(obj, state, ctx.name)
            _check_options_held(obj, state, ctx.name)
            _check_constructible(obj, state, ctx.name)
            _check_group_values(obj, state, ctx.name)
            _check_state_shapes(obj, state, ctx.name)
            ctx.plan["in_place"] = {id(t) for t in _live_state_destinations(obj, state).values()}

    def snapshot(self, obj: torch.optim.Optimizer, ctx: AdapterContext) -> Any:
        """A copy of the state dict in which the state tensors that will be read in place are kept by reference."""
        live = obj.state_dict()
        keep = ctx.plan.get("in_place", set())
        memo = {id(t): t for entries in live["state"].values() for t in entries.values() if id(t) in keep}
        return copy.deepcopy(live, memo)

    def restore(self, obj: torch.optim.Optimizer, state: Any, ctx: AdapterContext) -> Any:
        try:
            obj.load_state_dict(state)
        except (ValueError, KeyError) as err:
            raise IncompatibleComponentError(f"component {ctx.name!r}: {err}") from err
        _keep_saved_state_dtypes(obj, state, scalars_only=type(obj).__module__.startswith("torch.optim"))
        return None


def _keep_saved_state_dtypes(optimizer: torch.optim.Optimizer, saved: Any, *, scalars_only: bool = False) -> None:
    """Give back each state tensor the dtype it was saved with, where ``load_state_dict`` cast it to its
    parameter's (``scalars_only``: the 0-dim ones alone).

    ``Optimizer.load_state_dict`` casts every floating-point state tensor but ``step`` to its parameter's dtype:
    right for torch's own moments (they have the parameter's dtype, so a cast only follows a model whose dtype
    changed), wrong for the scalars some of them keep in float32 whatever the parameter's dtype (NAdam's
    ``mu_product``, ASGD's ``eta`` and ``mu``: a float64 model's NAdam resumed 5.9e-12 off after 27 steps), lossy for
    optimizers that keep their moments in another precision on purpose (torchrl's ``DreamerV3Optimizer``: float32
    moments for bf16 parameters came back as bf16). Torch's own optimizers get their scalars back as saved, others
    every state tensor (on the parameter's device).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved.get("param_groups", ()) for i in g.get("params", ())]
    for pid, param in zip(ids, params):
        saved_state, live_state = saved.get("state", {}).get(pid), optimizer.state.get(param)
        if not isinstance(saved_state, Mapping) or not isinstance(live_state, dict):
            continue
        for key, value in saved_state.items():
            live = live_state.get(key)
            if isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor) and live.dtype != value.dtype:
                if not scalars_only or value.dim() == 0:
                    live_state[key] = value.to(device=live.device)


def _check_param_groups(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise IncompatibleComponentError(f"component {name!r}: the saved optimizer state has no valid param_groups")
    if len(groups) != len(optimizer.param_groups):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint has {len(groups)} parameter groups, the optimizer "
            f"{len(optimizer.param_groups)}: build the optimizer with the parameter groups it was saved with"
        )
    for i, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        if len(saved_group["params"]) != len(group["params"]):
            raise IncompatibleComponentError(
                f"component {name!r}: parameter group {i} holds {len(saved_group['params'])} parameters in the "
                f"checkpoint, {len(group['params'])} in the optimizer: build it with the parameters it was saved with"
            )


@functools.cache
def _builtin_options() -> frozenset[str]:
    """The options (``defaults`` keys) of torch's own optimizers, in the installed torch."""
    found: set[str] = set()
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            try:
                found.update(cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1).defaults)
            except Exception:  # noqa: BLE001 - one that needs other arguments says nothing here
                continue
    return frozenset(found)


def _check_same_kind(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    """The checkpoint's parameter groups hold no option of torch's optimizers that this optimizer neither has nor
    defaults: an Adam checkpoint (``betas``, ``amsgrad``) is not loaded into an SGD (whose ``momentum`` it lacks,
    which ``step`` then needs). Options a newer torch added, or a scheduler's keys (``initial_lr``), never refuse."""
    options = _builtin_options()
    own = set(optimizer.defaults)
    for group in optimizer.param_groups:
        own.update(group)
    foreign = sorted({k for g in saved["param_groups"] for k in g if k in options and k not in own})
    if foreign:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint's optimizer has options {foreign}, which this "
            f"{type(optimizer).__name__} does not: it was saved by another kind of optimizer; build the one it was "
            "saved with (or load without this component: components=[...])"
        )


def _check_options_held(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    """Each saved parameter group holds every option the optimizer's ``step`` reads (an Adam group without ``lr``
    loaded, and the next ``step`` raised ``KeyError``): those of its ``defaults`` the group lacks once the class's
    own ``__setstate__`` (which ``load_state_dict`` runs) has filled what it fills in states of older torch versions,
    run on a bare instance holding the saved groups, and that a probe ``step`` reads (LBFGS reads ``maximize`` with
    a default): :func:`_probe_step_reads`. Not compared: an optimizer whose ``__setstate__`` cannot run so, or with
    ``load_state_dict`` pre-hooks (they may migrate saved options)."""
    if getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None):
        return
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in saved["param_groups"]]
    try:
        probe = object.__new__(type(optimizer))
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {}, "param_groups": groups})
        upgraded = probe.param_groups
    except Exception:  # noqa: BLE001 - nothing to compare against
        return
    for i, (group, live) in enumerate(zip(upgraded, optimizer.param_groups)):
        missing = sorted(set(optimizer.defaults) - set(group))
        read = _probe_step_reads(optimizer, live, missing) if missing else None
        if read:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint's parameter group {i} lacks options {read}, which this "
                f"{type(optimizer).__name__} reads at each step: it was saved by another kind of optimizer (or the "
                "checkpoint is damaged); build the one it was saved with (or load without this component: "
                "components=[...])"
            )


def _check_constructible(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    """torch's own optimizers: each saved group's options are ones its constructor accepts together (``fused`` with
    ``differentiable``: the next ``step`` raised), where it accepts the live group's (a one-element parameter on
    the live parameters' device; options holding tensors, not read yet, as the live group's); and ``capturable``
    only over parameters on a device it supports (the next ``step`` asserts it)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim"):
        return
    accepts = inspect.signature(cls).parameters
    for i, (group, live) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        flag = group.get("capturable")  # (a number is what torch's step reads it as: 1 or 0.5 captures too)
        if (flag is True or (type(flag) in (int, float) and flag)) and live.get("params"):
            _check_capturable(live["params"], i, cls.__name__, name)
        options = {k: v for k, v in group.items() if k in accepts and k != "params" and not _holds_spec(v)}
        if all(_same_option(live.get(k, ...), v) for k, v in options.items()):
            continue  # (the live group's own options)
        try:
            _probe(optimizer, live)
        except Exception:  # noqa: BLE001 - nothing to compare against
            continue
        try:
            _probe(optimizer, {**live, **options})
        except Exception as err:  # noqa: BLE001 - only the saved options differ: they are the cause
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint's parameter group {i} holds options torch's "
                f"{cls.__name__} refuses ({type(err).__name__}: {err}): no save writes them; the checkpoint is "
                "damaged, or was saved by another kind of optimizer (load without this component: components=[...])"
            ) from None


def _check_capturable(params: list[torch.Tensor], i: int, kind: str, name: str) -> None:
    """A capturable group over parameters on a device torch's capturable steps refuse (a CUDA save onto CPU)."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    supported = _get_foreach_kernels_supported_devices()
    off = sorted({p.device.type for p in params if p.device.type not in supported})
    if off:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint's parameter group {i} is capturable (saved over parameters on "
            f"{'/'.join(supported)}), this {kind}'s parameters are on {off}, where its step refuses capturable: "
            "load into an optimizer over parameters on the saved device (or load without this component: "
            "components=[...])"
        )


def _holds_spec(value: Any) -> bool:
    """Whether an option value is, or holds, a tensor not read yet (a :class:`TensorSpec`: tensor ``betas``)."""
    from torchrl_dcp.format.codec import TensorSpec

    if isinstance(value, (list, tuple)):
        return any(_holds_spec(v) for v in value)
    return isinstance(value, TensorSpec)


def _same_option(live: Any, saved: Any) -> bool:
    """Whether a saved option is the live group's own (a JSON list for a tuple; a tensor never compared)."""
    if isinstance(live, torch.Tensor) or isinstance(saved, torch.Tensor):
        return False
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        return len(live) == len(saved) and all(_same_option(a, b) for a, b in zip(live, saved))
    return type(live) is type(saved) and live == saved


def _probe_step_reads(optimizer: torch.optim.Optimizer, live: Mapping[str, Any], missing: list[str]) -> list[str]:
    """Which of ``missing`` a ``step`` of ``optimizer``'s class reads without a default: one step of a new one over a
    one-element parameter (on the live parameters' device) whose group holds the live group's options but
    ``missing`` (the user's own options, never the checkpoint's: a forged ``max_iter`` cannot make it loop), torch's
    step hooks left out (:func:`step_unhooked`); the key of the ``KeyError`` it raises (none when it steps, fails
    otherwise, or cannot be built)."""
    try:
        probe, param = _probe(optimizer, live)
        probe.param_groups[0] = {
            **{k: v for k, v in live.items() if k != "params" and k not in missing},
            "params": [param],
        }

        def closure() -> torch.Tensor:  # (LBFGS calls it; the others take it and call it once)
            probe.zero_grad()
            loss = (param * param).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            step_unhooked(probe, closure)
    except KeyError as err:
        return [key] if (key := err.args[0] if err.args else None) in missing else []
    except Exception:  # noqa: BLE001 - not this check's to judge
        return []
    return []


def _probe(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> tuple[Any, torch.nn.Parameter]:
    """A new optimizer of ``optimizer``'s class over a one-element parameter on the device of ``group``'s
    parameters (the CPU where it holds none), built with the options of ``group`` its constructor takes (AdamW sets
    ``decoupled_weight_decay`` itself); raises what the constructor raises."""
    cls = type(optimizer)
    device = group["params"][0].device if group.get("params") else torch.device("cpu")
    param = torch.nn.Parameter(torch.zeros(1, device=device))
    accepts = inspect.signature(cls).parameters
    return cls([param], **{k: v for k, v in group.items() if k != "params" and k in accepts}), param


def step_unhooked(probe: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``probe.step(closure)`` without the step hooks torch's wrapper runs: a user's global
    ``register_optimizer_step_pre_hook`` must not see a probe the user never built, nor count its step.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1)); p.grad = torch.ones(1)
        >>> step_unhooked(torch.optim.SGD([p], lr=0.5)); p.item()
        0.5
    """
    step = type(probe).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    return (inner or step)(probe, closure) if closure is not None else (inner or step)(probe)


def _check_group_values(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    """Each saved parameter group's options are of the kinds the live group's are (a string for ``lr`` loaded, the
    next ``step`` raised: :func:`~torchrl_dcp.adapters.state_kinds.check_kinds`)."""
    from torchrl_dcp.adapters.state_kinds import check_kinds

    for i, (group, live) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        check_kinds(
            {k: v for k, v in group.items() if k != "params"},
            {k: v for k, v in live.items() if k != "params"},
            f"component {name!r}: parameter group {i}",
        )


#: options of torch's optimizers that are numbers (a tensor ``lr`` too) torch's constructors keep finite and >= 0
_NON_NEGATIVE_OPTIONS = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value")


def _check_option_values(saved: Any) -> None:
    """Torch's own options in the ranges torch's constructors accept (``lr``, ``eps``, ``weight_decay``, ... finite
    numbers ``>= 0``; ``betas`` numbers in ``[0, 1)``): what no optimizer torch builds, nor any schedule of it,
    holds. Raises ``ValueError`` (object-independent: ``verify`` runs it too)."""
    from torchrl_dcp.format.codec import TensorSpec

    for i, group in enumerate(saved["param_groups"]):
        for key in _NON_NEGATIVE_OPTIONS:
            value = group.get(key)
            for v in value if isinstance(value, (list, tuple)) else [value]:  # (Adafactor's eps: a pair, None in it)
                if v is None or isinstance(v, TensorSpec):
                    continue
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"its parameter group {i}'s {key} is {value!r}, which torch's optimizers refuse")
        betas = group.get("betas")
        if betas is not None and not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(isinstance(b, (numbers.Real, TensorSpec)) and not isinstance(b, bool) for b in betas)
            and all(isinstance(b, TensorSpec) or 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"its parameter group {i}'s betas are {betas!r}, which torch's optimizers refuse")
        for key in ("etas", "step_sizes"):  # (Rprop's pairs: the step unpacks two)
            pair = group.get(key)
            if pair is not None and not (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and all(isinstance(b, (numbers.Real, TensorSpec)) and not isinstance(b, bool) for b in pair)
            ):
                raise ValueError(f"its parameter group {i}'s {key} are {pair!r}, which torch's optimizers refuse")


#: torch optimizers whose state tensors are each a scalar or of their parameter's shape
_PER_PARAMETER = frozenset(
    {
        "ASGD",
        "Adadelta",
        "Adagrad",
        "Adam",
        "AdamW",
        "Adamax",
        "Muon",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "SGD",
        "SparseAdam",
    }
)


def _state_keys(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> dict[str, Any] | None:
    """The state this kind of optimizer keeps for a parameter of ``group`` (with its options) after a step, by key:
    found by stepping a new one over a one-element parameter (a scalar state tensor is then told from one of the
    parameter's shape; on the device of ``group``'s parameters); ``None`` when that fails (nothing to compare)."""
    try:
        probe, param = _probe(optimizer, group)
        param.grad = torch.ones_like(param)
        step_unhooked(probe)
    except Exception:  # noqa: BLE001 - an optimizer this cannot build or step: not compared
        return None
    return dict(probe.state[param]) if param in probe.state else {}


def _family(dtype: torch.dtype) -> str:
    """What a scalar state tensor's dtype must stay: torch's ``load_state_dict`` casts floating state (but ``step``) to
    the parameter's dtype, so a float64 ``mu_product`` after a resume is honest; a bool never is."""
    return (
        "bool"
        if dtype == torch.bool
        else "float"
        if dtype.is_floating_point
        else "complex"
        if dtype.is_complex
        else "int"
    )


def _check_state_entry(key: str, saved: Any, probe: Any, param_shape: tuple[int, ...], where: str) -> None:
    """A saved per-parameter state value is of the kind the optimizer keeps there (``probe``: what a new one holds
    after a step): a tensor where it keeps one, a scalar one (``step``) where it keeps a scalar, of that dtype; a
    number where it keeps a number, finite and (a ``step``) not negative."""
    from torchrl_dcp.format.codec import TensorSpec

    if probe is None or saved is None:  # (SGD's momentum buffer: None until its first step with momentum)
        return
    tensor = isinstance(saved, (torch.Tensor, TensorSpec))
    if isinstance(probe, torch.Tensor) != tensor:
        what = "a tensor" if tensor else f"a {type(saved).__name__}"
        raise IncompatibleComponentError(f"{where}: {key!r} is {what} in the checkpoint; this optimizer keeps a "
                                         f"{'tensor' if isinstance(probe, torch.Tensor) else 'number'} there")  # fmt: skip
    if tensor and probe.dim() == 0 and (len(saved.shape) != 0 or _family(saved.dtype) != _family(probe.dtype)):
        raise IncompatibleComponentError(
            f"{where}: {key!r} is a {saved.dtype} tensor of shape {list(saved.shape)} in the checkpoint; this "
            f"optimizer keeps a {probe.dtype} scalar there"
        )
    if tensor and probe.dim() != 0 and len(saved.shape) == 0 and param_shape:
        raise IncompatibleComponentError(
            f"{where}: {key!r} is a scalar tensor in the checkpoint; this optimizer keeps one of the parameter's shape"
        )
    if not tensor and (not isinstance(saved, numbers.Real) or isinstance(saved, bool) or not math.isfinite(saved)
                       or (key == "step" and saved < 0)):  # fmt: skip
        raise IncompatibleComponentError(f"{where}: {key!r} is {saved!r} in the checkpoint: no step leaves that")


def _check_state_shapes(optimizer: torch.optim.Optimizer, saved: Any, name: str) -> None:
    """For torch's per-parameter optimizers: every saved state tensor is a scalar or has its parameter's shape (a
    checkpoint of another model's optimizer is refused before anything changes, not at the next ``step``), and
    each parameter's saved state holds the keys this optimizer keeps (none it does not: Adamax's ``exp_inf`` in an
    Adam; none missing, which its ``step`` would look up: NAdam's ``mu_product``; SGD reads its buffer with
    ``get``)."""
    from torchrl_dcp.format.codec import TensorSpec

    kind = type(optimizer).__name__
    if kind not in _PER_PARAMETER or not type(optimizer).__module__.startswith("torch.optim"):
        return
    states = saved.get("state")
    if not isinstance(states, Mapping):
        return
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    # (the options the load installs: the saved group's, tensor ones, not read yet, as the live group's)
    params = [(p, g, s) for s, g in zip(saved["param_groups"], optimizer.param_groups) for p in g["params"]]
    keys_of: dict[int, set[str] | None] = {}
    for pid, (param, group, saved_group) in zip(ids, params):
        entries = states.get(pid)
        if isinstance(entries, Mapping) and entries:
            expected = keys_of.get(id(group), ...)
            if expected is ...:
                options = {k: v for k, v in saved_group.items() if k != "params" and not _holds_spec(v)}
                expected = keys_of[id(group)] = _state_keys(optimizer, {**group, **options})
            other, missing = set(entries) - set(expected or entries), set(expected or ()) - set(entries)
            if expected and (other or (missing and kind != "SGD")):
                raise IncompatibleComponentError(
                    f"component {name!r}: the checkpoint's state of parameter {pid} holds {sorted(entries)}, this "
                    f"{kind} keeps {sorted(expected)}: it was saved by another kind of optimizer, or with other "
                    "options (amsgrad, momentum, centered); build the one it was saved with (or load without this "
                    "component: components=[...])"
                )
        if torch.nn.parameter.is_lazy(param):  # (a lazy module gets its shapes from the same load)
            continue
        template = keys_of.get(id(group)) if isinstance(keys_of.get(id(group)), dict) else None
        for key, spec in entries.items() if isinstance(entries, Mapping) else ():
            if template is not None:
                where = f"component {name!r}: parameter {pid}'s state"
                _check_state_entry(key, spec, template.get(key), tuple(param.shape), where)
            if isinstance(spec, TensorSpec) and spec.shape and spec.shape != tuple(param.shape):
                raise IncompatibleComponentError(
                    f"component {name!r}: the checkpoint's {key!r} of parameter {pid} has shape {list(spec.shape)}, "
                    f"the parameter {list(param.shape)}: the optimizer was saved for another model; build the model "
                    "it was saved with (or load without this component: components=[...])"
                )


def _check_param_ids(saved: Any) -> None:
    """``Optimizer.state_dict()`` numbers each parameter once, and has state only for listed parameters."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise ValueError("the saved optimizer state has no valid param_groups")
    ids = [p for g in groups for p in g["params"]]
    if not all(type(p) is int for p in ids) or len(set(ids)) != len(ids):
        raise ValueError("its param_groups list a parameter twice (or not by number)")
    state = saved.get("state")
    extra = set(state) - set(ids) if isinstance(state, Mapping) else set()
    if extra:
        raise ValueError(f"its state names parameters {sorted(map(str, extra))} that no parameter group lists")


def optimizer_destinations(optimizer: torch.optim.Optimizer, saved: Any) -> dict[str, torch.Tensor]:
    """``{tensor key: empty DTensor like the parameter}`` for saved state of DTensor parameters.

    ``saved`` is the saved ``state_dict()`` with :class:`~torchrl_dcp.format.codec.TensorSpec` leaves;
    parameters are numbered as ``Optimizer.state_dict()`` numbers them (groups in order).

    Example:
        >>> import torch
        >>> opt = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
        >>> optimizer_destinations(opt, {"state": {}, "param_groups": []})
        {}
    """
    from torchrl_dcp.format.codec import TensorSpec

    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        return {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[str, torch.Tensor] = {}
    for index, entries in saved["state"].items():
        try:
            param = params[int(index)]
        except (ValueError, IndexError):
            continue  # load_state_dict reports the mismatch
        if not is_dtensor(param) or not isinstance(entries, Mapping):
            continue
        for spec in entries.values():
            if isinstance(spec, TensorSpec) and tuple(spec.shape) == tuple(param.shape):
                out[spec.key] = torch.empty_like(param.detach(), dtype=spec.dtype)
    return out


def _live_state_destinations(optimizer: torch.optim.Optimizer, saved: Any) -> dict[str, torch.Tensor]:
    """``{tensor key: the optimizer's own state tensor}`` where it already holds one of the saved shape and dtype."""
    from torchrl_dcp.format.codec import TensorSpec

    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        return {}
    live = optimizer.state_dict()["state"]  # the live tensors, numbered as when saving
    out: dict[str, torch.Tensor] = {}
    for index, entries in saved["state"].items():
        current = live.get(index) if isinstance(index, int) else None
        if not isinstance(entries, Mapping) or not isinstance(current, Mapping):
            continue
        for name, spec in entries.items():
            t = current.get(name)
            if (
                isinstance(spec, TensorSpec)
                and plain_strided(t)
                and (tuple(t.shape), t.dtype) == (spec.shape, spec.dtype)
            ):
                out[spec.key] = t
    return out


def _is_mapping_node(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") in MAPPING_NODES and isinstance(node.get("items"), list)
