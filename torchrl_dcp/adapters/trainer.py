"""What a torchrl ``Trainer`` registers by name: placements, hooks / loggers that reshard, the Trainer's counters.

A ``Trainer`` bound to a checkpoint registers its hooks as ``trainer_module.<name>``
and its ``logger``. Their state is small and of two kinds (torchrl 0.14.1,
``torchrl/trainers/trainers.py``):

- **the replicated learner's**: ``LRSchedulerHook`` (scheduler of the replicated
  optimizer), ``OptimizerHook`` (the optimizer), ``ValueEstimatorHook`` (the loss's
  value estimator): identical on every rank, placed ``replicated`` (checked to be
  identical at save, loadable at any world size);
- **each rank's own**: counters (``UpdateWeights``, ``CountFramesLog``,
  ``ClearCudaCache``, ``LogValidationReward``), ``RewardNormalizer`` statistics of the
  rank's own rewards, logging settings, and the logger's run name, directory and
  counters: placed ``per_rank``. After a world-size change new rank ``r`` takes the
  state of saved rank ``r % saved_world_size`` (:class:`TrainerHookAdapter`), as
  collectors and RNG streams do.

Example:
    >>> from torchrl.trainers.trainers import CountFramesLog, LRSchedulerHook
    >>> trainer_placement("trainer_module.count_frames_log")
    'per_rank'
    >>> trainer_placement("policy") is None
    True
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.env_generators import env_generators, generator_state, set_generator_state
from torchrl_dcp.adapters.registry import register_adapter
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.adapters.trainer_rank_state import (
    LAST_LOG_ELSEWHERE,
    TrainerRankState,
    check_rank_state,
    restore_logger_state,
)
from torchrl_dcp.errors import CheckpointIntegrityError, IncompatibleComponentError, TorchrlDcpWarning
from torchrl_dcp.placement import Placement

__all__ = [
    "BufferHookAdapter",
    "OfflineToOnlineHookAdapter",
    "ReplayBufferTrainerHookAdapter",
    "TrainerHookAdapter",
    "TrainerStateAdapter",
    "replicated_hook_types",
    "trainer_placement",
]

#: the names ``Trainer._sync_checkpoint_components`` registers hooks and the logger under
HOOK_PREFIX = "trainer_module."
OP_HOOK_PREFIX = "trainer_op."  # a hook only trainer.register_op reaches (trainer_binding.register_op_hooks)
LOGGER = "logger"


def replicated_hook_types() -> tuple[type, ...]:
    """Hook types whose state belongs to the replicated learner (identical on every rank)."""
    from torchrl.trainers.trainers import LRSchedulerHook, OptimizerHook, ValueEstimatorHook

    return (LRSchedulerHook, OptimizerHook, ValueEstimatorHook)


def trainer_placement(name: str, component: Any = None) -> Placement | None:
    """Placement of what a ``Trainer`` registers as ``name`` (``None``: decide by the component's type).

    ``trainer_module.<hook>``, ``trainer_op.<Class>`` (a hook only ``register_op`` reaches) and ``logger`` are
    ``per_rank`` unless ``component`` is a hook
    holding the replicated learner's state (:func:`replicated_hook_types`), which is
    ``replicated``. Without ``component`` the answer is ``per_rank`` (always safe at the same
    world size; resharded by :class:`TrainerHookAdapter`).

    Example:
        >>> import torch
        >>> from torchrl.trainers.trainers import LRSchedulerHook
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> trainer_placement("trainer_module.lr_scheduler", LRSchedulerHook(torch.optim.lr_scheduler.StepLR(opt, 5)))
        'replicated'
    """
    hook = name.startswith((HOOK_PREFIX, OP_HOOK_PREFIX))
    if not (hook or name == LOGGER):
        return None
    if component is not None and hook and isinstance(component, replicated_hook_types()):
        return "replicated"
    return "per_rank"


#: Attributes torchrl hooks compute lazily and their ``state_dict`` leaves out, by hook class name: computing them
#: again after a restore would change what training does (``OfflineToOnlineReplayBufferHook`` finds its offline
#: keys with ``offline.sample(1)``, a draw from the global RNG stream the uninterrupted run made only once).
LAZY_HOOK_ATTRIBUTES: dict[str, tuple[str, ...]] = {"OfflineToOnlineReplayBufferHook": ("_offline_keys",)}
#: Trainer attributes torchrl's ``trainer_state`` (collected frames, last log and save, optimisation steps) leaves
#: out, by Trainer class name: ``DQNTrainer._greedy_last_frames`` is where epsilon annealing continues from (without
#: it, the first iteration after a restore anneals epsilon by every frame collected so far, a second time).
#: ``Trainer._stop_training`` and its reason: a Trainer stopped early (``EarlyStopping``, ``request_stop``) saves once
#: more and leaves ``train()``; resumed from that save, it trained again where the run that never stopped had ended.
TRAINER_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "DQNTrainer": ("_greedy_last_frames",),
    "Trainer": ("_stop_training", "_stop_reason"),
}
#: counters of torchrl's Trainer state and hooks (by class name for hooks): ints ``>= 0`` in every run
TRAINER_COUNTERS = ("collected_frames", "_last_save", "_optim_count", "_greedy_last_frames")
HOOK_COUNTERS: dict[str, tuple[str, ...]] = {"CountFramesLog": ("frame_count",), "ClearCudaCache": ("count",)}
LAZY_KEY = "_tdcp_lazy_attributes"  # where the state dict carries them
#: where an ``EarlyStopping`` hook's state holds the last value logged under its metric: ``Trainer._log_dict`` keeps
#: every value logged (a history that grows with training, each rank's own: not saved), and the hook reads the last
#: one, which a resume between validation iterations left absent (``train()`` then stopped with torchrl's error)
MONITORED_KEY = "_tdcp_monitored_last"


def _check_counts(state: Any, keys: tuple[str, ...], name: str) -> None:
    """Each of ``keys`` that ``state`` holds is an int ``>= 0`` (a count; never ``None``: torchrl's counters start at
    0), else :class:`IncompatibleComponentError`."""
    for key in keys if isinstance(state, Mapping) else ():
        value = state.get(key)
        if key in state and (type(value) is not int or value < 0):
            raise IncompatibleComponentError(
                f"component {name!r}: its {key!r} is {value!r}, not a count: no run leaves that; damaged or forged"
            )


def _attributes_of(obj: Any, table: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The attributes ``table`` lists for ``obj``'s class or any base class (by name)."""
    return tuple(a for klass in type(obj).__mro__ for a in table.get(klass.__name__, ()))


def _with_attributes(state: Any, obj: Any, attributes: tuple[str, ...]) -> Any:
    present = [a for a in attributes if hasattr(obj, a)]
    if present and isinstance(state, Mapping):
        return {**state, LAZY_KEY: {a: getattr(obj, a) for a in present}}
    return state


def _split_attributes(state: Any) -> tuple[Any, Mapping[str, Any]]:
    if isinstance(state, Mapping) and LAZY_KEY in state:
        return {k: v for k, v in state.items() if k != LAZY_KEY}, state[LAZY_KEY]
    return state, {}


def _set_attributes(obj: Any, values: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for attr, value in values.items():
        if attr in allowed:  # only what the table names is ever set from a checkpoint
            setattr(obj, attr, value)


def _monitored_last(hook: Any) -> dict[str, Any] | None:
    """``{"monitor", "value"}``: the last value logged under an ``EarlyStopping`` hook's metric (a number or a
    one-element tensor, what it reads), or ``None``."""
    import torch

    monitor, trainer = getattr(hook, "monitor", None), getattr(hook, "_trainer", None)
    logged = getattr(trainer, "_log_dict", None)
    if type(hook).__name__ != "EarlyStopping" or not isinstance(monitor, str) or not isinstance(logged, Mapping):
        return None
    values = logged.get(monitor)
    if not values:
        return None
    value = values[-1]
    if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, (torch.Tensor, int, float)):
        return None
    if isinstance(value, bool):
        value = int(value)
    return {"monitor": monitor, "value": value}


def _restore_monitored_last(hook: Any, saved: Any, name: str) -> None:
    """Put the saved last value of the hook's metric back into its Trainer's log: a number or a one-element tensor
    (what :func:`_monitored_last` saves) under the metric the hook monitors, else refused."""
    import torch

    value = saved.get("value") if isinstance(saved, Mapping) else None
    scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (scalar or isinstance(value, torch.Tensor) and value.numel() == 1) or saved.get("monitor") != getattr(
        hook, "monitor", None
    ):
        raise IncompatibleComponentError(
            f"component {name!r}: the saved last value of the monitored metric is not a number of metric "
            f"{getattr(hook, 'monitor', None)!r}, which no save writes: the checkpoint is damaged or forged, or the "
            "hook monitors another metric than when it was saved (build it as it was)"
        )
    trainer = getattr(hook, "_trainer", None)
    logged = getattr(trainer, "_log_dict", None)
    if isinstance(logged, dict):  # (a hook not registered on a Trainer yet has none to fill)
        logged[saved["monitor"]] = [value]


class TrainerStateAdapter(StateDictAdapter):
    """torchrl's ``trainer_state`` (the Trainer's counters) plus the attributes :data:`TRAINER_ATTRIBUTES` names.

    The payload is the generic state-dict adapter's (same id and version), with the extra attributes under one
    more key; checkpoints saved without them load as before.

    Example:
        >>> TRAINER_ATTRIBUTES["DQNTrainer"]
        ('_greedy_last_frames',)
    """

    #: what ``torchrl.checkpoint`` saves (``trainer_state``'s ``state_dict()``) is a state of ours without the extra
    #: attributes (restored as saved, the attributes left as they are): an import runs the counters' checks on it
    state_is_state_dict = True

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        trainer = getattr(obj, "trainer", None)
        state = super().state(obj, ctx)
        if isinstance(state, Mapping) and "_last_log" in state:  # each rank's own: saved in ``trainer_rank_state``
            state = {**state, "_last_log": {}, LAST_LOG_ELSEWHERE: True}
        state = _with_attributes(state, trainer, _attributes_of(trainer, TRAINER_ATTRIBUTES))
        if getattr(trainer, "_tdcp_preempted", False) and isinstance(state, Mapping) and LAZY_KEY in state:
            # a preemption's stop request (the rotation's): the run that never stopped went on, as the requeued
            # job must; only a stop of the job's own (EarlyStopping, request_stop) is saved
            state = {**state, LAZY_KEY: {**state[LAZY_KEY], "_stop_training": False, "_stop_reason": None}}
        return state

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Also: the Trainer's counters are counts (ints ``>= 0``), as every run leaves them."""
        super().validate(obj, saved, ctx)
        for state in saved.values():
            state, extra = _split_attributes(state)
            _check_counts(state, TRAINER_COUNTERS, ctx.name)
            _check_counts(extra, TRAINER_COUNTERS, ctx.name)
            stop, reason = extra.get("_stop_training", False), extra.get("_stop_reason")
            if type(stop) is not bool or not (reason is None or isinstance(reason, str)):
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: its stop request is {stop!r} (reason {reason!r}), not a flag and a "
                    "text: no run leaves that; damaged or forged"
                )

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        """The state with the Trainer's ``_last_log`` itself (a save keeps it in ``trainer_rank_state``): a rollback
        puts it back even where nothing else does (an import of torchrl's ``trainer_state``, which holds it)."""
        snap = super().snapshot(obj, ctx)
        if isinstance(snap, Mapping) and snap.get(LAST_LOG_ELSEWHERE) is True:
            snap = {k: v for k, v in snap.items() if k != LAST_LOG_ELSEWHERE}
            snap["_last_log"] = copy.deepcopy(getattr(getattr(obj, "trainer", None), "_last_log", None) or {})
        return snap

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        state, extra = _split_attributes(state)
        trainer = getattr(obj, "trainer", None)
        if isinstance(state, Mapping) and state.get(LAST_LOG_ELSEWHERE) is True:  # (``trainer_rank_state`` restores it:
            state = {k: v for k, v in state.items() if k != LAST_LOG_ELSEWHERE}  # kept, before or after)
            state["_last_log"] = getattr(trainer, "_last_log", None) or {}
        out = super().restore(obj, state, ctx)
        _set_attributes(trainer, extra, _attributes_of(trainer, TRAINER_ATTRIBUTES))
        return out


class TrainerHookAdapter(StateDictAdapter):
    """``state_dict`` / ``load_state_dict`` of Trainer hooks and loggers, reshardable.

    The payload is the generic state-dict adapter's (same id and version: checkpoints
    saved before load unchanged). After a world-size change, new rank ``r`` loads the
    state saved by rank ``r % saved_world_size`` (counters, normaliser statistics,
    logger run name and directory continue from that rank's).
    """

    default_placement = "per_rank"
    can_reshard = True

    #: what ``torchrl.checkpoint`` saves of a hook (its ``state_dict()``) is a state of ours without the lazy
    #: attributes, env generators and monitor entry (each left as it is): an import runs the counters' checks on it
    state_is_state_dict = True

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        state = _with_attributes(super().state(obj, ctx), obj, _attributes_of(obj, LAZY_HOOK_ATTRIBUTES))
        generators = _env_generator_states(obj)
        if generators and isinstance(state, Mapping):
            state = {**state, ENV_RNG_KEY: generators}
        monitored = _monitored_last(obj)
        if monitored is not None and isinstance(state, Mapping):
            state = {**state, MONITORED_KEY: monitored}
        return state

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Also: a torchrl hook's counters (:data:`HOOK_COUNTERS`) are counts."""
        super().validate(obj, saved, ctx)
        counters = _attributes_of(obj, HOOK_COUNTERS)
        for state in saved.values():
            _check_counts(state, counters, ctx.name)
            if isinstance(obj, TrainerRankState):
                check_rank_state(state, obj, ctx.name)

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        if restore_logger_state(obj, state, ctx.name):  # (saved by a rank without a logger: nothing to restore)
            return None
        _warn_other_run(obj, state, ctx.name)
        generators = state.get(ENV_RNG_KEY) if isinstance(state, Mapping) else None
        if generators is not None:
            state = {k: v for k, v in state.items() if k != ENV_RNG_KEY}
        monitored = state.get(MONITORED_KEY) if isinstance(state, Mapping) else None
        if monitored is not None:
            state = {k: v for k, v in state.items() if k != MONITORED_KEY}
        state, extra = _split_attributes(state)
        out = super().restore(obj, state, ctx)
        _set_attributes(obj, extra, _attributes_of(obj, LAZY_HOOK_ATTRIBUTES))
        if generators is not None:
            _restore_env_generators(obj, generators, ctx.name)
        if monitored is not None:
            _restore_monitored_last(obj, monitored, ctx.name)
        return out

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return [ctx.rank % (ctx.saved_world_size or len(saved) or 1)]

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        """Saved rank ``rank % saved_world_size``'s state, but not the generators of the envs a hook runs (as a
        collector's): two new ranks taking one saved rank's would draw the same streams."""
        (state,) = states.values()
        if isinstance(state, Mapping) and ENV_RNG_KEY in state:
            state = {k: v for k, v in state.items() if k != ENV_RNG_KEY}
        return self.restore(obj, state, ctx)


ENV_RNG_KEY = "_tdcp_env_generators"  # where a hook's state holds the generators of the envs it runs


def _warn_other_run(logger: Any, state: Any, name: str) -> None:
    """A torchrl ``Logger`` restores its counters, not its run: ``load_state_dict`` leaves ``exp_name`` and
    ``log_dir`` as built (its writer already opened there), so a resumed job logs to another run unless it is built
    with the saved ones. Said, naming both."""
    if not (isinstance(state, Mapping) and "exp_name" in state and hasattr(logger, "exp_name")):
        return
    import os

    live_dir = getattr(logger, "log_dir", None)
    live = (logger.exp_name, None if live_dir is None else os.path.abspath(live_dir))
    saved = (state.get("exp_name"), state.get("log_dir"))
    if live != saved:
        warnings.warn(
            f"component {name!r}: the checkpoint's run was {saved[0]!r} in {saved[1]!r}, this logger writes "
            f"{live[0]!r} in {live[1]!r}: its counters are restored, its run is not (torchrl's loggers keep the "
            "run they were built with); build the logger with exp_name and log_dir as saved to continue that run",
            TorchrlDcpWarning,
            stacklevel=2,
        )


def _hook_envs(obj: Any) -> dict[str, Any]:
    """The envs a hook holds as attributes (``LogValidationReward.environment``)."""
    from torchrl.envs import EnvBase

    return {name: value for name, value in vars(obj).items() if isinstance(value, EnvBase)}


def _env_generator_states(obj: Any) -> dict[str, dict[str, Any]]:
    """``{attribute: {generator path: state}}`` of the hook's envs: their ``state_dict`` holds transforms only, so
    a validation env's ``PendulumEnv.rng`` started again from its seed after a restore (other rewards logged)."""
    out = {}
    for name, env in _hook_envs(obj).items():
        found = {path: generator_state(g) for path, g in env_generators(env).items()}
        if found:
            out[name] = found
    return out


def _restore_env_generators(obj: Any, saved: Mapping[str, Mapping[str, Any]], name: str) -> None:
    envs = _hook_envs(obj)
    for attr, states in saved.items():
        live = env_generators(envs[attr]) if attr in envs else {}
        missing = sorted(set(states) - set(live))
        if missing:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the state of generators {missing[:3]} of its env "
                f"{attr!r}, which this hook's env lacks: build the hook's env as it was saved"
            )
        for path, state in states.items():
            set_generator_state(live[path], state)


def register_trainer_adapters() -> None:
    """:class:`TrainerHookAdapter` for every ``TrainerHookBase`` and torchrl ``Logger``, :class:`TrainerStateAdapter`
    for the Trainer's ``trainer_state`` (a private torchrl class: skipped where a torchrl version lacks it)."""
    from torchrl.record.loggers import Logger
    from torchrl.trainers import trainers

    adapter = TrainerHookAdapter()
    for klass in (trainers.TrainerHookBase, Logger):
        register_adapter(klass, adapter)  # by type only: the id stays the generic state-dict adapter's
    state_type = getattr(trainers, "_TrainerCheckpointState", None)
    if isinstance(state_type, type):
        register_adapter(state_type, TrainerStateAdapter())
    from torchrl.trainers.algorithms.offline_to_online import OfflineToOnlineReplayBufferHook

    register_adapter(OfflineToOnlineReplayBufferHook, OfflineToOnlineHookAdapter())
    register_adapter(trainers.ReplayBufferTrainer, ReplayBufferTrainerHookAdapter())


ONLINE_KEY = "_tdcp_online_buffer"  # where an OfflineToOnlineReplayBufferHook's state holds its online buffer's
BUFFER_KEY = "_tdcp_buffer"  # where a ReplayBufferTrainer's state holds its buffer's


class BufferHookAdapter(TrainerHookAdapter):
    """A Trainer hook holding a replay buffer: the buffer through the replay-buffer adapter (written rows read in
    place, prioritized trees, sampler, writer, last cursor; resharded like any buffer) under :attr:`key`, beside the
    hook's own values (:meth:`extra`). Same id and version as the generic adapter: states saved by torchrl's
    ``state_dict`` load as before. Subclasses name the buffer (:meth:`buffer_of`) and the values."""

    key = BUFFER_KEY
    allocates_when_planned = True  # the buffer's storage, as the replay buffer's
    #: torchrl's ``state_dict`` of such a hook says nothing the checks could read before: checked once restored
    #: (:meth:`_check_restored`, rolled back if it fails)
    state_is_state_dict = False
    reshard_shares_out = True  # (its transitions, as the replay buffer's)

    def __init__(self) -> None:
        from torchrl_dcp.adapters.replay_buffer import ReplayBufferAdapter

        self.buffer = ReplayBufferAdapter()

    def buffer_of(self, obj: Any) -> Any:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def extra(self, obj: Any) -> dict[str, Any]:
        """The hook's values beside its buffer (none by default)."""
        return {}

    def restore_extra(self, obj: Any, state: Mapping[str, Any]) -> None:
        return None

    def _ours(self, state: Any) -> bool:
        return isinstance(state, Mapping) and self.key in state

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return {self.key: self.buffer.state(self.buffer_of(obj), ctx), **self.extra(obj)}

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True  # (the buffer's rollback puts its settings back from here on)
        if not self._ours(state):
            super().restore(obj, state, ctx)  # torchrl's own state_dict (saved before this adapter)
            self._check_restored(obj, ctx)
            return None
        self.buffer.restore(self.buffer_of(obj), state[self.key], ctx)
        self.restore_extra(obj, state)
        return None

    def _check_restored(self, obj: Any, ctx: AdapterContext) -> None:
        """A hook restored from torchrl's own ``state_dict`` (its layout says nothing the checks could read before):
        its buffer as restored, and its values, pass the checks of a state this adapter saves
        (:meth:`check_saved`, :meth:`check_values`); else the restore fails and is rolled back."""
        from torchrl_dcp.adapters.buffer_checks import check_buffer_values, check_saved_buffer

        try:
            live = self.buffer.state(self.buffer_of(obj), ctx)
            check_saved_buffer(live)
            check_buffer_values(live, lambda t: t)
            self.check_extra(self.extra(obj))
        except ValueError as err:
            raise CheckpointIntegrityError(
                f"component {ctx.name!r}: the restored {type(obj).__name__} is a state no save writes ({err}): the "
                "checkpoint is damaged or forged"
            ) from None

    def check_extra(self, extra: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` if the hook's values (:meth:`extra`) are none a save writes (none checked by
        default)."""
        return None

    def destinations(self, obj: Any, saved: Any, ctx: AdapterContext) -> dict[str, Any] | None:
        if not self._ours(saved):
            return None
        return self.buffer.destinations(self.buffer_of(obj), saved[self.key], ctx)

    def row_changes(self, obj: Any, ctx: AdapterContext) -> dict[tuple[str, ...], Any] | None:
        inner = self.buffer.row_changes(self.buffer_of(obj), ctx)
        return None if inner is None else {(self.key, *path): snap for path, snap in inner.items()}

    def check_saved(self, saved: Any) -> None:
        if self._ours(saved):
            self.buffer.check_saved(saved[self.key])
            self.check_extra(saved)

    def check_values(self, saved: Any, read: Any) -> None:
        if self._ours(saved):
            self.buffer.check_values(saved[self.key], read)

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        inner = {r: s[self.key] for r, s in saved.items() if self._ours(s)}
        if inner:
            self.buffer.validate(self.buffer_of(obj), inner, ctx)

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        return {"buffer": self.buffer.snapshot(self.buffer_of(obj), ctx), "extra": self.extra(obj)}

    def rollback(self, obj: Any, snapshot: Any, ctx: AdapterContext) -> None:
        self.buffer.rollback(self.buffer_of(obj), snapshot["buffer"], ctx)
        self.restore_extra(obj, snapshot["extra"])

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        if not all(self._ours(s) for s in saved.values()):
            return super().reshard_sources(saved, ctx)
        return self.buffer.reshard_sources({r: s[self.key] for r, s in saved.items()}, ctx)

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        ctx.plan["restored"] = True
        if not all(self._ours(s) for s in states.values()):
            return super().reshard(obj, states, ctx)
        self.buffer.reshard(self.buffer_of(obj), {r: s[self.key] for r, s in states.items()}, ctx)
        self.restore_extra(obj, states[min(states)])  # (the hook's values follow the schedule: alike on every rank)
        return None


class ReplayBufferTrainerHookAdapter(BufferHookAdapter):
    """``ReplayBufferTrainer`` reached only through ``trainer.register_op`` (its buffer no component): the buffer
    as a replay buffer (torchrl's ``state_dict`` of a prioritized one holds C++ sum trees, which are never pickled).

    Example:
        >>> ReplayBufferTrainerHookAdapter().adapter_id
        'torchrl_dcp.state_dict'
    """

    def buffer_of(self, obj: Any) -> Any:
        return obj.replay_buffer


class OfflineToOnlineHookAdapter(BufferHookAdapter):
    """``OfflineToOnlineReplayBufferHook``: its online buffer through the replay-buffer adapter, the rest as torchrl.

    torchrl's ``state_dict`` of the hook holds the online buffer's whole storage (rows never written included:
    unset memory) and leaves out the storage's last cursor; here the buffer's state is the replay-buffer adapter's,
    beside the offline fractions and the lazily found keys. The offline dataset is not saved: torchrl treats it as
    immutable and the job builds it again.

    Example:
        >>> OfflineToOnlineHookAdapter().adapter_id
        'torchrl_dcp.state_dict'
    """

    key = ONLINE_KEY

    def buffer_of(self, obj: Any) -> Any:
        return obj.replay_buffer.online_buffer

    def extra(self, obj: Any) -> dict[str, Any]:
        rb = obj.replay_buffer
        return {
            "offline_fraction": rb._offline_fraction,
            "base_offline_fraction": rb._base_offline_fraction,
            LAZY_KEY: {a: getattr(obj, a) for a in _attributes_of(obj, LAZY_HOOK_ATTRIBUTES) if hasattr(obj, a)},
        }

    def check_extra(self, extra: Mapping[str, Any]) -> None:
        """torchrl's range of the fractions: ``0 < base_offline_fraction < 1``, annealed towards 0:
        ``0 <= offline_fraction <= base_offline_fraction``."""
        base, now = extra.get("base_offline_fraction"), extra.get("offline_fraction")
        if not (_real(base) and _real(now) and 0 < base < 1 and 0 <= now <= base):
            raise ValueError(f"its offline fraction is {now!r} of a base {base!r}: torchrl keeps 0 <= it <= base < 1")

    def restore_extra(self, obj: Any, state: Mapping[str, Any]) -> None:
        try:
            self.check_extra(state)
        except ValueError as err:
            raise CheckpointIntegrityError(f"{type(obj).__name__}: {err}: damaged or forged") from None
        rb = obj.replay_buffer
        rb._offline_fraction = float(state["offline_fraction"])
        rb._base_offline_fraction = float(state["base_offline_fraction"])
        _set_attributes(obj, state.get(LAZY_KEY, {}), _attributes_of(obj, LAZY_HOOK_ATTRIBUTES))


def _real(value: Any) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
