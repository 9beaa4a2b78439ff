"""The location interface: what saves, loads, rotation, incremental saves and the tools need of a checkpoint location.

A *location* is where one checkpoint lives, or may live: a local directory, a ZIP
archive, an object-store prefix. Every backend implements :class:`Location`, and
:mod:`torchrl_dcp.storage.backends` is the one place that decides which backend a
path or URL gets. The engines, rotation and the tools only ever talk to these two
classes:

- **reading**: :meth:`Location.open_source` (the manifest, DCP's metadata read
  through the allow-list unpickler, a DCP reader over the files the manifest lists);
- **saving** (:class:`SaveTarget`): rank 0 prepares (locks, sweeps what killed saves
  left, refuses to replace what is not a checkpoint, creates the staging area) and
  every rank attaches to the same staging area; every rank writes its share; rank 0
  writes DCP's metadata and the manifest **last**, which commits, then releases;
  ``abandon`` removes what a failed save wrote;
- **listing** (rotation): :meth:`Location.children`, :meth:`Location.remove`, the
  leftovers of killed saves and their removal, sizes;
- **incremental saves**: whether this location can keep files from another one, and
  which of a base's chunk files can still be kept (:meth:`Location.keepable`).

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.backends import location_for
    >>> d = tempfile.mkdtemp()
    >>> _ = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(d + "/step-1")
    >>> loc = location_for(d)
    >>> [(e.name, e.kind) for e in loc.children()]
    [('step-1', 'checkpoint')]
    >>> loc.child("step-1").open_source().manifest()["format"]
    'torchrl_dcp'
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
from collections import ChainMap
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from torchrl_dcp.errors import CheckpointError, CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.format.layout import data_file_name, shared_file_name
from torchrl_dcp.json_bytes import loads_json

if TYPE_CHECKING:  # annotations only: the location layer imports no torch (torch-free tools list and inspect)
    import torch
    from torch.distributed.checkpoint import StorageWriter
    from torch.distributed.checkpoint.metadata import Metadata

    from torchrl_dcp.storage.chunk_writer import ChunkJob, KeptChunk
    from torchrl_dcp.storage.source import CheckpointSource

EntryKind = Literal["checkpoint", "archive", "other"]


def no_manifest(has_dcp_metadata: bool) -> str:
    """What a location without ``manifest.json`` is, said alike by every backend: one holding DCP's ``.metadata``
    was written by a plain ``dcp.save`` (or is one of ours that lost its manifest).

    Example:
        >>> no_manifest(False)
        'no manifest.json: not a torchrl_dcp checkpoint, or a save that never committed'
    """
    if has_dcp_metadata:
        return (
            "no manifest.json, but DCP's .metadata: a checkpoint written by a plain torch.distributed.checkpoint.save "
            "(read it with torch.distributed.checkpoint.load, then save it with torchrl_dcp: docs/from_dcp.md), "
            "or one of ours whose manifest was removed"
        )
    return "no manifest.json: not a torchrl_dcp checkpoint, or a save that never committed"


@dataclass(frozen=True)
class ByteRange:
    """Where one data file's bytes are: ``[base, base + size)`` of the real file ``path``; ``where`` names it."""

    path: str
    base: int
    size: int
    where: str


def files_to_check(
    files: Mapping[str, Any], wanted: Collection[str], only: Collection[str] | None
) -> Mapping[str, Any]:
    """The listed files whose sizes :meth:`Container.check` compares: every one, or (``only``) those and the ones it
    checksums (``wanted``).

    Example:
        >>> sorted(files_to_check({"a": 1, "b": 2, "c": 3}, {"c"}, only=["a", "x"]))
        ['a', 'c']
    """
    if only is None:
        return files
    return {n: files[n] for n in sorted(set(only) | set(wanted)) if n in files}


class Container(Protocol):
    """The files of one committed checkpoint (directory, archive or object-store prefix)."""

    path: Any

    def root(self) -> dict[str, Any]:
        """The validated (and migrated) root manifest (``manifest.json``), parsed once."""

    def root_digest(self) -> str:
        """A digest of the root manifest's bytes as read (:meth:`ManifestParts.root_digest`)."""

    def root_damaged(self, err: BaseException) -> bool:
        """Whether ``err`` of :meth:`root` is a damaged manifest of ours (:meth:`ManifestParts.root_damaged`)."""

    def stored_version(self) -> int:
        """The format version the root manifest was written with (:meth:`root` is migrated to the current one)."""

    def manifest(self, ranks: Collection[int] | None = None) -> dict[str, Any]:
        """The manifest with the shards of ``ranks`` (``None``: every rank's), assembled once per set of ranks
        (:class:`ManifestParts`)."""

    def listed(self) -> Mapping[str, Any]:
        """The records of the root's files and of those the shards read so far list (format 7)."""

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """Every listed file's size, nothing unlisted, and the checksums of ``checksum`` (True: all); ``progress``
        is called with the bytes of each piece checksummed (from any thread, one at a time). ``only``: the sizes
        of these listed files alone, and no listing (what one rank of a load reads; rank 0 checks the whole)."""

    def read_member(self, name: str, limit: int) -> bytes | None:
        """A listed file's bytes, size-checked against the manifest (``None`` when the manifest does not list it)."""

    def byte_range(self, name: str) -> ByteRange:
        """Where a listed data file's bytes are."""


class ManifestParts:
    """What every container builds on its :meth:`Container.root`: the manifest assembled with the shards of some
    ranks (format 5, :mod:`torchrl_dcp.format.shards`), each shard read as a listed file (its size and CRC-32
    checked before it is parsed) and checked against the root."""

    path: Any
    _root_bytes: bytes = b""  # the root manifest's bytes as read (each container's ``root`` keeps them)
    _root_read = False  # whether they were read (the manifest is there), whether or not they parsed

    def root(self) -> dict[str, Any]:  # pragma: no cover - every container defines it
        raise NotImplementedError

    def root_damaged(self, err: BaseException) -> bool:
        """Whether ``err`` (raised by :meth:`root`) is a manifest of ours that is there but damaged: its bytes were
        read and are no JSON (truncated, emptied) or name torchrl_dcp's format (altered, its seal or contents wrong),
        and it is no newer version's. An absent manifest (a plain DCP checkpoint, a killed save's prefix, a user's
        directory) and another tool's JSON are not."""
        from torchrl_dcp.errors import CheckpointVersionError
        from torchrl_dcp.format.manifest import looks_like_ours

        if not self._root_read or isinstance(err, CheckpointVersionError) or not isinstance(err, CheckpointError):
            return False
        return looks_like_ours(self._root_bytes)

    def stored_version(self) -> int:
        """The format version the root manifest was written with, as its bytes say (:meth:`root` is migrated to the
        current one: what ``inspect`` shows beside it)."""
        self.root()
        return loads_json(self._root_bytes)["format_version"]  # (parsed already: root())

    def root_digest(self) -> str:
        """A BLAKE2b digest of the root manifest's bytes as this process read them: the ranks of a load compare it,
        so that no two restore different roots of one save (each rank reads its own copy, mounted anywhere; two
        roots resealed alike, or one swapped while they read, would give replicas different states)."""
        self.root()
        return hashlib.blake2b(self._root_bytes, digest_size=16).hexdigest()

    def read_member(self, name: str, limit: int) -> bytes | None:  # pragma: no cover - every container defines it
        raise NotImplementedError

    def byte_range(self, name: str) -> ByteRange:  # pragma: no cover - every container defines it
        raise NotImplementedError

    def manifest(self, ranks: Collection[int] | None = None) -> dict[str, Any]:
        """The manifest with the shards of ``ranks`` (``None``: every saved rank's; ranks the checkpoint does not
        have are left out), validated as a whole."""
        from torchrl_dcp.format.manifest import validate_assembled
        from torchrl_dcp.format.shards import assemble

        root = self.root()
        world = root["world_size"]
        wanted = tuple(range(world)) if ranks is None else tuple(sorted({r for r in ranks if 0 <= r < world}))
        cache: dict[tuple[int, ...], dict[str, Any]] = self.__dict__.setdefault("_assembled", {})
        if not root.get("sharded"):
            wanted = ()
        found = cache.get(wanted)
        if found is None:
            found = assemble(root, {r: self.shard(r) for r in wanted} if root.get("sharded") else {}, self.path)
            if root.get("sharded"):
                validate_assembled(found, self.path)
            cache[wanted] = found
        return found

    def listed(self) -> Mapping[str, Any]:
        """The records of the files this container can vouch for: the root's, its shards' (format 8: from its rank
        table, decoded when looked up) and (format 7) those listed by the shards read so far. A data file of a rank
        whose shard was not read is sized by :meth:`check` alone (:func:`check_listing`); nothing reads it."""
        from torchrl_dcp.format.rank_table import ShardRecords

        root = self.root()
        found: dict[str, Any] = self.__dict__.setdefault("_shard_files", {})
        return ChainMap(found, root["files"], ShardRecords(root))

    def shards_read(self) -> set[int]:
        """The ranks whose shards were read (and checked) so far."""
        return self.__dict__.setdefault("_shards_read", set())

    def shard(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s manifest shard, read, checksummed and checked against the root."""
        from torchrl_dcp.format.checksums import checksum_mismatch, crc32, format_crc
        from torchrl_dcp.format.layout import MAX_MANIFEST_BYTES, shard_name
        from torchrl_dcp.format.rank_table import shard_record
        from torchrl_dcp.format.shards import parse_shard

        root, name = self.root(), shard_name(rank)
        rec = shard_record(root, rank)
        if rec is None:
            raise CheckpointFormatError(
                f"the manifest lists no shard for rank {rank} ({name}): damaged or altered", path=self.path
            )
        where = self.byte_range(name).where
        data = self.read_member(name, MAX_MANIFEST_BYTES)
        assert data is not None
        actual = format_crc(crc32(data))
        if actual != rec["checksum"]:
            raise checksum_mismatch(actual, rec["checksum"], where)
        shard = parse_shard(data, root, rank, where)
        self.__dict__.setdefault("_shard_files", {}).update(shard.get("files") or {})
        self.shards_read().add(rank)
        return shard


def check_listing(
    listing: Iterable[tuple[str, int | None]], parts: ManifestParts, where: Callable[[str], Any], what: str = "file"
) -> None:
    """Everything in a checkpoint is accounted for: ``listing`` (``(name, size)`` of what is in it; size ``None``: not
    a regular file) holds besides the manifest only files :meth:`ManifestParts.listed` lists (their sizes
    are compared by the caller) and, for each rank whose shard was not read (format 7), exactly as many of its own
    data and chunk files, of as many bytes, as the root's ``rank_table`` says. ``where(name)`` names a file in
    errors; ``what``: what the container holds ("file", "member", "object").

    Raises:
        CheckpointIntegrityError: an unlisted file, or a rank's own files added, missing or resized.
    """
    from torchrl_dcp.format.layout import MANIFEST, own_file_rank, shard_name
    from torchrl_dcp.format.rank_table import counted_own_files

    root, listed, read = parts.root(), parts.listed(), parts.shards_read()
    counted = counted_own_files(root)
    found: dict[int, list[int]] = {}
    names: dict[int, list[str]] = {}
    sizes: dict[str, int] = {}
    for name, size in listing:
        if name == MANIFEST or name in listed:
            continue
        r = own_file_rank(name)
        if counted is None or r is None or r >= len(counted) or r in read:
            err = CheckpointIntegrityError(
                f"{what} not listed in the manifest: the checkpoint was altered", path=where(name)
            )
            err.unlisted = name  # (a resume tells a user's file put into an entry from damage: rotation_resume)
            raise err
        if size is None:
            raise CheckpointIntegrityError(f"is not a regular {what}: the checkpoint was altered", path=where(name))
        seen = found.setdefault(r, [0, 0])
        seen[0], seen[1] = seen[0] + 1, seen[1] + size
        names.setdefault(r, []).append(name)
        sizes[name] = size
    for r, expected in enumerate(counted or ()):
        if r not in read and tuple(found.get(r, (0, 0))) != expected:
            _name_the_difference(parts, r, sizes, names.get(r, []), where, what)
            n, b = found.get(r, [0, 0])
            here = sorted(names.get(r, []))
            shown = ", ".join(here[:4]) + (f" and {len(here) - 4} more" if len(here) > 4 else "")
            raise CheckpointIntegrityError(
                f"rank {r}'s own data and chunk files here ({shown or 'none'}) are {n} of {b} bytes, its shard lists "
                f"{expected[0]} of {expected[1]}: one was added, removed, truncated or altered",
                path=where(shard_name(r)),
            )


def _name_the_difference(
    parts: ManifestParts,
    rank: int,
    sizes: Mapping[str, int],
    here: list[str],
    where: Callable[[str], Any],
    what: str,
) -> None:
    """Rank ``rank``'s own files differ from its shard's counts: read the shard (sized and checksummed like any listed
    file) and name the file missing, added or resized, in the words a read of that file would use. Returns when the
    shard names no single culprit (the counts' message then says what differs)."""

    listed = parts.shard(rank).get("files") or {}
    for name in sorted(listed):
        if name not in sizes:
            raise CheckpointIntegrityError(f"{what} listed in the manifest is missing", path=where(name))
    for name in sorted(here):
        if name not in listed:
            raise CheckpointIntegrityError(
                f"{what} not listed in the manifest: the checkpoint was altered", path=where(name)
            )
        if sizes[name] != listed[name]["size"]:
            raise CheckpointIntegrityError(
                f"size is {sizes[name]} bytes, the manifest says {listed[name]['size']}: truncated or altered",
                path=where(name),
            )


# ---------------------------------------------------------------------- what one rank writes
@dataclass(frozen=True)
class ChunkEntry:
    """One chunk of rows ``[start, start + rows)`` of ``key``: its record in ``file`` and its content fingerprint."""

    key: str
    start: int
    rows: int
    file: str
    offset: int
    length: int
    fingerprint: str


@dataclass
class WriteOutcome:
    """What one rank wrote: its files' records and the DCP storage entries of its tensors."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    entries: list[tuple[str, str, int, int]] = field(default_factory=list)  # key, file, offset, length
    bytes_written: int = 0
    chunks: list[ChunkEntry] = field(default_factory=list)  # chunk files (torchrl_dcp.chunking)
    kept: int = 0  # chunk files kept from the incremental base
    copied: int = 0  # ... of which copied, because a hard link was impossible

    def add_data_file(self, name: str, entries: Iterable[tuple[str, int, int]], record: dict[str, Any]) -> None:
        """Record the data file ``name`` written: its ``(key, offset, length)`` entries and its size and checksum."""
        self.files[name] = record
        self.entries += [(k, name, offset, length) for k, offset, length in entries]
        self.bytes_written += record["size"]

    def merge(self, other: WriteOutcome) -> None:
        """Add what ``other`` wrote (another data file of the same rank's share) to this outcome."""
        self.files.update(other.files)
        self.entries += other.entries
        self.bytes_written += other.bytes_written
        self.chunks += other.chunks
        self.kept += other.kept
        self.copied += other.copied

    def add_chunks(self, jobs: Iterable[ChunkJob]) -> None:
        """Record the chunk files ``jobs`` wrote or kept (each job's ``result`` set)."""
        for j in jobs:
            r = j.result
            if r is None:
                raise CheckpointError(f"internal: chunk file {j.file} was neither written nor kept")
            self.files[j.file] = {"size": r.size, "checksum": r.checksum}
            if r.origin is not None:
                self.files[j.file]["origin"] = r.origin
                self.kept += 1
                self.copied += r.copied
            if r.origin is None or r.copied:
                self.bytes_written += r.size
            self.chunks.append(ChunkEntry(j.key, j.start, j.rows, j.file, 0, r.length, r.fingerprint))


@dataclass
class ShareWrite:
    """One rank's share of a save by our writer: its per-rank tensors (``tensors``), the replicated tensors it was
    chosen to write (``shared``) and its chunk files.

    ``chunks[i].tensor`` is ``None`` only for a chunk an async save did not stage
    because it is kept from the incremental base.
    """

    tensors: list[tuple[str, torch.Tensor]]
    chunks: list[ChunkJob]
    save_id: str
    rank: int
    shared: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def data_files(self) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """``[(file name, tensors)]`` of the data files to write (none for an empty group): per-rank tensors in
        ``__<rank>_0.distcp``, shared ones in ``__<rank>_shared.distcp``, so a rank's load reads the shared files and
        its own, never another rank's per-rank bytes.

        Example:
            >>> import torch
            >>> share = ShareWrite([("rank/1/a", torch.ones(1))], [], "0" * 32, 1, [("replicated/p/w", torch.ones(1))])
            >>> [name for name, _ in share.data_files()]
            ['__1_0.distcp', '__1_shared.distcp']
        """
        named = ((data_file_name(self.rank), self.tensors), (shared_file_name(self.rank), self.shared))
        return [(name, tensors) for name, tensors in named if tensors]


# ---------------------------------------------------------------------- saving
class SaveTarget(abc.ABC):
    """The staging area of one save (a staging directory, or the destination prefix itself).

    Rank 0 gets it from :meth:`Location.prepare_save` (and holds what keeps other saves
    out, e.g. a lock); the other ranks from :meth:`Location.attach_save` with its
    :attr:`token`. The order of the calls is the commit protocol: ``write`` then
    ``write_member`` of its manifest shard (every rank) → ``write_member`` of DCP's
    ``.metadata`` → ``commit`` (rank 0: the manifest last), then ``release``;
    ``abandon`` after any failure.
    """

    #: what the other ranks need to attach (picklable, small)
    token: str
    #: what messages name
    where: Any
    #: what DCP's metadata records as the checkpoint id (``StorageMeta.checkpoint_id``)
    checkpoint_id: Any

    @abc.abstractmethod
    def write(self, share: ShareWrite) -> WriteOutcome:
        """Write this rank's share (every rank, at once)."""

    def dcp_writer(self) -> StorageWriter:
        """DCP's own storage writer into the staging area (DTensor state); refused where DCP cannot write."""
        raise CheckpointError(
            "sharded (DTensor) components cannot be saved here: save to a local or shared directory", path=self.where
        )

    def seal_dcp_files(self, rank: int, save_id: str) -> WriteOutcome:
        """After DCP's writer: this rank's files get the save's identity trailer; their records."""
        raise CheckpointError("internal: no DCP writer here", path=self.where)

    def read_dcp_metadata(self) -> Metadata | None:
        """The ``.metadata`` DCP's writer left in the staging area (rank 0), read through the allow-list."""
        raise CheckpointError("internal: no DCP writer here", path=self.where)

    @abc.abstractmethod
    def write_member(self, name: str, data: bytes) -> dict[str, Any]:
        """Write the small file ``name`` (a manifest shard, DCP's ``.metadata``, replacing DCP's own) durably into
        the staging area; returns its manifest record (``size``, ``checksum``)."""

    @abc.abstractmethod
    def commit(self, manifest: bytes, files: Mapping[str, Mapping[str, Any]]) -> None:
        """Check that the staging area holds exactly ``files`` (the manifest's records), write the manifest last
        and publish: after this returns the checkpoint is committed (rank 0)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Remove what this save wrote, leaving any previous checkpoint intact (rank 0, best effort)."""

    def release(self) -> None:  # noqa: B027 - most staging areas hold nothing
        """Close what this rank holds open, and let other saves to this location in (every rank; after commit or
        abandon)."""


# ---------------------------------------------------------------------- the location
@dataclass(frozen=True)
class Entry:
    """Something directly inside a location: a checkpoint, an archive, or anything else (``other``)."""

    name: str
    kind: EntryKind
    location: Location


@dataclass(frozen=True)
class Leftover:
    """What a killed save or conversion left inside a location, and the entry it was for (``owner``)."""

    name: str
    owner: str


class Location(abc.ABC):
    """One place a checkpoint lives or may live. Paths are ``Path`` (local) or ``StorePath`` (URLs)."""

    #: ``"directory"``, ``"archive"`` or ``"object store"`` (what tools print)
    kind: str
    #: whether a checkpoint can be saved here as one file (rotation's ``archive=True``)
    holds_archives: bool = True
    #: whether the location is this machine's file system (conversions run on local copies otherwise)
    is_local: bool = True
    #: whether a later incremental save can keep the chunk files of a checkpoint here (not inside an archive)
    can_be_base: bool = True

    def __init__(self, path: Any) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def identity(self) -> str:
        """Where this is, however spelled: a local path resolved (links followed, ``..`` folded), a store's URL.

        Example:
            >>> from torchrl_dcp.storage.backends import location_for
            >>> location_for("/tmp/../tmp").identity()
            '/tmp'
        """
        return os.path.realpath(self.path) if self.is_local else str(self.path)

    # ------------------------------------------------------------------ reading
    @abc.abstractmethod
    def container(self) -> Container:
        """The files of the committed checkpoint here (no torch needed)."""

    @abc.abstractmethod
    def open_source(self, *, whole: bool = True) -> CheckpointSource:
        """The committed checkpoint here, to read tensors from (its container plus DCP's metadata). ``whole=False``:
        the reader is one rank of a load, which checks only the files it reads (``Container.check(only=...)``) while
        rank 0 checks the whole; a backend may then skip what only the whole check needs (an object store's listing)."""

    def manifest(self) -> dict[str, Any]:
        """The validated (and migrated) manifest of the checkpoint here, every rank's shard assembled in."""
        return self.container().manifest()

    def root(self) -> dict[str, Any]:
        """The validated root manifest of the checkpoint here (step, metadata, sequence; no shard read, so its
        ``files`` lacks each rank's own files: :meth:`manifest` has every file)."""
        return self.container().root()

    # ------------------------------------------------------------------ saving
    def prepare_save(self, save_id: str, kept_from: Collection[str] = ()) -> SaveTarget:
        """Rank 0: make ready to save here (lock, sweep leftovers, refuse a foreign destination, staging).
        ``kept_from``: the saves whose chunk files the save may keep from its incremental base (their identity
        trailers: what a location that proves a killed save's leftovers by them must accept)."""
        raise CheckpointError(
            f"cannot save a checkpoint into an existing {self.kind}; choose another path", path=self.path
        )

    def save_refusal(self) -> str | None:
        """Why a save to this path would be refused now (a user's objects under it, an object at its key), said
        ahead (a resume warns of the entries its job will fail to save); ``None``: a save may write here. Locations
        whose refusals are found otherwise (directories: :func:`~torchrl_dcp.rotation_entries.blocking_entries`)
        say ``None``."""
        return None

    def sweep_before_save(self) -> None:  # noqa: B027 - only locations whose leftovers can void proofs sweep early
        """Rank 0, before any rank proves the files of an incremental base (collective order): remove what failed or
        killed saves to this path left, as :meth:`prepare_save` would later. Their hard links to the base's files are
        unlinked here, not while the ranks write: an unlink moves a file's ``ctime``, and a file whose ``ctime`` moved
        after another rank proved it is no longer vouched for (:mod:`~torchrl_dcp.storage.proven`)."""

    def attach_save(self, token: str) -> SaveTarget:
        """Every other rank: the staging area rank 0 prepared (``token``)."""
        raise CheckpointError(f"cannot save a checkpoint into an existing {self.kind}", path=self.path)

    def check_writer(self, backend: str) -> None:  # noqa: B027 - most locations take either writer
        """Refuse before anything is written when the save's writer (``"fast"`` or ``"dcp"``) cannot write here."""

    # ------------------------------------------------------------------ listing and removing
    def child(self, name: str) -> Location:
        """The location ``name`` directly inside this one."""
        raise CheckpointError(f"a {self.kind} holds no other checkpoints", path=self.path)

    def children(self) -> list[Entry]:
        """What is directly inside (empty when nothing is, or the location does not exist)."""
        return []

    def entry_kind(self) -> EntryKind | None:
        """What is at this location now (``None``: nothing)."""
        return "archive"

    def size(self) -> int | None:
        """Bytes of the checkpoint here (files directly inside; links not followed); ``None`` when it is gone."""
        return None

    @abc.abstractmethod
    def remove(self) -> bool:
        """Delete the checkpoint here so that it is never seen half-deleted; ``False`` when already gone."""

    def leftovers(self) -> list[Leftover]:
        """What killed saves and conversions left directly inside (removed by :meth:`remove_leftover`)."""
        return []

    def remove_leftover(self, leftover: Leftover) -> bool:
        """Remove one leftover, unless a live save to its owner holds the owner's lock."""
        return False

    # ------------------------------------------------------------------ incremental saves
    def keeps_files(self) -> bool:
        """Whether an incremental save here can keep files without sending their bytes (links, server-side copy)."""
        return False

    def can_keep_from(self, base: Location) -> bool:
        """Whether a save here can keep chunk files of a checkpoint at ``base``."""
        return False

    def keepable(self, keeps: Mapping[str, KeptChunk], rows: Mapping[str, Any]) -> dict[str, KeptChunk]:
        """The chunks of ``keeps`` (files of the checkpoint here, by new file name) proven to hold ``rows[name]``
        (the live rows, a tensor): never on the manifest's word alone, which a forger can reseal."""
        return {}

    # ------------------------------------------------------------------ conversions
    @contextlib.contextmanager
    def local_copy(self, kind: str, scratch: Path) -> Iterator[Path]:
        """This location as a local path for a conversion (``kind``: ``"checkpoint"`` or ``"file"``)."""
        yield Path(self.path)

    def occupied(self) -> bool:
        """Whether something is at this location now."""
        return self.entry_kind() is not None

    def receive(self, local: Path, kind: str) -> None:  # noqa: B027 - a local output is written in place
        """Publish the conversion output ``local`` here (a local location: it was written in place)."""

    def check_destination(self, kind: str, overwrite: bool) -> None:  # noqa: B027 - local: checked as written
        """Before a conversion publishes a ``kind`` here: never inside a checkpoint, and with ``overwrite`` never in
        place of anything but what it writes (a local destination is checked by the conversion itself)."""
