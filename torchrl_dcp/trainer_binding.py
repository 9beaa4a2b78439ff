"""How a torchrl ``Trainer`` and a ``DistributedCheckpoint`` meet: its lazy registrations, its ``load_from_file``.

torchrl's Trainer registers its components through ``checkpoint.register`` (``trainer_state`` last, which tells a
checkpoint that a Trainer binds it). Two of its entry points need help to work with our checkpoint:

- :func:`sync_trainer`: trainers that register components after ``Trainer.__init__`` (IQL, CQL) are registered before
  a load, so a fresh process resumes them too;
- :func:`bind_trainer_load`: ``trainer.load_from_file(path)`` reads our checkpoints, and torchrl's;
- :func:`register_op_hooks`: a stateful hook reached only through ``trainer.register_op`` (as torchrl's own
  docstrings register ``RewardNormalizer``) is a component too (``trainer_op.<Class>``), saved and loaded.

Example:
    >>> TRAINER_MARKER
    'trainer_state'
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

from torchrl_dcp.adapters import RNGState
from torchrl_dcp.adapters.trainer import OP_HOOK_PREFIX, TrainerHookAdapter
from torchrl_dcp.adapters.trainer_rank_state import (
    TRAINER_RANK_STATE,
    TRAINER_STATE,
    NoLogger,
    TrainerRankState,
    track_iterations,
)
from torchrl_dcp.errors import CheckpointError, InexactResumeWarning
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.torchrl_format.detect import is_torchrl_checkpoint, read_torchrl_manifest

__all__ = [
    "OP_HOOK_PREFIX",
    "TRAINER_MARKER",
    "bind_trainer",
    "bind_trainer_load",
    "register_op_hooks",
    "register_rank_state",
    "sync_trainer",
]

TRAINER_MARKER = TRAINER_STATE  # what torchrl's Trainer registers when it binds a checkpoint
#: hooks whose state is an object they wrap (by class name: the attribute holding it); when that object is a
#: component already, the hook is not registered again (its state would be saved twice, and restored twice by two
#: adapters: torchrl's ``load_state_dict`` after ours)
DELEGATING_HOOKS = {"ReplayBufferTrainer": "replay_buffer", "OptimizerHook": "optimizer"}
#: hooks without a ``state_dict`` of their own whose state is an object they wrap (by class name: the attribute
#: holding it), registered in their place
WRAPPING_HOOKS = {"TargetNetUpdaterHook": "target_params_updater"}


def _op_owners() -> tuple[type, ...]:
    """The objects whose bound methods, run as ops, are saved: LR schedulers, SWA's averaged models and target-network
    updaters (state the job's training follows, alike on every rank; a logger registered on rank 0 alone is not). An
    op given as a lambda or a closure hides its object: register that object as a component."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.optim.swa_utils import AveragedModel
    from torchrl.objectives.utils import TargetNetUpdater

    return (LRScheduler, ReduceLROnPlateau, AveragedModel, TargetNetUpdater)


def bind_trainer(ckpt: Any, trainer: Any) -> None:
    """What a checkpoint does when a torchrl Trainer binds it (registers ``trainer_state``): every rank's RNG streams
    (``rng``), the Trainer's per-rank state (:func:`register_rank_state`), ``trainer.load_from_file`` reading our
    checkpoints, and our rotation driving the Trainer's saves."""
    if not any(isinstance(r.value, RNGState) for r in ckpt._components.values()) and "rng" not in ckpt:
        ckpt.register("rng", RNGState())  # give every rank its RNG streams too
    if trainer is None:
        return
    register_rank_state(ckpt, trainer)
    if getattr(trainer, "checkpoint", None) is ckpt:
        bind_trainer_load(trainer, ckpt)  # trainer.load_from_file reads our checkpoints
    bind = getattr(getattr(trainer, "checkpoint_rotation", None), "_bind_trainer", None)
    if callable(bind) and getattr(trainer, "checkpoint", None) is ckpt:
        bind(trainer, ckpt)  # our CheckpointRotation: its policies and preemption drive the Trainer's saves


def register_rank_state(ckpt: Any, trainer: Any) -> None:
    """A binding Trainer's per-rank state, alike on every rank: its ``_last_log`` and buffer iterators
    (``trainer_rank_state``), and a :class:`NoLogger` as ``logger`` where it has none (rank 0 alone often logs, and
    a logger added at a resume finds a state to load). Optional: checkpoints saved before hold neither."""
    if "_last_log" not in vars(trainer) and isinstance(getattr(trainer, "_last_log", None), dict):
        # torchrl's Trainer.__new__ sets ``_last_log`` on the class, shared by every Trainer of that class and
        # filled in place: each bound Trainer gets its own (as a load gives it), its schedule its own state
        trainer._last_log = dict(trainer._last_log)
    track_iterations(trainer)  # (a save from a hook inside an iteration: saved as such, warned at loads)
    if TRAINER_RANK_STATE not in ckpt:
        ckpt.register(TRAINER_RANK_STATE, TrainerRankState(trainer), placement="per_rank", adapter=TrainerHookAdapter())
        ckpt._components[TRAINER_RANK_STATE].optional = True
    if "logger" not in ckpt and getattr(trainer, "logger", None) is None:
        ckpt.register("logger", NoLogger(), placement="per_rank", adapter=TrainerHookAdapter())
        ckpt._components["logger"].optional = True


def bound_trainer(ckpt: Any) -> Any:
    """The torchrl ``Trainer`` bound to ``ckpt`` (it registered ``trainer_state``), or ``None``."""
    marker = ckpt._components.get(TRAINER_MARKER)
    return getattr(getattr(marker, "value", None), "trainer", None)


def register_op_hooks(ckpt: Any) -> None:
    """Register the stateful hooks the bound Trainer runs that no component holds: one reached only through
    ``trainer.register_op(...)`` (torchrl's docstrings register ``RewardNormalizer`` and ``ClearCudaCache`` so) was
    never saved, and its state (a normaliser's statistics) restarted at a resume, silently.

    A hook is what holds the state of an op's bound object (through torchrl's timing wrapper, :func:`_state_holder`),
    found in the Trainer's op lists in a fixed order and named ``trainer_op.<Class>`` (``trainer_op.<Class>.2`` for a
    second one): the same names in every process that builds the same Trainer.
    """
    trainer = bound_trainer(ckpt)
    if trainer is None or getattr(trainer, "checkpoint", None) is not getattr(ckpt, "_solo_of", ckpt):
        return
    ours = {name: r.value for name, r in ckpt._components.items() if name.startswith(OP_HOOK_PREFIX)}
    held = {id(r.value) for name, r in ckpt._components.items() if name not in ours}
    found: list[Any] = []
    for attr in sorted(a for a in vars(trainer) if a.startswith("_") and a.endswith("_ops")):
        ops = getattr(trainer, attr)
        if not isinstance(ops, list):
            continue
        for entry in ops:
            op = entry[0] if isinstance(entry, tuple) and entry else entry
            op = getattr(op, "__wrapped__", op)
            while isinstance(op, functools.partial):  # (a method with its arguments bound: the op's object is its)
                op = op.func
            owner = getattr(op, "__self__", None)  # (None: the op is a function, or an object called itself)
            hook = _state_holder(op if owner is None else owner, trainer, called=owner is None)
            if hook is None or id(hook) in held or any(h is hook for h in found):
                continue
            wrapped = DELEGATING_HOOKS.get(type(hook).__name__)
            if wrapped is not None and id(getattr(hook, wrapped, None)) in held:
                continue
            found.append(hook)
    # the names are those of every hook found now, in order (an op added between two saves renames the hooks of its
    # class that come after it, in every process alike: never one hook's state given to another by when it came)
    names: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for hook in found:
        kind = type(hook).__name__
        counts[kind] = counts.get(kind, 0) + 1
        names[f"{OP_HOOK_PREFIX}{kind}" + (f".{counts[kind]}" if counts[kind] > 1 else "")] = hook
    for name, value in ours.items():
        if names.get(name) is not value:
            ckpt.unregister(name)
    for name, hook in names.items():
        if name not in ckpt:
            ckpt.register(name, hook, adapter=_hook_adapter(ckpt, hook))
            ckpt._components[name].optional = True  # checkpoints saved before this hook was found lack it


def _hook_adapter(ckpt: Any, hook: Any) -> Any:
    """The adapter of a hook found in the ops: a ``state_dict`` object's is the Trainer hooks' (the same payload and
    id as the generic one, resharded: new rank ``r`` takes saved rank ``r % W``'s state, which for an LR scheduler or
    a target updater, alike on every rank, is exact); any other kind's (a module's, a hook's own) as registered."""
    from torchrl_dcp.adapters.state_dict import StateDictAdapter
    from torchrl_dcp.adapters.trainer import TrainerHookAdapter

    resolved = ckpt._adapter_for_value(hook)
    return TrainerHookAdapter() if type(resolved) is StateDictAdapter else None


def _state_holder(owner: Any, trainer: Any, called: bool = False) -> Any:
    """What holds the state of an op bound to ``owner`` (``None``: nothing to save): a ``TrainerHookBase`` with a
    ``state_dict`` of its own (torchrl's only when that state is non-empty: theirs that keep none return ``{}``); the object a hook without a ``state_dict`` of its own wraps (``TargetNetUpdaterHook``: its
    target updater's counter); an object whose bound method is the op (``register_op("post_optim", sched.step)``:
    the LR scheduler's position: LR schedulers and target updaters, the same on every rank, not a rank's own logger).
    Never the Trainer itself, whose own methods are ops. ``called``: the op is ``owner`` itself (a callable object of
    the user's with ``state_dict`` and ``load_state_dict``: saved too)."""
    from torchrl.trainers.trainers import TrainerHookBase  # (a Trainer is bound: torchrl's trainers are imported)

    if owner is trainer:
        return None
    if not isinstance(owner, TrainerHookBase):  # (an object of the job's state, the same on every rank)
        stateful = callable(getattr(owner, "state_dict", None)) and callable(getattr(owner, "load_state_dict", None))
        return owner if isinstance(owner, _op_owners()) or (called and stateful) else None
    try:
        state = owner.state_dict()
        # torchrl's own hooks that keep nothing return an empty state always; a user's hook may hold none yet (a
        # fresh process before its first batch): found all the same, so that it is restored, and named as at save
        return owner if state or not type(owner).__module__.startswith("torchrl.") else None
    except NotImplementedError:  # (torchrl's base class: a hook that keeps no state, or whose state is what it wraps)
        attr = WRAPPING_HOOKS.get(type(owner).__name__)
        if attr is not None:
            return getattr(owner, attr, None)
        # a user's hook that holds attributes but wrote no state_dict: registered, so that a save refuses it by name
        # (as ``register_module`` does), where skipping it restarted its state at a resume, silently
        return owner if not type(owner).__module__.startswith("torchrl.") and vars(owner) else None
    except Exception:  # noqa: BLE001 - a hook whose state_dict fails: registered, so that a save says why
        return owner


def sync_trainer(ckpt: Any) -> None:
    """Register what the bound torchrl ``Trainer`` would register at its next save, before a load.

    torchrl's Trainer registers its components when it is built and again before each save; trainers that set
    their replay buffer or target updater after ``Trainer.__init__`` (IQL, CQL in torchrl 0.14) are registered only
    at the first save, so a resume in a fresh process would skip them. The Trainer's own sync (a private method:
    skipped when a torchrl version lacks it) runs first, registering only names not yet registered.
    """
    trainer = bound_trainer(ckpt)
    sync = getattr(trainer, "_sync_checkpoint_components", None)
    bound = getattr(ckpt, "_solo_of", ckpt)  # a local tier's world-of-one copy shares the Trainer's registrations
    if callable(sync) and getattr(trainer, "checkpoint", None) is bound:
        sync(bound)
    register_op_hooks(bound)


def bind_trainer_load(trainer: Any, ckpt: Any) -> None:
    """Make ``trainer.load_from_file(path)`` load a torchrl_dcp checkpoint (directory, archive or URL) into ``ckpt``.

    torchrl's ``Trainer.load_from_file`` recognises only ``torchrl.checkpoint``'s manifest and sends anything else to
    ``torch.load`` (``IsADirectoryError`` on our directories). The instance's method is wrapped: our checkpoints
    load through ``ckpt.load`` (the Trainer's lazy registrations first, then every registered component; torchrl's
    ``strict=True``/``False`` as ``"error"``/``"warn"``, ``map_location`` passed on), then the collector's policy
    weights are synchronised as torchrl does. A ``torchrl.checkpoint`` checkpoint (directory or archive) is
    imported read-only the same way (:mod:`torchrl_dcp.torchrl_format`), its components onto the same names; the
    ``rng`` streams our checkpoint adds to a Trainer's are not in it and keep their state. Other files (a
    ``torch.save`` of the legacy backend) go to torchrl's own method.
    """
    original = getattr(trainer, "load_from_file", None)
    if not callable(original) or getattr(original, "_tdcp_bound", False):
        return

    def load_from_file(file: Any, **kwargs: Any) -> Any:
        theirs = is_torchrl_checkpoint(file) if isinstance(file, (str, os.PathLike)) else False
        if not theirs and not _is_ours(file, ckpt.storage_options):
            return original(file, **kwargs)
        strict = kwargs.pop("strict", None)
        options: dict[str, Any] = {"map_location": kwargs.pop("map_location", None)}
        if strict is not None:  # (torchrl's bool, or one of ours: "error", "warn", "ignore")
            options["strict"] = strict if isinstance(strict, str) else "error" if strict else "warn"
        chosen = kwargs.pop("components", None)
        options.update(kwargs)  # (world_size_change, verify, component_options: ckpt.load's; others refused there)
        if chosen is not None:
            options["components"] = chosen
        elif theirs:  # read-only import; the RNG streams we add to a Trainer's checkpoint are not in torchrl's,
            saved = set(read_torchrl_manifest(file)["components"])
            sync_trainer(ckpt)  # the Trainer's lazy registrations first (ckpt.load would run them after the choice)
            options["components"] = [  # (nor the hooks we register ourselves: torchrl saves none of them)
                n for n in ckpt.components if n in saved or (n != "rng" and not ckpt._components[n].optional)
            ]
            _warn_kept(file, [n for n in ckpt.components if n not in options["components"] and not _lossless(ckpt, n)])
        result = ckpt.load(file, **options)
        update = getattr(getattr(trainer, "collector", None), "update_policy_weights_", None)
        if "policy" in result.loaded and callable(update):
            update()  # local copies and workers see the restored learner, as after torchrl's own load
        return trainer  # (its rotation counts from the loaded step: ckpt.load told it, note_trainer_load)

    load_from_file._tdcp_bound = True  # type: ignore[attr-defined]
    load_from_file.__doc__ = original.__doc__
    trainer.load_from_file = load_from_file


def _lossless(ckpt: Any, name: str) -> bool:
    """Whether leaving ``name`` out of a ``torchrl.checkpoint`` import loses nothing: ``trainer_rank_state`` (torchrl's
    ``trainer_state`` holds ``_last_log``), a :class:`NoLogger` (a rank without a logger)."""
    return name == TRAINER_RANK_STATE or isinstance(ckpt._components[name].value, NoLogger)


def _warn_kept(file: Any, names: list[str]) -> None:
    """Say which components a ``torchrl.checkpoint`` import leaves as they are (the hooks we register ourselves,
    our ``rng`` streams): training after it does not continue exactly as the run that saved it would have."""
    if names:
        warnings.warn(
            f"{file}: a torchrl.checkpoint checkpoint holds no state for {', '.join(names)}: they keep their current "
            "state, so training does not continue exactly as the run that saved it (save with torchrl_dcp to "
            "resume them too)",
            InexactResumeWarning,
            stacklevel=3,
        )


def note_trainer_load(ckpt: Any, result: Any) -> None:
    """After a load into ``ckpt`` that restored its bound Trainer's counters (``trainer_state``): the Trainer's
    :class:`~torchrl_dcp.CheckpointRotation` counts its schedules from the loaded step (the frames the Trainer
    collected, which its saves are made under), as after the rotation's own resume, whichever way the load came
    (``ckpt.load``, ``trainer.load_from_file``, :func:`~torchrl_dcp.resume` through another spelling of the
    directory). The next iteration then saves when the run that never stopped saved, and a save from inside it never
    replaces the loaded step's checkpoint (:mod:`~torchrl_dcp.trainer_loop`)."""
    trainer = bound_trainer(ckpt)
    if trainer is None or getattr(trainer, "checkpoint", None) is not ckpt or TRAINER_STATE not in result.loaded:
        return
    rotation = getattr(trainer, "checkpoint_rotation", None)
    resumed = getattr(rotation, "_resumed_from", None)
    step = _frames(trainer)
    if callable(resumed) and step is not None and getattr(rotation, "_resuming", False) is not True:
        resumed(step, ckpt)  # (the rotation's own resume counts, and drops newer local steps, itself)


def counted_step(ckpt: Any, step: int) -> int:
    """The step a rotation's schedules count from after resuming ``step`` into ``ckpt``: the bound Trainer's
    collected frames (what it saves under; ``step`` itself when the load restored its counters, its own frames when
    ``components=`` or ``strict="warn"`` left them out), else ``step``."""
    trainer = bound_trainer(ckpt)
    frames = _frames(trainer) if trainer is not None and getattr(trainer, "checkpoint", None) is ckpt else None
    return step if frames is None else frames


def _frames(trainer: Any) -> int | None:
    """The Trainer's ``collected_frames`` as an int (``None`` when it holds none)."""
    frames = getattr(trainer, "collected_frames", None)
    return int(frames) if isinstance(frames, int) and not isinstance(frames, bool) else None


def _is_ours(path: Any, storage_options: Any) -> bool:
    """A checkpoint of ours: a directory (or store prefix) that is not torchrl's, or a file holding our manifest.

    A damaged checkpoint directory of ours is still ours (its load then says what is wrong), where ``torch.load``
    would only say it is a directory; a single file is ours when our manifest reads from it (a ``torch.save`` file
    goes to torchrl's own method)."""
    try:
        where = location_for(path, storage_options)
        if where.entry_kind() == "checkpoint":
            return True
        where.manifest()
    except (CheckpointError, OSError, TypeError, ValueError):
        return False
    return True
