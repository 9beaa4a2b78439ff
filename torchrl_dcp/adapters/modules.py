"""Adapter for ``nn.Module`` (optimizers: :mod:`torchrl_dcp.adapters.optimizer`).

Modules go through :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`,
so DDP-wrapped models save without the ``module.`` prefix and FSDP2 models as
DTensors that DCP reshards.

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import ModuleAdapter, AdapterContext
    >>> sorted(ModuleAdapter().state(torch.nn.Linear(2, 1), AdapterContext("policy")))
    ['bias', 'weight']
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.in_place import is_expanded
from torchrl_dcp.errors import EncodingError, IncompatibleComponentError
from torchrl_dcp.format.codec import is_dtensor


class ModuleAdapter(Adapter):
    """``nn.Module`` weights and buffers (DDP / FSDP aware), read straight into the live tensors.

    While a load is planned, :meth:`validate` checks keys, kinds, shapes and dtypes (a float32
    checkpoint is refused by a float16 module rather than cast); every plain
    tensor of the module then receives its bytes in place (after the checkpoint's files
    were verified), so a load needs no second copy of the weights. DTensors (FSDP2) are
    read into fresh shards and copied by ``set_model_state_dict``.
    """

    adapter_id = "torchrl_dcp.module"
    version = 1

    def state(self, obj: torch.nn.Module, ctx: AdapterContext) -> Any:
        state = model_state(obj)
        lazy = [k for k, v in state.items() if torch.nn.parameter.is_lazy(v)]
        if lazy:
            raise EncodingError(
                f"component {ctx.name!r}: {lazy[:3]} {'are' if len(lazy) > 1 else 'is'} not initialised yet (a lazy "
                "module, e.g. LazyLinear or torchrl's MLP without in_features, before its first forward): run one "
                "forward pass, or give the module its input sizes, before saving. Loading into such a module works: "
                "the load gives it the saved shapes"
            )
        for key, t in state.items():
            if type(t) in _PLAIN and is_expanded(t):
                raise EncodingError(_expanded_message(ctx.name, key, t, "a load could never write into it"))
        return state

    def validate(self, obj: torch.nn.Module, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Keys, kinds, shapes and dtypes (a load never casts), before anything changes; notes which tensors will be
        read in place."""
        # reused by the load's later steps; the tensors themselves (not detached views: 0.4 ms instead of 2.2 ms on
        # 5,000 tensors), only ever written by address or through ``.detach()``
        current = ctx.plan["current"] = model_state(obj, keep_vars=True)
        for state in saved.values():
            ctx.plan["in_place"] = _check_values(current, state, ctx.name)
            _check_keys(current, state, ctx, _unset_buffers(obj, current, state))

    def destinations(self, obj: torch.nn.Module, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        """The module's own tensors, for every saved tensor of the same shape and dtype (read in place)."""
        current = _current(obj, ctx)
        keys = ctx.plan.get("in_place")
        if keys is None:
            keys = _in_place_keys(current, saved)
        return {saved[k].key: current[k] for k in keys}

    def snapshot(self, obj: torch.nn.Module, ctx: AdapterContext) -> Any:
        """Tensors that will be read in place are kept by reference (never copied); the others are copied."""
        keys = ctx.plan.get("in_place", set())
        return {k: v if k in keys else copy.deepcopy(v) for k, v in _current(obj, ctx).items()}

    def restore(self, obj: torch.nn.Module, state: Any, ctx: AdapterContext) -> Any:
        current = _current(obj, ctx)
        _check_values(current, state, ctx.name)  # load_state_dict would fail half-way, with some tensors copied
        unset = _unset_buffers(obj, current, state)
        _check_keys(current, state, ctx, unset)
        for key, (owner, leaf) in unset.items():  # torch's load_state_dict skips a buffer slot holding None
            value = state[key]
            if not isinstance(value, torch.Tensor) or is_dtensor(value):
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: {key!r} is a {type(value).__name__} in the checkpoint, an unset buffer "
                    "in the module"
                )
            plain = leaf not in owner._buffers  # a plain attribute holding None (REDQLoss's)
            if plain:
                delattr(owner, leaf)
            owner.register_buffer(leaf, value.detach().clone())
            ctx.plan.setdefault("filled", []).append((owner, leaf, plain))
        rest = {k: v for k, v in state.items() if k not in unset and not _read_in_place(current.get(k), v)}
        if rest:
            set_model_state_dict(obj, rest, options=StateDictOptions(strict=False))
        return None

    def rollback(self, obj: torch.nn.Module, snapshot: Any, ctx: AdapterContext) -> None:
        """Restore the snapshot, and empty again the buffer slots the load filled."""
        for owner, leaf, plain in ctx.plan.pop("filled", ()):
            if plain:
                del owner._buffers[leaf]
                object.__setattr__(owner, leaf, None)
            else:
                owner._buffers[leaf] = None
        self.restore(obj, snapshot, ctx)


#: module classes that rename state-dict keys or shard them: their state goes through DCP's helper
_WRAPPERS = frozenset(
    {"DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule", "OptimizedModule", "CheckpointWrapper",
     "OffloadWrapper", "ActivationWrapper"}
)  # fmt: skip


def model_state(obj: torch.nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """The module's state dict as DCP's ``get_model_state_dict`` gives it (no ``module.`` prefixes, FSDP aware).

    A module with no wrapper inside (DDP, FSDP, ``torch.compile``, activation checkpointing)
    and no DTensor has exactly ``obj.state_dict()``: taken directly, 4x faster on 5,000 tensors
    (the helper maps every key through the module tree). ``keep_vars``: the parameters themselves
    rather than detached tensors (``state_dict(keep_vars=True)``; the helper's values are detached).
    """
    for module in obj.modules():
        if any(c.__name__ in _WRAPPERS for c in type(module).__mro__):
            return get_model_state_dict(obj)
    state = obj.state_dict(keep_vars=keep_vars)
    if any(is_dtensor(v) for v in state.values()):
        return get_model_state_dict(obj)
    return state


def _expanded_message(name: str, key: str, t: torch.Tensor, why: str) -> str:
    return (
        f"component {name!r}: {key!r} is an expanded view (shape {list(t.shape)}, stride {list(t.stride())}: several "
        f"of its elements are one memory location), so {why} (torch's load_state_dict refuses to write into it); "
        "give it its own memory (e.g. register_buffer(name, value.expand(...).clone())), or register it with "
        "persistent=False if it is derived from other state"
    )


def _current(obj: torch.nn.Module, ctx: AdapterContext) -> dict[str, Any]:
    """The module's state dict: the one :meth:`ModuleAdapter.validate` took for this load (the module's tensors,
    by reference; a load never replaces them), else a new one."""
    current = ctx.plan.get("current")
    return model_state(obj) if current is None else current


def _read_in_place(live: Any, value: Any) -> bool:
    """Whether ``value`` is the live tensor itself (read in place: nothing left to copy)."""
    return value is live or _same_tensor(live, value)


def _in_place_keys(current: Mapping[str, Any], saved: Any) -> set[str]:
    """State keys whose live tensor can receive the saved tensor's bytes where it is (same shape and dtype)."""
    from torchrl_dcp.format.codec import TensorSpec

    keys = set()
    for key, spec in saved.items() if isinstance(saved, Mapping) else ():
        live = current.get(key)
        if (
            type(spec) is TensorSpec
            and plain_strided(live)
            and live.shape == spec.shape  # torch.Size and tuple compare as tuples
            and live.dtype == spec.dtype
        ):
            keys.add(key)
    return keys


def plain_strided(t: Any) -> bool:
    """A plain strided tensor (no DTensor, quantized or sparse): DCP can fill it where it is."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``b`` is ``a`` itself (read in place). Only plain tensors: a DTensor's ``data_ptr`` says nothing."""
    return (
        plain_strided(a)
        and plain_strided(b)
        and a.numel() > 0
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _unset_buffers(
    obj: torch.nn.Module, current: Mapping[str, Any], state: Any
) -> dict[str, tuple[torch.nn.Module, str]]:
    """The saved keys the module's state lacks whose slot in the module holds ``None`` (a persistent buffer, or a
    plain attribute): a buffer the module registers lazily (torchrl's ``REDQLoss.target_entropy_buffer``, a plain
    ``None`` until its first forward), which the load registers with the saved tensor. A parameter slot holding
    ``None`` (``Linear(bias=False)``) is not one. ``{key: (owning module, its name)}``."""
    if not isinstance(state, Mapping) or state.keys() == current.keys():
        return {}
    out = {}
    for key in state.keys() - current.keys():
        parts = str(key).split(".")
        if not all(p.isidentifier() or p.isdigit() for p in parts) or parts[-1] in _MODULE_ATTRIBUTES:
            continue  # ("a..b", ".x": no state key; torch's own attributes, e.g. _is_full_backward_hook: never state)
        prefix, _, leaf = str(key).rpartition(".")
        try:
            owner = obj.get_submodule(prefix) if prefix else obj
        except AttributeError:
            continue
        buffers = getattr(owner, "_buffers", {})
        if leaf in buffers:
            if buffers[leaf] is None and leaf not in owner._non_persistent_buffers_set:
                out[key] = (owner, leaf)
        elif leaf in vars(owner) and vars(owner)[leaf] is None and leaf not in owner._parameters:
            out[key] = (owner, leaf)
    return out


def _check_keys(current: Mapping[str, Any], state: Any, ctx: AdapterContext, unset: Mapping[str, Any] = {}) -> bool:
    """Refuse differing key sets unless ``load_kwargs={"strict": False}`` (``unset``: saved keys of buffer slots
    the module has not set yet, which the load sets); returns whether loading is strict."""
    strict = bool((ctx.options.load_kwargs or {}).get("strict", True))
    if strict and isinstance(state, Mapping) and state.keys() != current.keys():
        expected = set(current) | set(unset)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            lazy = [k for k in (*missing, *unexpected) if k.split(".")[0] == "_value_estimator"]
            hint = (
                "the loss builds its value estimator lazily, at its first call: call loss.make_value_estimator() "
                "(with the same arguments as when it was saved) before loading"
                if lazy
                else "pass CheckpointOptions(load_kwargs={'strict': False}) to load the common keys"
            )
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: state_dict keys differ (missing in checkpoint: {missing[:5]}, "
                f"not in module: {unexpected[:5]}); {hint}"
            )
    return strict


def _check_values(current: Mapping[str, Any], state: Any, name: str) -> set[str]:
    """Refuse, before anything is copied, a state whose values cannot be copied into the module's tensors.

    While a load is planned (:class:`TensorSpec` values), also returns the keys whose live tensor can receive the
    saved bytes where it is (:func:`_in_place_keys`, computed in the same pass)."""
    from torchrl_dcp.format.codec import TensorSpec

    if not isinstance(state, Mapping):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds a {type(state).__name__}, not a state_dict"
        )
    in_place = set()
    for key, value in state.items():
        target = current.get(key)
        if target is None or target is value:
            continue
        if type(target) not in _PLAIN and _taken_by_module(key, target):  # plain tensors: never (and fast)
            continue
        spec = type(value) is TensorSpec
        if not spec and not isinstance(value, (torch.Tensor, TensorSpec)):  # TensorSpec: while the load is planned
            raise IncompatibleComponentError(
                f"component {name!r}: {key!r} is a {type(value).__name__} in the checkpoint, a tensor in the module"
            )
        if tuple(value.shape) != tuple(target.shape):
            raise IncompatibleComponentError(
                f"component {name!r}: {key!r} has shape {tuple(value.shape)} in the checkpoint, "
                f"{tuple(target.shape)} in the module"
            )
        if value.dtype != target.dtype:  # set_model_state_dict would cast, silently and possibly lossily
            raise IncompatibleComponentError(
                f"component {name!r}: {key!r} is {value.dtype} in the checkpoint, {target.dtype} in the module: "
                f"a load restores exactly, it does not cast; load into a module of the saved dtype "
                f"(built as saved, or module.to({value.dtype})), then cast it (module.to({target.dtype}))"
            )
        if is_expanded(target):  # (before anything is copied: it would fail half-way)
            raise IncompatibleComponentError(_expanded_message(name, key, target, "nothing can be loaded into it"))
        if spec and plain_strided(target):
            in_place.add(key)
    return in_place


_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: what every module has, by class or instance (torch's own attributes, some None): never a lazily set buffer
_MODULE_ATTRIBUTES = frozenset(dir(torch.nn.Module())) | frozenset(vars(torch.nn.Module()))
_EXTRA_STATE = "_extra_state"  # torch's key suffix for what ``get_extra_state()`` returns (any value)


def _taken_by_module(key: str, target: Any) -> bool:
    """Entries the module's own ``load_state_dict`` takes as they are: its extra state (``set_extra_state``, any
    value) and not yet initialised lazy parameters (``LazyLinear`` before its first forward: shaped by the load)."""
    return key.endswith(_EXTRA_STATE) or torch.nn.parameter.is_lazy(target)


def networks_left_out(components: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{name: ["attribute (Class)", ...]}`` of the torchrl value estimators among ``components`` (``GAE``,
    ``TD0Estimator``, ``TDLambdaEstimator``, ``VTrace``, ...) whose networks, held outside their module tree
    (``value_network`` is a plain attribute: an estimator's ``state_dict()`` holds ``gamma`` and ``lmbda`` only),
    no module among ``components`` holds (the network itself, or a loss holding it). Registered alone, such an
    estimator resumes with the fresh network's weights; registered with its network, it is exact.

    Example:
        >>> from torchrl.objectives.value import GAE
        >>> from tensordict.nn import TensorDictModule
        >>> net = TensorDictModule(torch.nn.Linear(3, 1), ["obs"], ["v"])
        >>> gae = GAE(gamma=0.99, lmbda=0.95, value_network=net)
        >>> networks_left_out({"est": gae}), networks_left_out({"est": gae, "critic": net})
        ({'est': ['value_network (TensorDictModule)']}, {})
    """
    try:
        from torchrl.objectives.value import ValueEstimatorBase
    except ImportError:  # pragma: no cover - torchrl is a dependency
        return {}
    estimators = {n: v for n, v in components.items() if isinstance(v, ValueEstimatorBase)}
    if not estimators:
        return {}
    held = {
        (t.data_ptr(), t.numel())
        for v in components.values()
        if isinstance(v, torch.nn.Module)
        for t in v.state_dict().values()
        if isinstance(t, torch.Tensor) and t.numel()
    }
    out: dict[str, list[str]] = {}
    for name, estimator in estimators.items():
        for attr, net in vars(estimator).items():
            if isinstance(net, torch.nn.Module):
                tensors = [t for t in net.state_dict().values() if isinstance(t, torch.Tensor) and t.numel()]
                if any((t.data_ptr(), t.numel()) not in held for t in tensors):
                    out.setdefault(name, []).append(f"{attr} ({type(net).__name__})")
    return out


def warn_networks_left_out(components: Mapping[str, Any], action: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` per value estimator :func:`networks_left_out` names."""
    import warnings

    from torchrl_dcp._log import user_stacklevel
    from torchrl_dcp.errors import InexactResumeWarning

    for name, left in networks_left_out(components).items():
        warnings.warn(
            f"component {name!r} ({action}): {', '.join(left)} is held outside its module tree (torchrl keeps a "
            "value estimator's network as a plain attribute) and no registered module holds its weights: a load "
            "leaves the fresh network's. Register the network (or the loss module holding it) too",
            InexactResumeWarning,
            stacklevel=user_stacklevel(),
        )
