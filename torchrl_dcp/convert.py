"""Conversions: checkpoint directory ↔ single-file ZIP archive (export to ``torchrl.checkpoint``: ``export.py``).

Both directions copy every file with several threads through reused buffers
(memory stays bounded by ``buffer_size`` whatever the checkpoint's size), keep the
data files byte for byte, verify every checksum on the way, and publish atomically (temporary name,
fsync, rename, fsync of the directory). A checkpoint saved by any number of ranks
converts the same way: it is one directory by then.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> d = tempfile.mkdtemp()
    >>> path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1)).save(d + "/c")
    >>> archive = tdcp.to_archive(path, d + "/c.zip")
    >>> back = tdcp.to_directory(archive, d + "/c2")
    >>> sorted(p.name for p in back.iterdir()) == sorted(p.name for p in path.iterdir())
    True
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    from_os_error,
)
from torchrl_dcp.format.checksums import checksum_mismatch, format_crc
from torchrl_dcp.format.layout import DCP_METADATA, MANIFEST, MAX_MANIFEST_BYTES, is_data_file
from torchrl_dcp.format.manifest import loads_manifest
from torchrl_dcp.storage.archive import BUFFER, ArchiveContainer, Progress, byte_counter, write_archive
from torchrl_dcp.storage.backends import is_remote, location_for, read_manifest, save_location
from torchrl_dcp.storage.commit import (
    DestinationLock,
    publish,
    remove_tree,
    staging_path,
    sweep_leftovers,
    write_file_durably,
)
from torchrl_dcp.storage.copying import CopyRange, copy_ranges
from torchrl_dcp.storage.directory import (
    DirectoryContainer,
    foreign_entries,
    is_replaceable,
    refuse_inside_checkpoint,
    refuse_working_directory,
)
from torchrl_dcp.storage.files import DirHandle, absent_because, open_regular, read_whole
from torchrl_dcp.storage.trailers import check_identities
from torchrl_dcp.storage.urls import resolve_path

logger = get_logger(__name__)

__all__ = ["to_archive", "to_directory"]


def any_remote(*paths: Any) -> bool:
    return any(is_remote(p) for p in paths)


def convert_via_local(
    fn: Callable[..., Any], src: Any, dst: Any, src_kind: str, dst_kind: str, overwrite: bool, **kwargs: Any
) -> Any:
    """Run the conversion ``fn(src, dst, overwrite=..., **kwargs)`` on local copies of remote ends.

    ``src_kind``/``dst_kind``: ``"checkpoint"`` (a directory or prefix) or ``"file"`` (an
    archive); a ``"source"`` is read in place wherever it is; a ``"torchrl"`` destination
    (``export_torchrl``) is a file or a directory tree. The remote ends are copied
    through this machine's disk (never held in memory), the result published last.
    """
    source, target = location_for(src), save_location(dst)  # (a local destination is a path: a link is not followed)
    if not target.is_local:  # (a local one is checked by the conversion as it writes)
        target.check_destination(dst_kind, overwrite)
    with tempfile.TemporaryDirectory(prefix="tdcp-convert-") as tmp_dir:
        tmp = Path(tmp_dir)
        with contextlib.ExitStack() as stack:
            local_src = src if src_kind == "source" else stack.enter_context(source.local_copy(src_kind, tmp))
            local_dst = target.path if target.is_local else tmp / f"out-{target.path.name}"
            try:
                out = fn(local_src, local_dst, overwrite=overwrite, **kwargs)
            except CheckpointError as err:  # named as the user named them, not as the copies (gone when it is read)
                if local_src is not src:
                    err.relocate(str(local_src), str(src))
                if not target.is_local:
                    err.relocate(str(local_dst), str(dst))
                raise
        if target.is_local:
            return out
        target.receive(Path(out), dst_kind)
        return target.path


def local_path(path: str | os.PathLike) -> Path:
    """A local path argument (the remote ends went through :func:`convert_via_local`) resolved as saves and loads
    resolve it: ``~``, ``file://`` URLs (:func:`~torchrl_dcp.storage.urls.resolve_path`)."""
    resolved: Path = resolve_path(path)
    return resolved


def check_apart(source: Path, destination: Path) -> None:
    """A conversion never replaces the checkpoint it reads (inside it, :func:`refuse_inside_checkpoint` refuses)."""
    try:
        same = source.resolve() == destination.resolve()
    except (OSError, RuntimeError):  # (a link loop: left to the checks that open it)
        return
    if same:
        raise CheckpointError(
            "is the checkpoint being converted: a conversion never replaces what it reads; choose another destination",
            path=destination,
        )


def _check_replaceable(destination: Path, overwrite: bool, empty_ok: bool = False) -> None:
    """Refuse to replace anything but a torchrl_dcp checkpoint (and only with ``overwrite``); never a link, nor a
    checkpoint directory holding entries no save writes there (a file of the user's: the rule saves apply,
    :func:`~torchrl_dcp.storage.directory.foreign_entries`). ``empty_ok``: an empty directory is no obstacle (a
    directory is written there, as a save writes into one)."""
    if not (destination.exists() or destination.is_symlink()):
        return
    if empty_ok and destination.is_dir() and not destination.is_symlink() and not any(destination.iterdir()):
        return
    # what is there first: overwrite=True is the next step only where it would replace it
    if destination.is_symlink():
        raise CheckpointError(
            "is a symbolic link; a conversion never replaces one: convert to the path it points to, or remove the "
            "link, or choose another destination",
            path=destination,
        )
    try:
        listed = read_manifest(destination)["files"]
    except CheckpointError:
        raise CheckpointError(
            "exists and is not a torchrl_dcp checkpoint; a conversion never replaces it: choose another destination",
            path=destination,
        ) from None
    foreign = foreign_entries(destination, listed) if destination.is_dir() else []
    if foreign:
        raise CheckpointError(
            f"holds entries a checkpoint never holds ({foreign[:5]}); refusing to replace it: move them, or convert "
            "elsewhere",
            path=destination,
        )
    if not overwrite:
        raise CheckpointError(
            "already exists (a checkpoint); pass overwrite=True (CLI: --overwrite) to replace it", path=destination
        )


def _still_replaceable(path: Path) -> bool:
    """What :func:`_check_replaceable` accepted, asked again of what was at the destination once the commit moved
    it aside: a checkpoint directory holding nothing of a user's, or a checkpoint archive (never a link)."""
    if path.is_symlink():
        return False
    if path.is_dir():
        return is_replaceable(path)
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


@contextlib.contextmanager
def _converting(what: str, dst: str | os.PathLike, overwrite: bool, into_directory: bool = False) -> Iterator[Path]:
    """Hold the destination's lock, remove what killed saves/conversions to it left, report OSErrors clearly.

    The lock (``.<name>.tdcp-lock``, as for saves) keeps two conversions (or a save)
    to one destination apart, so every staging/temporary entry named after the
    destination found while holding it is a dead writer's and is removed.
    """
    destination = local_path(dst)
    refuse_inside_checkpoint(destination)  # (the source's, or another's) before the lock beside it is made
    refuse_working_directory(destination)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with DestinationLock(destination):
            _check_replaceable(destination, overwrite, empty_ok=into_directory)
            sweep_leftovers(destination)
            yield destination
    except CheckpointError:
        raise
    except OSError as err:
        raise from_os_error(
            err, what, destination, after=f"nothing was published at {destination} (what was there is unchanged)"
        ) from None


def _read_manifest_bytes(src: Path) -> tuple[dict[str, Any], bytes]:
    """The manifest of the directory ``src``, validated, and the exact bytes it was parsed from."""
    read_manifest(src)  # the usual errors for a missing, linked or foreign manifest
    data = read_whole(src / MANIFEST, MAX_MANIFEST_BYTES, src / MANIFEST)
    return loads_manifest(data, src / MANIFEST), data


def to_archive(
    src_dir: str | os.PathLike,
    dst_file: str | os.PathLike,
    *,
    overwrite: bool = False,
    buffer_size: int = BUFFER,
    progress: Progress | None = None,
) -> Path:
    """Pack the checkpoint directory ``src_dir`` into the single ZIP file ``dst_file``.

    Args:
        overwrite: replace an existing checkpoint at ``dst_file``.
        buffer_size: memory for the copy buffers of all threads together.
        progress: called as ``progress(bytes_done, bytes_total)``.

    Raises:
        CheckpointIntegrityError: a file is missing, resized, unlisted or fails its
            checksum (nothing is published).
        CheckpointError: the destination is held by another save or conversion, is
            not a checkpoint, or the file system refused (name too long, disk full,
            permissions: the message names the path and what to do).

    Example:
        >>> tdcp.to_archive("ckpts/step-100", "step-100.zip")  # doctest: +SKIP
    """
    if isinstance(dst_file, str) and dst_file.endswith(("/", os.sep)):  # (Path() drops the slash: it wrote "b")
        raise CheckpointError(
            "ends with a slash, as a directory does: an archive is one file; name it (e.g. step-100.zip)",
            path=dst_file,
        )
    if any_remote(src_dir, dst_file):
        return convert_via_local(to_archive, src_dir, dst_file, "checkpoint", "file", overwrite, buffer_size=buffer_size, progress=progress)  # fmt: skip
    src = local_path(src_dir)
    if not src.exists():
        raise CheckpointNotFoundError(f"no checkpoint here: {absent_because(src)}", path=src)
    if not src.is_dir():
        raise CheckpointFormatError("not a checkpoint directory (already an archive? use to_directory)", path=src)
    try:
        _, manifest_bytes = _read_manifest_bytes(src)  # the archive keeps the original bytes
        container = DirectoryContainer(src)
        manifest = container.manifest()
        listed = manifest["files"]  # the root's files and those the shards list (format 7)
        container.check(False)
        _check_identities(container, manifest)
    except CheckpointError:
        raise
    except OSError as err:
        raise from_os_error(err, "reading the checkpoint to pack", src) from None
    names = sorted(listed, key=lambda n: (n != DCP_METADATA, n))
    files = [(n, src / n, listed[n]["size"], listed[n]["checksum"]) for n in names]
    check_apart(src, local_path(dst_file))
    with _converting(f"packing {src.name} into an archive", dst_file, overwrite) as destination:
        write_archive(
            files,
            manifest_bytes,
            destination,
            buffer_size=buffer_size,
            progress=progress,
            replaceable=_still_replaceable,
        )
    return destination


def to_directory(
    src_file: str | os.PathLike,
    dst_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    buffer_size: int = BUFFER,
    progress: Progress | None = None,
) -> Path:
    """Unpack the archive ``src_file`` into the checkpoint directory ``dst_dir``.

    The files are written into a staging directory next to ``dst_dir`` with their
    checksums verified, ``manifest.json`` last, then the directory is moved into place.
    Staging directories left by killed conversions to ``dst_dir`` are removed first.

    Example:
        >>> tdcp.to_directory("step-100.zip", "ckpts/step-100")  # doctest: +SKIP
    """
    if any_remote(src_file, dst_dir):
        return convert_via_local(to_directory, src_file, dst_dir, "file", "checkpoint", overwrite, buffer_size=buffer_size, progress=progress)  # fmt: skip
    path = local_path(src_file)
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint here: {absent_because(path)}", path=path)
    if path.is_dir():
        raise CheckpointFormatError("is a directory, not an archive (use to_archive)", path=path)
    path = location_for(path).path  # a link to an archive is read as the archive it names, as loads read it
    if not path.is_file():
        raise CheckpointFormatError("not a regular file (a FIFO or device?), so not an archive", path=path)
    try:
        source = ArchiveContainer(path)
        manifest = source.manifest()
        source.check(False)  # sizes and ZIP CRCs against the manifest
        _check_identities(source, manifest)
    except CheckpointError:
        raise
    except OSError as err:
        raise from_os_error(err, "reading the archive to unpack", path) from None
    check_apart(path, local_path(dst_dir))
    with _converting(f"unpacking {path.name}", dst_dir, overwrite, into_directory=True) as destination:
        _unpack(source, manifest["files"], destination, buffer_size, progress)
    return destination


def _unpack(
    source: ArchiveContainer, files: dict[str, Any], destination: Path, buffer_size: int, progress: Progress | None
) -> None:
    path = source.path
    advance = byte_counter(sum(rec["size"] for rec in files.values()), progress)
    staging = staging_path(destination)
    staging.mkdir()
    within = DirHandle.open(staging)  # every file below is created through this descriptor, never by path
    try:
        names = sorted(files, key=lambda n: source.member(n).data_offset)
        archive = open_regular(path)
        outs: list[int] = []
        try:
            ranges = []
            for name in names:
                outs.append(within.create(name))
                m = source.member(name)
                ranges.append(CopyRange(archive, m.data_offset, m.size, outs[-1], 0, f"{path}::{name}"))
            crcs = copy_ranges(ranges, buffer_size=buffer_size, progress=advance)
            for fd in outs:
                os.fsync(fd)
        finally:
            for fd in [archive, *outs]:
                os.close(fd)
        for name, crc in zip(names, crcs):
            if format_crc(crc) != files[name]["checksum"]:
                raise checksum_mismatch(format_crc(crc), files[name]["checksum"], f"{path}::{name}", "member")
        manifest = source.read_raw_member(MANIFEST, MAX_MANIFEST_BYTES)
        write_file_durably(staging / MANIFEST, manifest, within=within)
        within.check_tree({**{n: rec["size"] for n, rec in files.items()}, MANIFEST: len(manifest)})
        within.fsync()
        # a staging path swapped meanwhile is refused, and what is at the destination checked again once aside
        publish(staging, destination, expect=within.inode(), replaceable=_still_replaceable)
    except BaseException:
        remove_tree(staging)
        raise
    finally:
        within.close()


def _check_identities(container: Any, manifest: Mapping[str, Any]) -> None:
    """Every listed data file carries this save's identity (what a load and ``verify`` check): a conversion never
    packs or unpacks a file copied in from another save."""
    if manifest.get("save_id") is not None:
        names = [n for n in manifest["files"] if is_data_file(n)]
        check_identities(container, names, manifest["files"], manifest["save_id"])
