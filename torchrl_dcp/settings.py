"""The ``TDCP_*`` environment variables: one table, each read and checked here.

Every knob the library reads from the environment is declared in :data:`SETTINGS` (name, kind, default, bounds,
what it does); :func:`setting` returns its value, and a value that does not parse, or lies outside the bounds, raises
a ``ValueError`` naming the variable and what it accepts (instead of being ignored or failing deep inside a save).
``docs/api.md`` lists the table (``tests/test_settings.py`` keeps them equal). Torch-free.

Example:
    >>> setting("TDCP_STORE_CONCURRENCY")
    8
    >>> SETTINGS["TDCP_READ_AHEAD"].default
    33554432
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["SETTINGS", "Setting", "check_environment", "setting"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``kind`` is ``"int"`` (``minimum``..``maximum``), ``"switch"`` (``0`` or ``1``)
    or ``"choice"`` (one of ``choices``)."""

    name: str
    kind: str
    default: Any
    doc: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()

    def parse(self, text: str) -> Any:
        if self.kind == "switch":
            if text not in ("0", "1"):
                raise ValueError(f"{self.name}={text!r}: use 0 or 1 ({self.doc})")
            return text == "1"
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(f"{self.name}={text!r}: use one of {', '.join(self.choices)} ({self.doc})")
            return text
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r} is not an integer ({self.doc})") from None
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            bounds = f"at least {self.minimum}" if self.maximum is None else f"{self.minimum} to {self.maximum}"
            raise ValueError(f"{self.name}={value} is out of range: use {bounds} ({self.doc})")
        return value


MIB = 1 << 20
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("TDCP_WRITE_THREADS", "int", None, "write/copy threads per rank (default: up to 4, this rank's share "
                "of the node's CPUs; an async save's background writes leave torch's intra-op threads their CPUs)",
                minimum=1),
        Setting("TDCP_ASYNC_NICE", "int", 0, "niceness of an async save's background writes (Linux, per thread; "
                "10: a loop training on every CPU barely slowed, the save several times longer)", minimum=0,
                maximum=19),
        Setting("TDCP_READ_THREADS", "int", None, "reader threads per rank (default: this rank's share of the "
                "node's CPUs, at most 2, plus one)", minimum=1),
        Setting("TDCP_READ_AHEAD", "int", 32 * MIB, "bytes of the next data files announced to the kernel ahead "
                "of a load's reads (0: none)", minimum=0),
        Setting("TDCP_READ_HUGEPAGES", "choice", "auto", "transparent huge pages for large fresh destinations of a "
                "load (auto: unless the kernel reports free pages to a hypervisor, see docs/api.md)",
                choices=("auto", "0", "1")),
        Setting("TDCP_READ_PREFAULT", "switch", True, "map fresh destination pages ahead of large reads"),
        Setting("TDCP_CHUNK_BYTES", "int", 8 * MIB, "bytes per chunk file of a large tensor (incremental saves "
                "keep unchanged chunks; alike on every rank, with TDCP_MIN_CHUNKED_BYTES: a save refuses ranks that "
                "differ)", minimum=1),
        Setting("TDCP_MIN_CHUNKED_BYTES", "int", None, "smallest tensor cut into chunk files (default: twice "
                "TDCP_CHUNK_BYTES)", minimum=1),
        Setting("TDCP_STORE_PART_SIZE", "int", 16 * MIB, "bytes per uploaded part of an object-store save (S3's "
                "minimum: 5 MiB)", minimum=5 * MIB),
        Setting("TDCP_STORE_RANGE_SIZE", "int", 32 * MIB, "most bytes per ranged GET of an object-store load",
                minimum=MIB),
        Setting("TDCP_STORE_CONCURRENCY", "int", 8, "object-store requests in flight per rank", minimum=1),
        Setting("TDCP_CRC32", "choice", "isal", "CRC-32 implementation (isal, or zlib to compare)",
                choices=("isal", "zlib")),
        Setting("TDCP_LOG_ALL_RANKS", "switch", False, "log INFO lines from every rank, not only rank 0"),
        Setting("TDCP_MONITOR_ALL", "switch", False, "a monitored barrier before every checkpoint exchange, to name "
                "a rank stuck inside a save or load (default: before the first exchange and the commit gather)"),
    )
}  # fmt: skip


def setting(name: str) -> Any:
    """The value of ``name`` (a key of :data:`SETTINGS`): the environment's, checked, or the default when unset."""
    spec = SETTINGS[name]
    text = os.environ.get(name, "")
    return spec.default if text == "" else spec.parse(text)


def setting_at_import(name: str) -> Any:
    """:func:`setting` for a module constant read at import: a bad value gives the default here, so that importing
    torchrl_dcp (and a CLI command) never fails on it; :func:`check_environment`, which every save, load and command
    runs first, raises naming it.

    Example:
        >>> setting_at_import("TDCP_READ_AHEAD") == SETTINGS["TDCP_READ_AHEAD"].default  # (nothing set here)
        True
    """
    try:
        return setting(name)
    except ValueError:
        return SETTINGS[name].default


_CHECKED: set[tuple[tuple[str, str], ...]] = set()


def check_environment() -> None:
    """Parse every ``TDCP_*`` variable that is set, once per distinct environment: a save or load calls this first,
    so a bad value fails before anything starts, naming the variable, whatever code path would read it later (one
    read only by large loads, or by the log filter, failed deep inside a save or load that had already begun).
    Other ``TDCP_*`` names (the benchmarks' and examples' own) are left alone.

    Example:
        >>> check_environment()  # (nothing set here)
    """
    present = tuple(sorted((k, v) for k, v in os.environ.items() if k in SETTINGS and v != ""))
    if present in _CHECKED:
        return
    for name, text in present:
        SETTINGS[name].parse(text)
    _CHECKED.add(present)


def markdown_table() -> str:
    """The table of :data:`SETTINGS` as docs/api.md shows it."""
    rows = ["| variable | accepts | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        if s.kind == "switch":
            accepts, default = "0 or 1", "1" if s.default else "0"
        elif s.kind == "choice":
            accepts, default = " or ".join(s.choices), s.default
        else:
            accepts = f"integer ≥ {s.minimum}" if s.maximum is None else f"{s.minimum}..{s.maximum}"
            default = "(see what it does)" if s.default is None else f"{s.default:,}"
        rows.append(f"| `{s.name}` | {accepts} | {default} | {s.doc} |")
    return "\n".join(rows)
