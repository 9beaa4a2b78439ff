"""Rotation listings and conversions for object-store checkpoints (what ``rotation.py``/``convert.py`` dispatch to).

- :func:`store_entries`: the ``step-<N>`` checkpoints under a prefix, committed when
  their manifest reads and validates (a prefix without one is a killed save);
- :func:`download_checkpoint`: a verified local copy of a checkpoint prefix
  (parallel ranged reads, checksums compared, ``manifest.json`` written last);
- :func:`convert_via_local`: ``to_archive``/``to_directory``/``export_torchrl`` with a
  URL on either side run on a local temporary copy (disk-bounded, never memory-bounded
  by the checkpoint), and the result is uploaded: a checkpoint prefix manifest last,
  a single file (an archive) as one multipart upload.

Example:
    >>> import torch, torchrl_dcp as tdcp
    >>> rotation = tdcp.CheckpointRotation("memory://doc/tools", keep_last=1)
    >>> ckpt = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)})
    >>> for step in (1, 2):
    ...     _ = rotation.save(ckpt, step=step)
    >>> [e.step for e in rotation.entries()]
    [2]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.storage.layout import MANIFEST
from torchrl_dcp.storage.objectstore import (
    ObjectStoreContainer,
    download,
    list_objects,
    read_range,
    upload_pieces,
)
from torchrl_dcp.storage.objectstore_save import publish_directory, remove_prefix
from torchrl_dcp.storage.urls import StorePath, is_store, is_url, resolve_path


def store_entries(directory: StorePath, metric: str | None, include_uncommitted: bool) -> list[Any]:
    """``rotation.list_entries`` for a prefix: ``step-<N>`` checkpoints sorted by step."""
    from torchrl_dcp.rotation import _ENTRY, RotationEntry, _metric, entry_sequence

    found = []
    for name, info in list_objects(directory).items():
        m = _ENTRY.match(name)
        if not m or m.group(2) or info.get("type") != "directory":
            continue  # archives are not kept in stores; an object named step-N is not ours
        path = directory / name
        error = None
        try:
            manifest = ObjectStoreContainer(path).manifest()
        except Exception as err:  # noqa: BLE001 - one damaged entry must never break a listing
            manifest, error = {}, f"{type(err).__name__}: {err}"
        if error is not None and not include_uncommitted:
            continue
        created_at = manifest.get("created_at")
        found.append(
            RotationEntry(
                step=int(m.group(1)),
                path=path,  # type: ignore[arg-type]
                committed=error is None,
                archive=False,
                size=sum(int(i.get("size") or 0) for i in list_objects(path).values()),
                metric=_metric(manifest.get("metadata", {}).get(metric), metric) if metric and error is None else None,
                created_at=created_at if isinstance(created_at, str) else None,
                error=error,
                sequence=entry_sequence(manifest),
            )
        )
    return sorted(found, key=lambda e: e.step)


def remove_entry(path: StorePath) -> bool:
    """Delete a checkpoint prefix, manifest first (it is never seen half-deleted); False when already gone."""
    if not list_objects(path):
        return False
    remove_prefix(path)
    return True


def download_checkpoint(src: StorePath, local: Path) -> Path:
    """A verified copy of the checkpoint prefix ``src`` in the new local directory ``local``; returns ``local``."""
    container = ObjectStoreContainer(src)
    files = container.manifest()["files"]
    container.check(False)  # every listed object there with its size, nothing unlisted
    raw = read_range(src / MANIFEST, 0, int(src.fs.info((src / MANIFEST).key)["size"]))
    local.mkdir()
    for name, rec in files.items():
        download(src / name, local / name, rec["size"], rec["checksum"])
    (local / MANIFEST).write_bytes(raw)
    return local


def upload_file(local: Path, dst: StorePath) -> None:
    """Upload one local file as the object ``dst`` (multipart for S3)."""
    with open(local, "rb") as f:
        upload_pieces(dst, iter(lambda: f.read(8 << 20), b""), os.fstat(f.fileno()).st_size)


@contextlib.contextmanager
def _local_copy(src: Any, kind: str, tmp: Path) -> Iterator[Any]:
    if not is_store(src):
        yield src
        return
    if kind == "checkpoint":
        yield download_checkpoint(src, tmp / "src")
        return
    if not src.is_file():
        raise CheckpointError("no archive here: the object does not exist", path=src)
    size = int(src.fs.info(src.key)["size"])
    download(src, tmp / src.name, size)
    yield tmp / src.name


def convert_via_local(
    fn: Callable[..., Any], src: Any, dst: Any, src_kind: str, dst_kind: str, overwrite: bool, **kwargs: Any
) -> Any:
    """Run the conversion ``fn(src, dst, overwrite=..., **kwargs)`` on local copies of URL ends.

    ``src_kind``/``dst_kind``: ``"checkpoint"`` (a prefix) or ``"file"`` (one object); a
    ``"torchrl"`` destination (``export_torchrl``) is a file or a directory tree.
    """
    src = resolve_path(src) if is_url(src) else src
    dst = resolve_path(dst) if is_url(dst) else dst
    if is_store(dst) and not overwrite and (dst.is_file() or list_objects(dst)):
        raise CheckpointError("already exists; pass overwrite=True (CLI: --overwrite) to replace it", path=dst)
    with tempfile.TemporaryDirectory(prefix="tdcp-convert-") as tmp_dir:
        tmp = Path(tmp_dir)
        with _local_copy(src, src_kind, tmp) as local_src:
            local_dst = tmp / ("out-" + (dst.name if is_store(dst) else "x")) if is_store(dst) else dst
            out = fn(local_src, local_dst, overwrite=overwrite, **kwargs)
        if not is_store(dst):
            return out
        if dst_kind == "checkpoint":
            from torchrl_dcp.storage.container import DirectoryContainer

            manifest = DirectoryContainer(out).manifest()
            publish_directory(Path(out), dst, manifest, (Path(out) / MANIFEST).read_bytes())
        elif Path(out).is_dir():  # a torchrl.checkpoint directory: its files, then nothing else to commit
            if list_objects(dst):
                remove_prefix(dst)
            for f in sorted(p for p in Path(out).rglob("*") if p.is_file()):
                upload_file(f, StorePath(f"{dst.url}/{f.relative_to(out).as_posix()}", dst.storage_options, dst.fs))
        else:
            upload_file(Path(out), dst)
        return dst
