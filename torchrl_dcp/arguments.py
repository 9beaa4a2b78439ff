"""What the public calls accept, checked at the call, before anything is read or written.

``DistributedCheckpoint``'s arguments (``strict``, ``timeout``, ``step``, ``metadata``, ``component_options``): a
value the manifest could not record, or one a later phase would refuse after files were written, raises here with
what to pass instead.

Example:
    >>> from torchrl_dcp.arguments import check_step
    >>> check_step(3), check_step(None)
    (3, None)
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Collection, Mapping
from typing import Any

from torchrl_dcp.adapters import CheckpointOptions
from torchrl_dcp.errors import EncodingError
from torchrl_dcp.json_values import plain_scalars

#: the longest timeout taken (seconds, ~3 years): what ``timedelta`` and torch's millisecond timeouts both hold
MAX_TIMEOUT_S = 10**8


def check_timeout(timeout: Any) -> datetime.timedelta | None:
    """``timeout`` as a positive ``timedelta`` (seconds accepted, NumPy and 0-d tensor numbers too), checked when the
    checkpoint is built: finite, positive, at most :data:`MAX_TIMEOUT_S` seconds."""
    if timeout is None:
        return None
    timeout = plain_scalars(timeout)
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
            raise ValueError(
                f"timeout must be a positive, finite number of seconds of at most {MAX_TIMEOUT_S:.0e} (about 3 "
                f"years), got {timeout!r}"
            )
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not 0 < timeout.total_seconds() <= MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout must be positive and at most {MAX_TIMEOUT_S:.0e} seconds, got {timeout.total_seconds()} seconds"
        )
    return timeout


def check_strict(strict: str) -> None:
    if strict not in ("error", "warn", "ignore"):
        raise ValueError(f"strict must be 'error', 'warn' or 'ignore', got {strict!r}")


def check_component_options(
    given: Mapping[str, CheckpointOptions] | None,
    names: Collection[str],
    done: str,
    *,
    elsewhere: Collection[str] = (),
) -> dict[str, CheckpointOptions]:
    """``component_options`` checked at the call: each a :class:`CheckpointOptions`, for a component ``names``
    holds (the ones this save or load handles); returns those for ``names``. ``elsewhere``: names this rank did not
    register that other ranks may have (a multi-rank save's per-rank components): accepted here, left out, and
    refused by the save's agreement where no rank registered them."""
    options = dict(given or {})
    unknown = sorted(set(options) - set(names) - set(elsewhere))
    if unknown:
        raise KeyError(f"options given for components that are not {done}: {unknown}")
    wrong = sorted(n for n, o in options.items() if not isinstance(o, CheckpointOptions))
    if wrong:
        raise TypeError(
            f"component_options must map component names to tdcp.CheckpointOptions; {wrong} "
            f"{'is' if len(wrong) == 1 else 'are'} {type(options[wrong[0]]).__name__}: pass CheckpointOptions(...)"
        )
    return {n: o for n, o in options.items() if n in set(names)}


def check_step(step: Any) -> int | None:
    """``step`` as an ``int`` (a NumPy integer or 0-d integer tensor converted), or ``None``; anything else is refused
    before a save starts, as the manifest records an integer or null."""
    value = plain_scalars(step)
    if value is not None and (type(value) is bool or not isinstance(value, int)):
        raise TypeError(
            f"step must be an integer or None, got {type(step).__name__} {step!r}: pass int(step) (a frame count "
            "divided by frames per batch is a float)"
        )
    return None if value is None else int(value)


def check_json(value: Any, where: str) -> None:
    """Refuse (:class:`EncodingError`, naming where in ``value``) what JSON cannot hold, or would give back changed: a
    key that is not a string (``json`` writes ``1.5`` as ``"1.5"``, ``None`` as ``"null"``)."""
    found = _non_string_key(value)
    if found is not None:
        at, key = found
        raise EncodingError(
            f"{where}{at} must be JSON-safe: key {key!r} is of type {type(key).__name__}, and JSON keys are strings "
            f"(it would come back as another key): use a string key, e.g. {str(key)!r}"
        )
    try:
        json.dumps(value, allow_nan=False, sort_keys=True)  # (as the manifest is written: keys of one kind each)
    except (TypeError, ValueError) as err:
        raise EncodingError(f"{where}{json_culprit(value)} must be JSON-safe: {err}") from None


def _non_string_key(value: Any, at: str = "", depth: int = 0) -> tuple[str, Any] | None:
    """Where the first mapping key that is not a string is, and the key (``None``: none)."""
    if depth > 1000:  # (a cycle or a nesting JSON refuses anyway: json.dumps says so)
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return at, k
            found = _non_string_key(v, f"{at}[{k!r}]", depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _non_string_key(v, f"{at}[{i}]", depth + 1)
            if found is not None:
                return found
    return None


def json_culprit(value: Any, at: str = "") -> str:
    """Where in ``value`` the first value JSON refuses is (``["cfg"]["deep"]``), or ``""`` when it is ``value``."""
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return at
    for k, v in items:
        try:
            json.dumps({k: v} if isinstance(value, Mapping) else [v], allow_nan=False, sort_keys=True)
        except (TypeError, ValueError):
            return json_culprit(v, f"{at}[{k!r}]")
    return at
