"""What each rank of a torchrl ``Trainer`` logs: its logging schedule and its logger, present on every rank.

A distributed job usually logs from rank 0 alone: an evaluation metric logged there only, a ``logger`` given
to rank 0's Trainer only. Two pieces of the Trainer's state are therefore each rank's own:

- ``Trainer._last_log`` ({logged key: frames when last logged}) decides when a key is logged next. torchrl keeps it
  in ``trainer_state``, which is replicated (one copy, checked identical on every rank): a key logged on rank 0
  only made every save fail the replica check. :class:`TrainerLog` is its per-rank home, registered as
  ``trainer_log`` when a Trainer binds; ``trainer_state`` saves ``_last_log`` empty (with a marker) and its restore
  keeps the one ``trainer_log`` restores. ``trainer_state`` of older checkpoints (and of ``torchrl.checkpoint``) still
  holds it, and restores it as before.
- ``logger`` is registered by torchrl only where the Trainer has one. On a rank without one the binding registers
  :class:`NoLogger` under that name, so every rank saves the same components (the save agreement requires it);
  its state is empty, and a logger that loads it starts its counters afresh (said).

Example:
    >>> from torchrl_dcp.adapters.trainer_logging import NoLogger, TrainerLog
    >>> class T:
    ...     _last_log = {"reward": 100}
    >>> log = TrainerLog(T())
    >>> log.state_dict()
    {'last_log': {'reward': 100}}
    >>> NoLogger().state_dict()
    {}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning

__all__ = [
    "LAST_LOG_ELSEWHERE",
    "TRAINER_LOG",
    "TRAINER_STATE",
    "NoLogger",
    "TrainerLog",
    "check_trainer_log",
    "restore_logger_state",
]

TRAINER_STATE = "trainer_state"  # what torchrl's Trainer registers its counters as (when it binds a checkpoint)
TRAINER_LOG = "trainer_log"  # the component name of a bound Trainer's per-rank logging schedule
#: in a ``trainer_state`` payload: its ``_last_log`` is saved empty, each rank's is in ``trainer_log``
LAST_LOG_ELSEWHERE = "_tdcp_last_log_per_rank"


class TrainerLog:
    """A view of a Trainer's ``_last_log``, each rank's own: ``state_dict`` / ``load_state_dict`` of it.

    The keys are the names the rank logged, the values the frames collected when it last logged them (counts).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"last_log": dict(getattr(self.trainer, "_last_log", None) or {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_trainer_log(state, TRAINER_LOG)
        self.trainer._last_log = dict(state["last_log"])  # (the instance's own: torchrl's class holds a shared {})


def check_trainer_log(state: Any, name: str) -> None:
    """A :class:`TrainerLog` state is ``{"last_log": {logged key: frames}}`` (counts), else
    :class:`~torchrl_dcp.errors.IncompatibleComponentError` (checked while planning a load, before anything changes)."""
    last = state.get("last_log") if isinstance(state, Mapping) else None
    if not isinstance(last, Mapping) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in last.items()
    ):
        raise IncompatibleComponentError(
            f"component {name!r}: the saved logging schedule is not {{logged key: frames}} (counts), which no save "
            "writes: the checkpoint is damaged or forged"
        )


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
