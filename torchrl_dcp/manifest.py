"""The manifest: ``manifest.json``, written last, is what makes a checkpoint exist.

It records the format version, the world size, library versions, every component
(adapter id and version, placement, JSON state skeleton, per rank where needed),
every data file with its size and checksum, and user metadata. Readers validate
it strictly, refuse newer format versions and upgrade older ones through
registered migrations.

Example:
    >>> from torchrl_dcp.manifest import FORMAT, FORMAT_VERSION
    >>> FORMAT, FORMAT_VERSION
    ('torchrl_dcp', 1)
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, CheckpointNotFoundError, CheckpointVersionError
from torchrl_dcp.placement import PLACEMENTS
from torchrl_dcp.storage.checksums import file_checksum

FORMAT = "torchrl_dcp"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30

Migration = Callable[[dict[str, Any]], dict[str, Any]]
_MIGRATIONS: dict[int, Migration] = {}


def register_migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register ``fn(manifest) -> manifest`` that upgrades ``from_version`` to ``from_version + 1``."""

    def wrap(fn: Migration) -> Migration:
        _MIGRATIONS[from_version] = fn
        return fn

    return wrap


def library_versions() -> dict[str, str]:
    import tensordict
    import torch
    import torchrl

    from torchrl_dcp import __version__

    return {
        "torch": str(torch.__version__),
        "tensordict": str(tensordict.__version__),
        "torchrl": str(torchrl.__version__),
        "torchrl_dcp": __version__,
    }


def new_manifest(
    *,
    world_size: int,
    components: dict[str, Any],
    files: dict[str, Any],
    metadata: dict[str, Any],
    step: int | None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "step": step,
        "world_size": world_size,
        "versions": library_versions(),
        "components": components,
        "files": files,
        "metadata": metadata,
    }


def dumps(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Read, validate and migrate ``<root>/manifest.json``.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.
        CheckpointFormatError: no manifest (a foreign or unfinished directory), or a malformed one.
        CheckpointVersionError: written by a newer torchrl_dcp.
    """
    root = Path(root)
    if not root.exists():
        raise CheckpointNotFoundError("no checkpoint here: the path does not exist", path=root)
    if not root.is_dir():
        raise CheckpointFormatError("not a checkpoint directory", path=root)
    path = root / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise CheckpointFormatError(
            f"no {MANIFEST}: not a torchrl_dcp checkpoint, or a save that never committed", path=root
        )
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError("manifest is implausibly large", path=path)
    try:
        raw = json.loads(path.read_bytes(), parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointFormatError(f"manifest is not valid JSON ({err})", path=path) from None
    return parse_manifest(raw, path)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def parse_manifest(raw: Any, source: Any) -> dict[str, Any]:
    """Validate a decoded manifest (and migrate it to the current version)."""
    if not isinstance(raw, dict):
        raise CheckpointFormatError("manifest is not a JSON object", path=source)
    if raw.get("format") != FORMAT:
        raise CheckpointFormatError(f"manifest format is {raw.get('format')!r}, expected {FORMAT!r}", path=source)
    version = raw.get("format_version")
    if not _is_int(version) or version < 1:
        raise CheckpointFormatError(f"format_version {version!r} is not a positive integer", path=source)
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"written with format version {version}, this torchrl_dcp reads up to {FORMAT_VERSION}: "
            "upgrade torchrl_dcp to load it",
            path=source,
        )
    while raw["format_version"] < FORMAT_VERSION:
        current = raw["format_version"]
        migration = _MIGRATIONS.get(current)
        if migration is None:
            raise CheckpointVersionError(f"no migration from format version {current}", path=source)
        raw = migration(raw)
        if raw.get("format_version") != current + 1:
            raise CheckpointVersionError(f"migration from format version {current} did not upgrade it", path=source)
    _validate(raw, source)
    return raw


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(m: dict[str, Any], source: Any) -> None:
    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"malformed manifest: {what}", path=source)

    if not _is_int(m.get("world_size")) or m["world_size"] < 1:
        raise bad("world_size must be a positive integer")
    if m.get("step") is not None and not _is_int(m["step"]):
        raise bad("step must be an integer or null")
    for field in ("versions", "metadata", "components", "files"):
        if not isinstance(m.get(field), dict):
            raise bad(f"{field} must be an object")
    for name, rec in m["files"].items():
        if not isinstance(rec, dict) or not _is_int(rec.get("size")) or rec["size"] < 0:
            raise bad(f"files[{name!r}] needs an integer size")
        if not isinstance(rec.get("checksum"), str):
            raise bad(f"files[{name!r}] needs a checksum")
        if not name or "/" in name or "\\" in name or name in (".", "..", MANIFEST) or "\0" in name:
            raise bad(f"file name {name!r} is not a plain file name")
    for name, rec in m["components"].items():
        if not isinstance(rec, dict):
            raise bad(f"components[{name!r}] must be an object")
        if not isinstance(rec.get("adapter"), str) or not _is_int(rec.get("adapter_version")):
            raise bad(f"components[{name!r}] needs adapter and adapter_version")
        placement = rec.get("placement")
        if placement not in PLACEMENTS:
            raise bad(f"components[{name!r}].placement {placement!r} is not one of {PLACEMENTS}")
        if placement == "per_rank":
            ranks = rec.get("ranks")
            if not isinstance(ranks, dict) or sorted(ranks) != sorted(str(r) for r in range(m["world_size"])):
                raise bad(f"components[{name!r}].ranks must hold one state per saved rank")
            for r, state in ranks.items():
                if not isinstance(state, dict) or "state" not in state:
                    raise bad(f"components[{name!r}].ranks[{r}] needs a state")
        elif "state" not in rec:
            raise bad(f"components[{name!r}] needs a state")


def check_files(
    root: Path, manifest: dict[str, Any], *, checksum: Iterable[str] | bool = True, extra_ok: bool = False
) -> None:
    """Check that the files the manifest lists exist with their sizes (and checksums).

    Args:
        checksum: ``True`` for every file, ``False`` for none, or the names to checksum.
        extra_ok: accept files the manifest does not list.

    Raises:
        CheckpointIntegrityError: naming the first file that is missing, resized, altered or unexpected.
    """
    files: dict[str, Any] = manifest["files"]
    wanted = set(files) if checksum is True else set() if checksum is False else set(checksum)
    for name, rec in files.items():
        path = root / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointIntegrityError("data file listed in the manifest is missing (or not a regular file)", path=path)
        size = path.stat().st_size
        if size != rec["size"]:
            raise CheckpointIntegrityError(f"size is {size} bytes, the manifest says {rec['size']}: truncated or altered", path=path)
        if name in wanted:
            actual = file_checksum(path)
            if actual != rec["checksum"]:
                raise CheckpointIntegrityError(
                    f"checksum is {actual}, the manifest says {rec['checksum']}: the file is damaged", path=path
                )
    if not extra_ok:
        for entry in root.iterdir():
            if entry.name != MANIFEST and entry.name not in files:
                raise CheckpointIntegrityError("file not listed in the manifest: the checkpoint was altered", path=entry)
