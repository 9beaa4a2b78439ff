"""Copies between an object store and this machine, for conversions (``to_archive``, ``to_directory``,
``export_torchrl`` with a URL on either side run on local copies: disk-bounded, never memory-bounded by the
checkpoint).

- :func:`download_checkpoint`: a verified local copy of a checkpoint prefix (parallel
  ranged reads, checksums compared, ``manifest.json`` written last);
- :func:`download_object`: one object (an archive) as a local file;
- :func:`upload_result`: a conversion's output published under a prefix (a checkpoint:
  manifest last), or as one object (an archive: one multipart upload).

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from pathlib import Path
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save("memory://doc/tools/c")
    >>> sorted(p.name for p in download_checkpoint(path, Path(tempfile.mkdtemp()) / "c").iterdir())
    ['.metadata', '__0_shared.distcp', 'manifest.json']
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.layout import MANIFEST, MAX_MANIFEST_BYTES, is_library_file
from torchrl_dcp.format.manifest import loads_manifest
from torchrl_dcp.format.torchrl_listing import FORMAT_NAME, JSON_LIMIT, written_files
from torchrl_dcp.format.zipformat import ZipError, check_zipfile_agrees
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.storage.directory import DirectoryContainer
from torchrl_dcp.storage.objectstore import ObjectStoreContainer, download, list_objects, read_range, upload_pieces
from torchrl_dcp.storage.objectstore_save import publish_directory
from torchrl_dcp.storage.urls import StorePath, delete_objects


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


def download_object(src: StorePath, directory: Path) -> Path:
    """The single object ``src`` (an archive) as the new file ``directory / src.name``."""
    if not src.is_file():
        raise CheckpointError("no archive here: the object does not exist", path=src)
    size = int(src.fs.info(src.key)["size"])
    download(src, directory / src.name, size)
    return directory / src.name


def upload_file(local: Path, dst: StorePath) -> None:
    """Upload one local file as the object ``dst`` (multipart for S3)."""
    with open(local, "rb") as f:
        upload_pieces(dst, iter(lambda: f.read(8 << 20), b""), os.fstat(f.fileno()).st_size)


def upload_result(local: Path, dst: StorePath, kind: str) -> None:
    """Publish a conversion's local output at ``dst``: ``kind`` ``"checkpoint"`` (a prefix, manifest last),
    ``"file"`` (one object), or ``"torchrl"`` (a ``torchrl.checkpoint`` file or directory tree)."""
    if kind == "checkpoint":
        manifest = DirectoryContainer(local).manifest()
        publish_directory(local, dst, manifest, (local / MANIFEST).read_bytes())
    elif local.is_dir():  # a torchrl.checkpoint directory: its files, then nothing else to commit
        if list_objects(dst):  # the export replaced (overwrite=True): the files it wrote (check_replaceable)
            key = dst.key.rstrip("/")  # (names its manifest lists that are there: never a key elsewhere it names)
            written = (_export_files(dst) or set()) & _names_under(dst)
            delete_objects(dst.fs, sorted(f"{key}/{name}" for name in written))
        for f in sorted(p for p in local.rglob("*") if p.is_file()):
            upload_file(f, StorePath(f"{dst.url}/{f.relative_to(local).as_posix()}", dst.storage_options, dst.fs))
    else:
        upload_file(local, dst)


def _is_archive_of(dst: StorePath, kind: str) -> bool:
    """Whether the object ``dst`` is a ZIP whose ``manifest.json`` is a checkpoint's of ours (``kind`` ``"file"``:
    it parses and validates, as a local archive's must) or ``torchrl.checkpoint``'s (``"torchrl"``), read as a local
    one is: through ranged reads of its central directory and that member (a user's ZIP whose first member has the
    right name is not one)."""
    limit = MAX_MANIFEST_BYTES if kind == "file" else JSON_LIMIT
    try:
        with dst.fs.open(dst.key, "rb") as f, zipfile.ZipFile(f) as z:
            # the layout a local reader accepts: the same directory to zipfile and to ours (a comment only on
            # torchrl's); ours: every member STORED and named as a save names its files (a user's extra file: theirs)
            check_zipfile_agrees(z, comment=kind == "torchrl")
            if kind == "file" and not all(
                i.compress_type == zipfile.ZIP_STORED and is_library_file(i.filename) for i in z.infolist()
            ):
                return False
            info = z.getinfo(MANIFEST)
            if info.file_size > limit:
                return False
            raw = z.read(info)
    except (zipfile.BadZipFile, ZipError, struct.error, KeyError, OSError, ValueError, RuntimeError, EOFError):
        return False  # (NotImplementedError: a RuntimeError)
    if kind == "torchrl":
        try:
            parsed = loads_json(raw)
        except ValueError:
            return False
        return isinstance(parsed, dict) and parsed.get("format") == FORMAT_NAME
    try:
        loads_manifest(raw, dst)
    except CheckpointError:
        return False
    return True


def _names_under(dst: StorePath) -> set[str]:
    """The names (relative to the prefix ``dst``) of every object under it, at any depth."""
    key = dst.key.rstrip("/")
    return {str(k)[len(key) + 1 :] for k in dst.fs.find(key)}


def _export_files(dst: StorePath) -> set[str] | None:
    """The names (relative to ``dst``) of the files of the ``torchrl.checkpoint`` directory export at the prefix
    ``dst`` (its manifest's listing), or ``None`` when it holds none."""
    manifest = dst / MANIFEST
    if not manifest.is_file() or manifest.fs.size(manifest.key) > JSON_LIMIT:
        return None
    try:
        parsed = loads_json(manifest.fs.cat_file(manifest.key))
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("format") != FORMAT_NAME:
        return None
    return written_files(parsed)


def check_replaceable(dst: StorePath, kind: str) -> None:
    """Before a conversion with ``overwrite=True`` replaces what is at ``dst``: only what it would write itself, as
    local destinations are checked. ``kind`` ``"checkpoint"``: a committed checkpoint holding nothing else (the
    publish refuses the rest); ``"file"`` (an archive) and ``"torchrl"`` (an export): an archive object (a ZIP whose
    first member is a manifest or DCP's metadata), or, for an export, a ``torchrl.checkpoint`` prefix. A user's
    object or prefix is never replaced."""
    if kind == "checkpoint":
        return
    if dst.is_file():
        if _is_archive_of(dst, kind):
            return
        raise CheckpointError(
            "is not an archive of a checkpoint; refusing to replace it with overwrite=True (a user's object is never "
            "replaced): choose another destination, or delete it yourself",
            path=dst,
        )
    if list_objects(dst):
        written = _export_files(dst) if kind == "torchrl" else None
        if written is not None:  # only the files that export wrote may be under the prefix: they are what goes
            foreign = sorted(_names_under(dst) - written)
            if foreign:
                raise CheckpointError(
                    f"holds objects torchrl.checkpoint did not write ({foreign[:5]}), which replacing it would "
                    "delete: move them out first, or export elsewhere",
                    path=dst,
                )
        else:
            raise CheckpointError(
                "is a prefix holding objects (a checkpoint, or a user's), not "
                + ("an export of torchrl.checkpoint" if kind == "torchrl" else "an archive object")
                + ": refusing to replace it with overwrite=True; choose another destination",
                path=dst,
            )
