"""Single-file ZIP archives of a checkpoint: written by streaming, read in place.

An archive holds ``manifest.json`` and the checkpoint's files unchanged, STORED (no
compression), each member's data aligned to 64 bytes (padding in an extra field),
ZIP64 where a member needs it. :class:`ArchiveContainer` reads one without extracting
it: the central directory is validated, and DCP reads every tensor at its offset
inside the ZIP, so partial loads read only the selected tensors' bytes.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> d = tempfile.mkdtemp()
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}).save(d + "/c")
    >>> tdcp.to_archive(path, d + "/c.zip").name
    'c.zip'
    >>> from torchrl_dcp.storage.archive import ArchiveContainer
    >>> ArchiveContainer(d + "/c.zip").manifest()["format"]
    'torchrl_dcp'
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
import uuid
import zipfile
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import CheckpointError, CheckpointFormatError, CheckpointIntegrityError, CheckpointNotFoundError
from torchrl_dcp.format import manifest as schema
from torchrl_dcp.format.checksums import checksum_mismatch, crc32, format_crc
from torchrl_dcp.format.layout import MANIFEST, MAX_MANIFEST_BYTES, is_plain_name
from torchrl_dcp.format.zipformat import (
    U32,
    ZIPALIGN_PAD,
    ZipError,
    central_directory_span,
    central_entries,
    central_entry,
    end_records,
    local_header,
    local_sizes,
)
from torchrl_dcp.storage.base import ByteRange, EntryKind, Location, ManifestParts, check_listing, files_to_check
from torchrl_dcp.storage.commit import TMP_TAG, publish, remove_entry
from torchrl_dcp.storage.files import absent_because, open_regular
from torchrl_dcp.storage.filesums import fds_checksums

ALIGN = 64  # every member's data starts at a multiple of this (zipformat.ALIGN)
BUFFER = 4 << 20
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. extra length: 30 bytes
_LOCAL_SIG = b"PK\x03\x04"

Progress = Callable[[int, int], None]


def byte_counter(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A callback that adds copied bytes and reports ``progress(done, total)`` after each chunk."""
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    return advance


@dataclass(frozen=True, slots=True)
class Member:
    """One STORED member: where its bytes are in the archive."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int


# ---------------------------------------------------------------------- reading
def read_index(path: Path) -> dict[str, Member]:
    """Validate the central directory and every local header; return the members by name.

    Raises:
        CheckpointFormatError: not a ZIP, a damaged central directory or local header,
            a compressed, encrypted, duplicate, overlapping or out-of-bounds member.
        CheckpointIntegrityError: a member name that could escape (absolute, ``..``, ``\\``).
    """
    with os.fdopen(open_regular(path), "rb") as f:  # no link followed, a FIFO swapped in refused (never waited on)
        return _read_index(path, f)


def _read_index(path: Path, f: Any) -> dict[str, Member]:
    fd = f.fileno()
    try:
        size = os.fstat(fd).st_size
        # our archives end with the end record (no comment); a data file may itself be a ZIP (torch.save), whose
        # end record must not be taken
        cd_offset, cd_size, entries = central_directory_span(lambda o, n: os.pread(fd, n, o), size)
        if cd_size > MAX_MANIFEST_BYTES:
            raise ZipError(f"a central directory of {cd_size} bytes is implausibly large")
        directory = os.pread(fd, cd_size, cd_offset)
        if len(directory) != cd_size:
            raise ZipError("central directory truncated")
    except (ZipError, OSError, struct.error) as err:
        raise CheckpointFormatError(
            f"not a readable ZIP archive, or its central directory is damaged ({err}): no ZIP end record at the end "
            "of the file means not an archive, or one truncated or with trailing bytes",
            path=path,
        ) from None
    members: dict[str, Member] = {}
    contradiction: CheckpointFormatError | None = None  # the first local header that contradicts the directory
    # the same open file throughout: whatever is swapped in at its path later is never read
    try:
        for entry in central_entries(directory):
            m, local = _member(fd, path, entry, cd_offset)
            contradiction = contradiction or local
            if m.name in members:
                raise CheckpointFormatError("the archive holds this member twice", path=f"{path}::{m.name}")
            members[m.name] = m
    except (ZipError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"the central directory is damaged ({err})", path=path) from None
    if len(members) != entries:
        raise CheckpointFormatError(
            f"the end record counts {entries} members, the central directory holds {len(members)}: damaged", path=path
        )
    spans = sorted(members.values(), key=lambda m: m.header_offset)
    for a, b in itertools.pairwise(spans):
        if a.data_offset + a.size > b.header_offset:
            raise CheckpointFormatError(f"member overlaps member {a.name!r}", path=f"{path}::{b.name}")
    if contradiction is not None:  # (after the layout's checks: a member's bounds are named first)
        raise contradiction
    return members


_UNIX_TYPES = {stat.S_IFLNK: "symbolic link", stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO"}


def _member(
    fd: int, path: Path, entry: tuple[str, int, int, int, int, int, int, int, int], cd_offset: int
) -> tuple[Member, CheckpointFormatError | None]:
    """One central directory entry checked (name, a regular file, STORED, unencrypted, in bounds, on the one disk)
    against its local header (signature, method, name); with the refusal of a local header whose flags, CRC-32 or
    sizes contradict the entry (:func:`_local_contradiction`), raised once the archive's layout is checked."""
    name, flags, method, crc, csize, file_size, header_offset, disk, unix_type = entry
    where = f"{path}::{name}"
    _check_name(name, where)
    if unix_type not in (0, stat.S_IFREG):  # a link's target, a directory, a device: an unzip would make one
        raise CheckpointFormatError(
            f"member is recorded as a {_UNIX_TYPES.get(unix_type, 'special file')}, not a regular file "
            f"(Unix mode {oct(unix_type)}): torchrl_dcp archives hold regular files only; the archive was altered",
            path=where,
        )
    if disk != 0:
        raise CheckpointFormatError(
            f"central directory puts the member's local header on disk {disk}: a split (multi-disk) archive; "
            "torchrl_dcp archives are one file",
            path=where,
        )
    if flags & 0x1:
        raise CheckpointFormatError("member is encrypted; torchrl_dcp archives never are", path=where)
    if method != zipfile.ZIP_STORED or csize != file_size:
        raise CheckpointFormatError(
            f"member is compressed (method {method}); torchrl_dcp archives are STORED "
            "(convert the checkpoint again with tdcp.to_archive)",
            path=where,
        )
    if not 0 <= header_offset < cd_offset:
        raise CheckpointFormatError(
            f"central directory puts the member at offset {header_offset}, outside the archive "
            "(the central directory is damaged)",
            path=where,
        )
    encoded = name.encode("utf-8" if flags & 0x800 else "cp437")
    header = os.pread(fd, _LOCAL_HEADER.size + len(encoded), header_offset)
    if len(header) < _LOCAL_HEADER.size:
        raise CheckpointFormatError("local header lies beyond the end of the archive", path=where)
    sig, _, local_flags, method, _, _, local_crc, local_csize, local_size, name_len, extra_len = (
        _LOCAL_HEADER.unpack_from(header)
    )
    if sig != _LOCAL_SIG or method != zipfile.ZIP_STORED:
        raise CheckpointFormatError("local header is damaged (central directory points elsewhere)", path=where)
    if name_len != len(encoded) or header[_LOCAL_HEADER.size :] != encoded:
        raise CheckpointFormatError("local header names another member", path=where)
    data_offset = header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if data_offset + file_size > cd_offset:
        raise CheckpointFormatError("member data extends beyond the end of the archive", path=where)
    local = (local_flags, local_crc, local_csize, local_size)
    contradiction = _local_contradiction(
        fd, where, local, (crc, csize, file_size), (data_offset - extra_len, extra_len)
    )
    return Member(name, header_offset, data_offset, file_size, crc), contradiction


def _local_contradiction(
    fd: int, where: str, local: tuple[int, int, int, int], central: tuple[int, int, int], extra: tuple[int, int]
) -> CheckpointFormatError | None:
    """The refusal (``None``: none) of a local header whose flags, CRC-32 or sizes (``local``: flags, crc, compressed
    size, size; ``extra``: where its extra field is, offset and length) do not say what the central directory's
    (``central``: crc, compressed size, size) say: a reader that streams the archive from its local headers would
    see another member. With a data descriptor (general-purpose flag bit 3) the local fields may be zero (APPNOTE
    4.4.4), else they are equal."""
    flags, crc, csize, size = local
    if flags & 0x1:
        message = "local header says the member is encrypted; torchrl_dcp archives never are"
        return CheckpointFormatError(message, path=where)
    if U32 in (csize, size):  # ZIP64: the sizes are in the local header's extra field
        extra_at, extra_len = extra
        raw = os.pread(fd, extra_len, extra_at)
        try:
            size, csize = local_sizes(raw if len(raw) == extra_len else b"", size, csize)
        except ZipError as err:
            return CheckpointFormatError(f"local header is damaged ({err})", path=where)
    found = (crc, csize, size)
    described = bool(flags & 0x8)
    if any(f != c and not (described and f == 0) for f, c in zip(found, central)):
        return CheckpointFormatError(
            f"local header says CRC-32 {crc:08x}, {csize} bytes stored, {size} bytes; the central directory says "
            f"{central[0]:08x}, {central[1]}, {central[2]}: a reader of the local headers would see another member "
            "(damaged, or forged)",
            path=where,
        )
    return None


def _check_name(name: str, where: str) -> None:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or ".." in parts
        or (len(name) > 1 and name[1] == ":")
    ):
        raise CheckpointIntegrityError(
            "member name escapes the archive (absolute, '..', '\\' or a NUL byte): refused", path=where
        )
    if len(parts) != 1:
        if len(parts) == 2 and parts[1] in _TORCH_SAVE_MEMBERS:  # (torch.save's ZIP: <name>/data.pkl, ...)
            raise CheckpointFormatError(
                "a torch.save file, not a checkpoint (its members are under one folder, with a pickle): load it with "
                "torch.load(path, weights_only=True), or save its state with torchrl_dcp first",
                path=where,
            )
        raise CheckpointFormatError(
            "member is in a sub-directory; torchrl_dcp archives are flat (a torchrl.checkpoint archive? read it from a "
            "local path: torchrl_dcp imports those read-only)",
            path=where,
        )


_TORCH_SAVE_MEMBERS = frozenset({"data.pkl", "version", "byteorder", ".format_version", ".storage_alignment"})


class ArchiveContainer(ManifestParts):
    """A checkpoint stored as one ZIP archive, read in place (see :class:`~torchrl_dcp.storage.base.Container`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointNotFoundError(f"no checkpoint here: {absent_because(self.path)}", path=self.path)
        self._members: dict[str, Member] | None = None
        self._manifest: dict[str, Any] | None = None
        self.bytes_read = 0  # data bytes read through storage readers (tests, diagnostics)

    @property
    def members(self) -> dict[str, Member]:
        if self._members is None:
            self._members = read_index(self.path)
        return self._members

    def member(self, name: str) -> Member:
        try:
            return self.members[name]
        except KeyError:
            raise CheckpointIntegrityError(
                "member listed in the manifest is missing from the archive", path=f"{self.path}::{name}"
            ) from None

    def read_raw_member(self, name: str, limit: int) -> bytes:
        """A member's bytes, checked against its ZIP CRC (also members the manifest does not list: itself)."""
        m = self.member(name)
        if m.size > limit:
            raise CheckpointFormatError(f"member is implausibly large ({m.size} bytes)", path=f"{self.path}::{name}")
        fd = open_regular(self.path)
        try:
            data = os.pread(fd, m.size, m.data_offset)
        finally:
            os.close(fd)
        if len(data) != m.size or crc32(data) != m.crc:
            raise CheckpointIntegrityError(
                "member fails its ZIP CRC32: the archive is damaged", path=f"{self.path}::{name}"
            )
        return data

    def root(self) -> dict[str, Any]:
        if self._manifest is None:
            if MANIFEST not in self.members:
                raise CheckpointFormatError(
                    f"the archive holds no {MANIFEST}: not a torchrl_dcp checkpoint", path=self.path
                )
            data = self.read_raw_member(MANIFEST, MAX_MANIFEST_BYTES)
            self._root_bytes, self._root_read = data, True  # (kept before the parse: a damaged one is told apart)
            manifest = schema.loads_manifest(data, f"{self.path}::{MANIFEST}")
            self._manifest = manifest
            try:  # every member accounted for (those of ranks' own files by their shards' counts, format 7)
                check_listing(
                    ((n, m.size) for n, m in self.members.items()),
                    self,
                    lambda name: f"{self.path}::{name}",
                    "member",
                )
            except CheckpointError:
                self._manifest = None
                raise
        return self._manifest

    def read_member(self, name: str, limit: int) -> bytes | None:
        rec = self.listed().get(name)
        if rec is None:
            return None
        if self.member(name).size != rec["size"]:
            raise CheckpointIntegrityError(
                f"size is {self.member(name).size} bytes, the manifest says {rec['size']}", path=f"{self.path}::{name}"
            )
        return self.read_raw_member(name, limit)

    def byte_range(self, name: str) -> ByteRange:
        if name not in self.listed():
            raise CheckpointIntegrityError("member is not listed in the manifest: refused", path=f"{self.path}::{name}")
        m = self.member(name)
        return ByteRange(str(self.path), m.data_offset, m.size, f"{self.path}::{name}")

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """Sizes (and ZIP CRCs against the manifest) of every listed member (``only``: of these); data checksums of
        ``checksum``."""
        files = self.listed()
        wanted = set(files) if checksum is True else set() if checksum is False else set(checksum)
        checked = files_to_check(files, wanted, only)
        for name, rec in checked.items():
            m, where = self.member(name), f"{self.path}::{name}"
            if m.size != rec["size"]:
                raise CheckpointIntegrityError(f"size is {m.size} bytes, the manifest says {rec['size']}", path=where)
            if format_crc(m.crc) != rec["checksum"]:
                raise CheckpointIntegrityError(
                    f"ZIP CRC32 is {format_crc(m.crc)}, the manifest says {rec['checksum']}: the archive is damaged",
                    path=where,
                )
        names = sorted(wanted & set(files), key=lambda n: self.member(n).data_offset)
        if names:
            fd = open_regular(self.path)
            try:
                members = [self.member(n) for n in names]
                crcs = fds_checksums([(fd, m.data_offset, m.size, str(self.path)) for m in members], progress=progress)
            finally:
                os.close(fd)
            for name, crc in zip(names, crcs):
                if crc != files[name]["checksum"]:
                    raise checksum_mismatch(crc, files[name]["checksum"], f"{self.path}::{name}", "member")


class ArchiveLocation(Location):
    """A checkpoint archive on this machine: read in place, removed renamed aside; never saved into (a save
    writes a directory, :func:`~torchrl_dcp.to_archive` packs it)."""

    kind = "archive"
    can_be_base = False  # members cannot be linked

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(Path(path))

    def container(self) -> ArchiveContainer:
        return ArchiveContainer(self.path)

    def open_source(self, *, whole: bool = True) -> Any:
        from torchrl_dcp.storage.source import CheckpointSource  # torch: only where tensors are read

        return CheckpointSource(self.container())

    def entry_kind(self) -> EntryKind | None:
        try:
            st = os.lstat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return "archive" if stat.S_ISREG(st.st_mode) else "other"

    def size(self) -> int | None:
        try:
            return os.lstat(self.path).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def remove(self) -> bool:
        return remove_entry(self.path)


# ---------------------------------------------------------------------- writing
def temporary_sibling(destination: Path) -> Path:
    """A fresh temporary name beside ``destination``, derived from its name (``commit.stale_entries`` finds it)."""
    return destination.parent / f".{destination.name}{TMP_TAG}{uuid.uuid4().hex}"


def write_archive(
    files: Collection[tuple[str, Path, int, str | None]],
    manifest_bytes: bytes,
    destination: Path,
    *,
    buffer_size: int = BUFFER,
    progress: Progress | None = None,
    threads: int | None = None,
    replaceable: Callable[[Path], bool] | None = None,
) -> Path:
    """Copy ``files`` (``(name, path, size, checksum)``) and the manifest into one archive, atomically.

    ``replaceable``: asked of what is at ``destination`` (an archive, a checkpoint directory) once the archive has
    moved it aside (:func:`~torchrl_dcp.storage.commit.publish`).

    The layout is computed first (a local header's size does not depend on the CRC),
    then several threads copy the files to their offsets, computing each file's CRC32
    on the way (``storage/copying.py``); a CRC that differs from ``checksum`` aborts
    before anything is published. The headers and the central directory are written
    last, the archive under a temporary name next to ``destination``, fsynced and
    renamed into place; the directory is fsynced. The temporary file is created with
    ``O_EXCL | O_NOFOLLOW`` and removed on any failure; one left by a killed
    conversion is removed by the next conversion to ``destination``
    (``convert.py``, under the destination's lock). Source files are opened without
    following links and must be regular files.
    """
    from torchrl_dcp.storage.commit import create_exclusive
    from torchrl_dcp.storage.copying import CopyRange, copy_ranges, pwrite_all

    for name, path, _, _ in files:  # (every conversion's members: never one that unpacks outside the checkpoint)
        if not is_plain_name(name) or name == MANIFEST:
            raise CheckpointFormatError(
                f"the manifest lists {name!r}, which is no file of a checkpoint (a member named so would unpack "
                "outside it, or over its manifest): damaged or forged; nothing was written",
                path=path,
            )
    entries: list[tuple[str, Path | None, int, str | None]] = [(MANIFEST, None, len(manifest_bytes), None)]
    entries += list(files)
    layout: list[tuple[bytes, int, int]] = []  # encoded name, header offset, data offset
    offset = 0
    for name, _, size, _ in entries:
        encoded = name.encode()
        data_offset = offset + len(local_header(encoded, 0, size, offset, pad=ZIPALIGN_PAD))
        layout.append((encoded, offset, data_offset))
        offset = data_offset + size
    cd_offset = offset
    advance = byte_counter(sum(size for _, _, size, _ in files), progress)
    tmp = temporary_sibling(destination)
    sources: list[int] = []
    try:
        out = create_exclusive(tmp, flags=os.O_RDWR)
        try:
            ranges = []
            for (_name, path, size, _), (_, _, data_offset) in zip(entries[1:], layout[1:]):
                assert path is not None
                fd = open_regular(path)
                sources.append(fd)
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise CheckpointIntegrityError(f"size is {actual} bytes, the manifest says {size}", path=path)
                ranges.append(CopyRange(fd, 0, size, out, data_offset, str(path)))
            crcs = [crc32(manifest_bytes)]
            crcs += copy_ranges(ranges, threads=threads, buffer_size=buffer_size, progress=advance)
            for (_name, path, _, checksum), crc in zip(entries, crcs):
                if checksum is not None and format_crc(crc) != checksum:
                    raise checksum_mismatch(format_crc(crc), checksum, path)
            pwrite_all(out, manifest_bytes, layout[0][2])
            directory = bytearray()
            for (_, _, size, _), (encoded, header_offset, _), crc in zip(entries, layout, crcs):
                pwrite_all(out, local_header(encoded, crc, size, header_offset, pad=ZIPALIGN_PAD), header_offset)
                directory += central_entry(encoded, crc, size, header_offset, mode=0o644)
            pwrite_all(out, bytes(directory) + end_records(len(entries), cd_offset, len(directory)), cd_offset)
            os.fsync(out)
        finally:
            os.close(out)
        # a free path taken only while still free; what is there (an archive, or a checkpoint directory replaced
        # by its archive) exchanged in one step, or renamed aside first, and removed only if still replaceable
        publish(tmp, destination, replaceable=replaceable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in sources:
            os.close(fd)
    return destination
