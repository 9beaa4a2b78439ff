"""What each rank of a torchrl ``Trainer`` holds of its own: its logging schedule, where its buffer iteration stands,
and its logger (present on every rank).

A distributed job usually logs from rank 0 alone, and each rank samples its own buffer:

- ``Trainer._last_log`` ({logged key: frames when last logged}) decides when a key is logged next. torchrl keeps it
  in ``trainer_state``, which is replicated (one copy, checked identical on every rank): a key logged on rank 0
  only made every save fail the replica check. :class:`TrainerRankState` is its per-rank home, registered as
  ``trainer_rank_state`` when a Trainer binds; ``trainer_state`` saves ``_last_log`` empty (with a marker) and its
  restore keeps the one ``trainer_rank_state`` restores. ``trainer_state``\\s of older checkpoints (and of
  ``torchrl.checkpoint``) still hold it, and restore it as before.
- A ``ReplayBufferTrainer`` built with ``iterate=True`` (every trainer of ``torchrl.trainers.algorithms`` builds one)
  samples through a generator, ``iter(replay_buffer)``, kept between iterations. A sampler without replacement that
  ran out on an iteration's last step leaves it paused after its last batch: the next iteration's first draw ends
  it, and that iteration trains nothing. Where each generator stands (:func:`iterator_position`: not started,
  paused, finished) is saved here, and restored as a generator in that position (:func:`iterator_at`); a fresh one
  trained an iteration the run that never stopped skipped.
- ``logger`` is registered by torchrl only where the Trainer has one. On a rank without one the binding registers
  :class:`NoLogger` under that name, so every rank saves the same components (the save agreement requires it);
  its state is empty, and a logger that loads it starts its counters afresh (said).

Example:
    >>> from torchrl_dcp.adapters.trainer_rank_state import NoLogger, TrainerRankState
    >>> class T:
    ...     _last_log = {"reward": 100}
    >>> TrainerRankState(T()).state_dict()
    {'last_log': {'reward': 100}, 'buffer_iterators': []}
    >>> NoLogger().state_dict()
    {}
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning

__all__ = [
    "LAST_LOG_ELSEWHERE",
    "TRAINER_RANK_STATE",
    "TRAINER_STATE",
    "NoLogger",
    "TrainerRankState",
    "check_rank_state",
    "iterator_at",
    "iterator_position",
    "restore_logger_state",
]

TRAINER_STATE = "trainer_state"  # what torchrl's Trainer registers its counters as (when it binds a checkpoint)
TRAINER_RANK_STATE = "trainer_rank_state"  # the component name of a bound Trainer's per-rank state
#: in a ``trainer_state`` payload: its ``_last_log`` is saved empty, each rank's is in ``trainer_rank_state``
LAST_LOG_ELSEWHERE = "_tdcp_last_log_per_rank"
POSITIONS = ("fresh", "paused", "done")  # where a buffer's generator stands: not started, after a batch, finished


class TrainerRankState:
    """A view of a Trainer's per-rank state: ``_last_log`` and where each iterating buffer hook's generator stands
    (``state_dict`` / ``load_state_dict``). ``last_log`` maps the keys the rank logged to the frames collected when
    it last logged them (counts); ``buffer_iterators`` lists a position (:data:`POSITIONS`, or ``None``: a generator
    of an unknown kind, left as it is) per hook, in the order :func:`iterating_hooks` finds them."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = {
            "last_log": dict(getattr(self.trainer, "_last_log", None) or {}),
            "buffer_iterators": [iterator_position(h) for h in iterating_hooks(self.trainer)],
        }
        if getattr(self.trainer, MID_ITERATION, False):  # (saved from a hook, inside an iteration: said at loads)
            state["mid_iteration"] = True
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_rank_state(state, self, TRAINER_RANK_STATE)
        if state.get("mid_iteration"):
            warnings.warn(
                InexactResumeWarning(
                    "the Trainer was saved in the middle of a training iteration (a save called from a hook, before "
                    "the iteration's post_steps_log hooks had all run and logged): the resumed Trainer starts with "
                    "the next collection, "
                    "and what remained of that iteration (optimisation steps, hooks, logs) is not run; save at the "
                    "end of an iteration (torchrl's schedule, the rotation's every_steps, or request_stop) to resume "
                    "exactly"
                ),
                stacklevel=2,
            )
        self.trainer._last_log = dict(state["last_log"])  # (the instance's own: torchrl's class holds a shared {})
        if getattr(self.trainer, IN_TRAIN, False) is not True:  # restored, it goes on with the next iteration; a load
            setattr(self.trainer, MID_ITERATION, False)  # from a hook: the rest of this iteration runs, still inside
        for hook, position in zip(iterating_hooks(self.trainer), state.get("buffer_iterators", [])):
            if position is not None:
                hook.replay_buffer_iter = iterator_at(hook.replay_buffer, position)


#: the Trainer attribute that is ``True`` while ``train()`` is inside an iteration (:func:`track_iterations`)
MID_ITERATION = "_tdcp_mid_iteration"
#: the Trainer attribute that is ``True`` while ``train()`` runs: a load there (from a hook) leaves the iteration's
#: mark as it is; one after (an iteration raised) clears it
IN_TRAIN = "_tdcp_in_train"
#: the Trainer's per-iteration steps ``train()`` calls in order; a save from a hook they run, before the last one
#: returns, is inside an iteration (its rest does not run at a resume)
_ITERATION_STARTS = ("_process_batch_hook", "_pre_steps_log_hook")
_ITERATION_ENDS = "_post_steps_log_hook"


def track_iterations(trainer: Any) -> None:
    """Mark on ``trainer`` (``_tdcp_mid_iteration``) when ``train()`` is inside an iteration: from its first step to
    the end of its ``post_steps_log`` hooks, where torchrl's own save comes. A save from a hook in between is saved
    as such (``mid_iteration``), and a load of it warns. A load outside ``train()`` clears the mark (an iteration
    that raised is not resumed); one from a hook inside it does not (the rest of the iteration still runs, and a
    save from a later hook of it is inside it). Once per Trainer; a Trainer without these steps is left as it is."""
    if getattr(trainer, "_tdcp_tracks_iterations", False) or not all(
        callable(getattr(trainer, n, None)) for n in (*_ITERATION_STARTS, _ITERATION_ENDS)
    ):
        return

    def started(step: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            setattr(trainer, MID_ITERATION, True)
            return step(*args, **kwargs)

        return run

    def ended(step: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            setattr(trainer, MID_ITERATION, False)
            return out

        return run

    def training(train: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = getattr(trainer, IN_TRAIN, False)
            setattr(trainer, IN_TRAIN, True)
            try:
                return train(*args, **kwargs)
            finally:
                setattr(trainer, IN_TRAIN, before)

        return run

    for name in _ITERATION_STARTS:
        setattr(trainer, name, started(getattr(trainer, name)))
    setattr(trainer, _ITERATION_ENDS, ended(getattr(trainer, _ITERATION_ENDS)))
    if callable(getattr(trainer, "train", None)):
        trainer.train = training(trainer.train)
    trainer._tdcp_tracks_iterations = True


def check_rank_state(state: Any, live: TrainerRankState, name: str) -> None:
    """A :class:`TrainerRankState` state as saved: ``last_log`` of counts, one known position per iterating hook the
    live Trainer has; else :class:`~torchrl_dcp.errors.IncompatibleComponentError` (checked while planning a load,
    before anything changes)."""
    last = state.get("last_log") if isinstance(state, Mapping) else None
    if not isinstance(last, Mapping) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in last.items()
    ):
        raise IncompatibleComponentError(
            f"component {name!r}: the saved logging schedule is not {{logged key: frames}} (counts), which no save "
            "writes: the checkpoint is damaged or forged"
        )
    if type(state.get("mid_iteration", False)) is not bool:
        raise IncompatibleComponentError(
            f"component {name!r}: the saved mid_iteration flag is {state.get('mid_iteration')!r}, which no save "
            "writes: the checkpoint is damaged or forged"
        )
    positions = state.get("buffer_iterators", [])
    if not isinstance(positions, list) or not all(p is None or p in POSITIONS for p in positions):
        raise IncompatibleComponentError(
            f"component {name!r}: the saved buffer iterator positions {positions!r} are none a save writes: the "
            "checkpoint is damaged or forged"
        )
    hooks = len(iterating_hooks(live.trainer))
    if len(positions) != hooks:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds where {len(positions)} iterating replay-buffer hooks stood, "
            f"this Trainer has {hooks}: build the Trainer as when it was saved"
        )


def iterating_hooks(trainer: Any) -> list[Any]:
    """The ``ReplayBufferTrainer`` hooks with ``iterate=True`` a Trainer runs, in a fixed order: its op lists by name
    (each op's bound object), then its registered modules; each once."""
    from torchrl.trainers.trainers import ReplayBufferTrainer

    found: list[Any] = []
    candidates = []
    for attr in sorted(a for a in vars(trainer) if a.startswith("_") and a.endswith("_ops")):
        ops = getattr(trainer, attr)
        for entry in ops if isinstance(ops, list) else ():
            op = entry[0] if isinstance(entry, tuple) and entry else entry
            candidates.append(getattr(getattr(op, "__wrapped__", op), "__self__", None))
    modules = getattr(trainer, "_modules", None)
    candidates.extend(modules.values() if isinstance(modules, Mapping) else ())
    for hook in candidates:
        if (
            isinstance(hook, ReplayBufferTrainer)
            and getattr(hook, "iterate", False)
            and all(h is not hook for h in found)
        ):
            found.append(hook)
    return found


def iterator_position(hook: Any) -> str | None:
    """Where ``hook.replay_buffer_iter`` stands: ``"fresh"`` (not started: its first draw resets the sampler's
    ``ran_out``), ``"paused"`` (after a batch: its next draw ends it if the sampler ran out), ``"done"`` (finished: its
    next draw ends it); ``None`` for a generator of another kind."""
    gen = getattr(hook, "replay_buffer_iter", None)
    code = getattr(gen, "gi_code", None)
    state = inspect.getgeneratorstate(gen) if code is not None else None
    if state == inspect.GEN_CLOSED and code in (_torchrl_iter_code(hook), _paused.__code__, _done.__code__):
        return "done"
    if code is _torchrl_iter_code(hook):
        return "fresh" if state == inspect.GEN_CREATED else "paused"
    if code is _paused.__code__:
        return "paused"
    if code is _done.__code__:
        return "done"
    return None


def iterator_at(buffer: Any, position: str) -> Iterator[Any]:
    """A generator over ``buffer`` that goes on as torchrl's ``iter(buffer)`` would from ``position``."""
    if position == "fresh":
        return iter(buffer)
    if position == "paused":
        return _paused(buffer)
    return _done()


def _torchrl_iter_code(hook: Any) -> Any:
    buffer = getattr(hook, "replay_buffer", None)
    method = getattr(type(buffer), "__iter__", None)  # (decorated in torchrl 0.14: the generator is the inner one)
    return getattr(inspect.unwrap(method), "__code__", None) if callable(method) else None


def _paused(buffer: Any) -> Iterator[Any]:
    """torchrl's ``ReplayBuffer.__iter__`` from just after a yield (torchrl 0.14): the loop, without the reset of
    ``ran_out`` its start makes."""
    while not buffer._sampler.ran_out or (buffer._prefetch and len(buffer._prefetch_queue)):
        yield buffer.sample()


def _done() -> Iterator[Any]:
    """A finished generator: its first draw ends it."""
    yield from ()


class NoLogger:
    """What a rank whose Trainer has no logger registers as ``logger``: an empty state, and nothing to restore.

    A checkpoint saved with a logger on some ranks only loads on any ranks: a rank without a logger ignores what
    its rank saved; a logger that loads a state saved by a rank without one starts its counters afresh
    (:func:`restore_logger_state` says so).
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state  # (the rank logs nothing now: a saved logger's counters have nowhere to go)

    def __repr__(self) -> str:
        return "NoLogger()"


def restore_logger_state(logger: Any, state: Any, name: str) -> bool:
    """Whether ``state`` is a :class:`NoLogger`'s (empty) loaded into a real logger: said, and nothing restored."""
    if isinstance(logger, NoLogger) or not (isinstance(state, Mapping) and not state):
        return False
    from torchrl.record.loggers import Logger

    if not isinstance(logger, Logger):
        return False
    warnings.warn(
        f"component {name!r}: this rank had no logger when the checkpoint was saved, so there are no counters to "
        f"restore into {type(logger).__name__}: it continues with its own (logged steps start afresh)",
        InexactResumeWarning,
        stacklevel=3,
    )
    return True
