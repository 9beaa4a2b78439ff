"""When a rotation saves (``every_steps``, ``every_seconds``) and which entries it keeps (``keep_*``).

Pure decisions, without I/O or collectives: :class:`CheckpointRotation` agrees on them
across ranks and acts on them.

- **Schedule** (:class:`SaveSchedule`): a step is due when it reaches a multiple of
  ``every_steps`` that the previous save (or the resume) had not reached (steps that jump,
  such as collected frames, save at the first step past each multiple), or when
  ``every_seconds`` have passed since the previous save (or since the rotation was built).
- **Retention** (:class:`Retention`): keep the ``keep_last`` newest commits (``None``: all),
  every entry whose step is a multiple of ``keep_every`` (Orbax's ``keep_period``), the
  ``keep_best`` N entries by a metadata metric, and the entry just saved.

Example:
    >>> schedule = SaveSchedule(every_steps=100)
    >>> [schedule.due_by_steps(s, last=0) for s in (99, 100, 250)]
    [False, True, True]
    >>> parse_keep_best(["reward", "max", 2])
    ('reward', 'max', 2)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

MetricMode = Literal["max", "min"]
KeepBest = tuple[str, MetricMode, int]


class Entry(Protocol):
    """What retention needs of a committed entry (a :class:`~torchrl_dcp.RotationEntry`)."""

    step: int
    path: Path
    metric: float | None

    @property
    def commit_key(self) -> tuple[int, float, int]: ...


def as_integer(value: Any) -> int | None:
    """``value`` as an ``int`` when it is an integer (a NumPy integer or 0-d integer tensor, computed by training
    code, too); ``None`` for anything else (a bool, a float)."""
    if isinstance(value, bool) or "bool" in type(value).__name__:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    number = as_integer(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return number


def parse_keep_best(value: Any) -> KeepBest | None:
    """``keep_best`` as ``(key, mode, n)``: accepts ``(key, mode)``, ``(key, mode, n)`` and lists (YAML configs).

    Example:
        >>> parse_keep_best(("loss", "min"))
        ('loss', 'min', 1)
    """
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) in (2, 3) and isinstance(value[0], str) and value[0]:
        mode = value[1]
        count = value[2] if len(value) == 3 else 1
        if mode not in ("max", "min"):
            raise ValueError(f"keep_best mode must be 'max' or 'min', got {mode!r}")
        number = as_integer(count)
        if number is None or number < 1:
            raise ValueError(f"keep_best count must be a positive integer, got {count!r}")
        return (value[0], mode, number)
    raise ValueError(f"keep_best must be (metadata_key, 'max' | 'min'[, count]), got {value!r}")


@dataclass(frozen=True)
class SaveSchedule:
    """``every_steps`` and ``every_seconds``; either may be ``None`` (then it never makes a step due)."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "every_steps", _positive_int(self.every_steps, "every_steps"))  # (an int)
        seconds = self.every_seconds
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(f"every_seconds must be a positive number of seconds or None, got {seconds!r}")

    @property
    def active(self) -> bool:
        """Whether any policy can make a step due (otherwise only a preemption or ``force`` saves)."""
        return self.every_steps is not None or self.every_seconds is not None

    def due_by_steps(self, step: int, last: int) -> bool:
        """``step`` reached a multiple of ``every_steps`` that ``last`` (the step last saved or resumed) had not."""
        return self.every_steps is not None and step // self.every_steps > last // self.every_steps

    def due_by_time(self, now: float, last: float) -> bool:
        """``every_seconds`` have passed between ``last`` and ``now`` (one clock: rank 0's monotonic clock)."""
        return self.every_seconds is not None and now - last >= self.every_seconds


@dataclass(frozen=True)
class Retention:
    """Which committed entries a rotation keeps."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_last", _positive_int(self.keep_last, "keep_last"))  # (ints)
        object.__setattr__(self, "keep_every", _positive_int(self.keep_every, "keep_every"))

    def best(self, entries: Iterable[Entry]) -> list[Entry]:
        """The ``keep_best`` entries, best first (equal metrics: the newest commit first)."""
        if self.keep_best is None:
            return []
        _, mode, count = self.keep_best
        sign = 1.0 if mode == "max" else -1.0
        scored = [e for e in entries if e.metric is not None]
        return sorted(scored, key=lambda e: (sign * e.metric, e.commit_key), reverse=True)[:count]  # type: ignore[operator]

    def kept(self, by_commit: list[Entry], protect: Path | None = None) -> set[Path]:
        """Paths of ``by_commit`` (committed entries, oldest commit first) that the policy keeps, plus ``protect``."""
        keep = {e.path for e in (by_commit if self.keep_last is None else by_commit[-self.keep_last :])}
        if self.keep_every is not None:
            keep.update(e.path for e in by_commit if e.step % self.keep_every == 0)
        keep.update(e.path for e in self.best(by_commit))
        if protect is not None:
            keep.add(protect)
        return keep
