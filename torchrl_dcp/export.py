"""Export to ``torchrl.checkpoint``: selected components of a checkpoint written as torchrl's own format.

:func:`export_torchrl` reads the components from a checkpoint (directory, archive or store, any saved world size, no
process group) and saves them with ``torchrl.checkpoint.Checkpoint``, into a staging entry of ours beside the
destination, then puts it in place in one step (:func:`~torchrl_dcp.storage.commit.publish`): a process killed at any
moment leaves the old export or the new one at the path. What a killed export left beside the path (our staging
entry, and the temporaries torchrl makes beside it: ``.<staging>.stage-``, ``.archive-``, ``.backup-<hex>``) is
removed by the next export there.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl.checkpoint import Checkpoint
    >>> d = tempfile.mkdtemp()
    >>> path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1)).save(d + "/c")
    >>> out = tdcp.export_torchrl(path, d + "/policy.torchrl", ["policy"])
    >>> policy = torch.nn.Linear(2, 1)
    >>> _ = Checkpoint(policy=policy).load(out)
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.convert import any_remote, check_apart, convert_via_local, local_path
from torchrl_dcp.errors import CheckpointError, CheckpointFormatError, IncompatibleComponentError, from_os_error
from torchrl_dcp.placement import is_absent_skeleton
from torchrl_dcp.storage.commit import (
    DestinationLock,
    leftover_owner,
    publish,
    remove_listed,
    remove_tree,
    staging_path,
    sweep_leftovers,
)
from torchrl_dcp.storage.directory import refuse_inside_checkpoint, refuse_working_directory

logger = get_logger(__name__)

__all__ = ["export_torchrl"]


class _StateDict:
    """A saved state presented as an object with ``state_dict()`` (what ``torchrl.checkpoint`` saves)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> Mapping[str, Any]:
        return self._state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # pragma: no cover - export only
        self._state = state


_STATE_DICT_ADAPTERS = ("torchrl_dcp.module", "torchrl_dcp.optimizer", "torchrl_dcp.state_dict")


def export_torchrl(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    components: Collection[str] | None = None,
    *,
    rank: int | None = None,
    format: str = "archive",
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write selected components as a ``torchrl.checkpoint`` checkpoint, e.g. the policy for deployment.

    Reads the components from ``src`` (directory or archive, any saved world size, no
    process group needed) and saves them with ``torchrl.checkpoint.Checkpoint`` so that
    ``torchrl.checkpoint.Checkpoint(policy=module).load(dst)`` restores them in a
    plain process. Modules, optimizers and ``state_dict`` components become state
    dicts; JSON components stay values; an :class:`~torchrl_dcp.RNGState` component
    becomes ``torchrl.checkpoint.GlobalRNGState``'s own format, so
    ``Checkpoint(rng=GlobalRNGState()).load(dst)`` restores that rank's streams.

    Args:
        components: names to export, or one name (default: every replicated component).
        rank: which rank's state to export for per_rank components (RNG streams: rank 0's by default).
        format: ``"archive"`` (one ZIP file) or ``"directory"``.
        metadata: manifest metadata of the export (default: the source's, plus its step).

    Example:
        >>> tdcp.export_torchrl("ckpts/step-100", "policy.torchrl", ["policy"])  # doctest: +SKIP
        >>> torchrl.checkpoint.Checkpoint(policy=policy).load("policy.torchrl")  # doctest: +SKIP
    """
    _check_export_arguments(src, format)  # (before anything is read or written)

    from torchrl_dcp.extract import as_source

    if any_remote(dst):  # the source is read in place (any URL); the export is written locally, then uploaded
        kw = {"rank": rank, "format": format, "metadata": metadata}
        return convert_via_local(export_torchrl, src, dst, "source", "torchrl", overwrite, components=components, **kw)

    source = as_source(src)
    manifest = source.manifest()
    saved = manifest["components"]
    if components is None:
        components = [n for n, r in saved.items() if r["placement"] == "replicated"]
    elif isinstance(components, str):  # one name, as load(components="policy") takes it
        components = [components]
    unknown = sorted(set(components) - set(saved))
    if unknown:
        raise IncompatibleComponentError(
            f"cannot export {unknown}: not in the checkpoint, which holds {sorted(saved)}; pass components=[...] "
            "naming some of these",
            path=src,
        )
    values: dict[str, Any] = {}
    problems: list[str] = []  # (every component checked: the refusal names each, and what can be exported)
    for name in components:
        value, problem = _exported_value(source, name, saved[name], rank)
        if problem is not None:
            problems.append(f"component {name!r} cannot be exported: {problem}")
        else:
            values[name] = value
    if problems:
        raise CheckpointFormatError(
            "; ".join(problems)
            + "; load what cannot be exported with torchrl_dcp"
            + (f", and export the others with components={list(values)!r}" if values else ""),
            path=source.path,
        )
    destination = _destination_for_torchrl(dst, overwrite)
    if not any_remote(src):  # (a store's source is read in place: a local destination is never it)
        check_apart(local_path(src), destination)
    refuse_inside_checkpoint(destination)
    refuse_working_directory(destination)
    meta = dict(manifest["metadata"] if metadata is None else metadata)
    if metadata is None:
        meta.setdefault("step", manifest.get("step"))
        meta["exported_from"] = str(source.path)
    _write_export(values, format, meta, destination, overwrite)
    return destination


def _write_export(
    values: Mapping[str, Any], format: str, meta: Mapping[str, Any], destination: Path, overwrite: bool
) -> None:
    """torchrl's save of ``values`` into a staging entry of ours, put at ``destination`` in one step; what killed
    exports left beside it swept first (under the destination's lock: no live writer has them)."""
    from torchrl.checkpoint import Checkpoint as TorchRLCheckpoint

    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with DestinationLock(destination):  # (as a save or conversion: what a killed export left is swept)
            sweep_leftovers(destination, _remove_export)
            for temporary in torchrl_temporaries(destination):
                _remove_temporary(temporary)
            staging, published = staging_path(destination), False
            try:
                TorchRLCheckpoint(format=format, **values).save(staging, metadata=meta)  # type: ignore[arg-type]
                _publish_export(staging, destination, overwrite)
                published = True
            finally:
                if not published:
                    _remove_export(staging)
    except CheckpointError:
        raise
    except OSError as err:  # (torchrl stages beside its target and removes its staging on failure)
        raise from_os_error(err, "exporting", destination, after="an existing export there is unchanged") from None


def _publish_export(new: Path, destination: Path, overwrite: bool) -> None:
    """Put the export written at ``new`` at ``destination``, in place of an export there in one step (an exchange
    where the file system has one: a process killed at any moment leaves the old export or the new one there). The
    old one is checked again once out of the way (a file a user put into it while the export ran is theirs: it is put
    back, and nothing is exported), then only the files torchrl wrote into it are deleted."""
    refusal: list[CheckpointError] = []

    def replaceable(old: Path) -> bool:  # (asked only when something is at the destination)
        try:
            if not overwrite:  # (made there since it was looked at)
                raise CheckpointError("already exists; pass overwrite=True to replace it", path=destination)
            _destination_for_torchrl(old, overwrite=True)
        except CheckpointError as err:
            refusal.append(err)
            return False
        return True

    try:
        publish(new, destination, replaceable=replaceable, remove=_remove_replaced_export)
    except CheckpointError as err:
        if not refusal:
            raise
        raise CheckpointError(f"{refusal[0].message}; nothing was exported", path=destination) from err


def _remove_replaced_export(old: Path) -> list[str]:
    kept = _remove_export(old)
    if kept:
        logger.warning("%s: replaced; what it held besides the old export was kept at %s", old.parent, old)
    return kept


def _remove_export(path: Path) -> list[str]:
    """Delete a torchrl export (a ZIP file, or the files its manifest lists and the directories they leave empty,
    never through a link: :func:`~torchrl_dcp.storage.commit.remove_listed`), or what a save of ours left there (a
    staging or trash entry of ours holding none: :func:`~torchrl_dcp.storage.commit.remove_tree`); returns what was
    kept in its directory (a user's file)."""
    from torchrl_dcp.format.torchrl_listing import written_files
    from torchrl_dcp.torchrl_format.detect import read_torchrl_manifest

    if not path.is_dir() or path.is_symlink():
        return remove_listed(path, set())  # (a file or link: itself; nothing at the path: nothing)
    manifest = read_torchrl_manifest(path)
    return remove_listed(path, written_files(manifest)) if manifest is not None else remove_tree(path)


def _check_export_arguments(src: Any, format: str) -> None:
    from torchrl_dcp.torchrl_format import is_torchrl_checkpoint

    if format not in ("archive", "directory"):
        raise ValueError(f"format must be 'archive' (one ZIP file) or 'directory', not {format!r}")
    if isinstance(src, (str, os.PathLike)) and is_torchrl_checkpoint(src):
        raise CheckpointError(
            "is a torchrl.checkpoint checkpoint already: torchrl.checkpoint.Checkpoint loads it as it is (and "
            "DistributedCheckpoint.load restores it); export_torchrl reads torchrl_dcp checkpoints",
            path=src,
        )


def _exported_value(source: Any, name: str, rec: Mapping[str, Any], rank: int | None) -> tuple[Any, str | None]:
    """``(what torchrl.checkpoint saves for the component, None)``, or ``(None, why it cannot)``."""
    from torchrl_dcp.adapters.rng import torchrl_rng_layout
    from torchrl_dcp.extract import read_component

    is_rng = rec["adapter"] == _RNG_ADAPTER
    if rec["placement"] == "per_rank" and rank is None and not is_rng:
        raise ValueError(f"component {name!r} is per_rank: pass rank=... to choose whose state to export")
    if not is_rng and rec["adapter"] not in _STATE_DICT_ADAPTERS and rec["adapter"] != "torchrl_dcp.json":
        return None, f"{rec['adapter']}: export supports modules, optimizers, state_dict objects and JSON values"
    read_rank = 0 if is_rng and rank is None else rank  # (an RNG export defaults to rank 0's streams)
    saved = (rec.get("ranks") or {}).get(str(read_rank)) if rec["placement"] == "per_rank" else None
    if isinstance(saved, Mapping) and is_absent_skeleton(saved.get("state")):
        return None, f"rank {read_rank} registered none when it was saved (other ranks did): pass another rank=..."
    state = read_component(source, name, rank=read_rank)
    if is_rng and isinstance(state, Mapping):
        return _StateDict(torchrl_rng_layout(state)), None
    if rec["adapter"] in _STATE_DICT_ADAPTERS and isinstance(state, Mapping):
        return _StateDict(state), None
    if rec["adapter"] != "torchrl_dcp.json":
        return None, f"its state is a {type(state).__name__}"
    problem = _not_torchrl_json(state, name)
    if problem is not None:
        return None, f"{problem}, which torchrl.checkpoint cannot store as JSON"
    return state, None


def _not_torchrl_json(value: Any, where: str) -> str | None:
    """Where ``value`` holds something ``torchrl.checkpoint`` does not store as a JSON value (it takes tensors and
    NumPy values as numbers and lists, paths as strings, mappings, lists, tuples and scalars), else ``None``."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, np.ndarray, np.generic)):
        return None
    if issubclass(type(value), Path):  # a value, not a location: torchrl writes a concrete path as its string
        return None
    if isinstance(value, Mapping):
        key = next((k for k in value if not isinstance(k, str)), None)
        if key is not None:  # (a JSON object's keys are strings: torchrl would load {1: x} as {"1": x})
            return f"{where} has the key {key!r} of type {type(key).__name__} (JSON keys are strings: it would load as {str(key)!r})"
        found = (_not_torchrl_json(v, f"{where}[{k!r}]") for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        found = (_not_torchrl_json(v, f"{where}[{i}]") for i, v in enumerate(value))
    else:
        return f"{where} is a {type(value).__name__}"
    return next((f for f in found if f is not None), None)


_RNG_ADAPTER = "torchrl_dcp.rng"


def _destination_for_torchrl(dst: str | os.PathLike, overwrite: bool) -> Path:
    from torchrl_dcp.torchrl_format.detect import read_torchrl_manifest, written_files

    destination = local_path(dst)
    if destination.exists() or destination.is_symlink():
        if not overwrite:
            raise CheckpointError("already exists; pass overwrite=True to replace it", path=destination)
        if destination.is_symlink():  # (never replaced through, whatever it points to)
            raise CheckpointError(
                "is a symbolic link: overwrite=True never replaces a link (torchrl.checkpoint would replace what it "
                "points to); export to the path it points to, or elsewhere",
                path=destination,
            )
        manifest = read_torchrl_manifest(destination)
        if manifest is None:  # torchrl would replace anything
            raise CheckpointError(
                "is not a torchrl.checkpoint checkpoint: overwrite=True replaces only one (a directory or file of "
                "yours is never deleted); export elsewhere, or remove it yourself",
                path=destination,
            )
        if destination.is_dir():  # torchrl replaces the whole tree: only the files it wrote may be in it
            foreign = _not_written(destination, written_files(manifest))
            if foreign:
                raise CheckpointError(
                    f"holds entries torchrl.checkpoint did not write ({foreign[:5]}), which replacing it would "
                    "delete: move them out first, or export elsewhere",
                    path=destination,
                )
    return destination  # torchrl.checkpoint replaces an existing one atomically


def _not_written(directory: Path, written: set[str]) -> list[str]:
    """The entries of the tree at ``directory`` (links not followed) that are not regular files in ``written``, nor
    directories leading to them."""
    parents = {p for name in written for p in _parents(name)}
    foreign = []
    for root, dirs, files in os.walk(directory):  # (os.walk never follows links to directories)
        rel = Path(root).relative_to(directory).as_posix()
        rel = "" if rel == "." else f"{rel}/"
        for d in list(dirs):
            if (directory / f"{rel}{d}").is_symlink() or f"{rel}{d}" not in parents:
                foreign.append(f"{rel}{d}/")
                dirs.remove(d)
        foreign += [f"{rel}{f}" for f in files if f"{rel}{f}" not in written or (Path(root) / f).is_symlink()]
    return sorted(foreign)


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


#: what ``torchrl.checkpoint.Checkpoint.save(target)`` makes beside ``target`` while it saves (its staging directory,
#: its archive before it is renamed, the old target set aside): ``.<target>.<kind>-<uuid4 hex>``
_TORCHRL_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?:stage|archive|backup)-[0-9a-f]{32}\Z")


def torchrl_temporaries(destination: Path) -> list[Path]:
    """What torchrl left beside the staging entries of exports to ``destination`` (a killed export: torchrl removes
    them itself otherwise). Only while holding :class:`~torchrl_dcp.storage.commit.DestinationLock` on
    ``destination``: each is then a dead export's.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> staging = staging_path(d / "policy.torchrl")
        >>> (d / f".{staging.name}.stage-{'0' * 32}").mkdir()
        >>> (d / ".mine.stage-0").mkdir()  # (no export's)
        >>> [p.name.rsplit(".", 1)[1] for p in torchrl_temporaries(d / "policy.torchrl")]
        ['stage-00000000000000000000000000000000']
    """
    try:
        names = os.listdir(destination.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        m = _TORCHRL_TEMPORARY.match(name)
        if m is not None and leftover_owner(m.group("target")) == destination.name:
            found.append(destination.parent / name)
    return sorted(found)


def _remove_temporary(path: Path) -> None:
    """Remove one of torchrl's temporaries (its name proves it is: :func:`torchrl_temporaries`), never through a
    link: a directory with everything in it (torchrl writes any file names there), a file or link itself."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # (links inside are removed, never followed)
    else:
        path.unlink(missing_ok=True)
