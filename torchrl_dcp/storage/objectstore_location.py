"""Checkpoints under an object-store prefix (any fsspec URL) as a :class:`~torchrl_dcp.storage.base.Location`.

Saving writes into the destination prefix itself: a marker object announces the save
before anything is written (:mod:`~torchrl_dcp.storage.objectstore_save`), every rank
uploads its share, rank 0 uploads ``.metadata`` and then ``manifest.json`` last (the
commit). Listing reads prefixes (``step-<N>`` checkpoints); removal deletes the
manifest first; kept chunk files of incremental saves are copied server-side within
one store. Leftovers of killed saves are swept by the next save into the same parent.

Example:
    >>> import torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.backends import location_for
    >>> _ = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save("memory://doc/location/step-1")
    >>> [(e.name, e.kind) for e in location_for("memory://doc/location").children()]
    [('step-1', 'checkpoint')]
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.checksums import crc32, format_crc
from torchrl_dcp.format.layout import MANIFEST, is_plain_name
from torchrl_dcp.storage import objectstore_save
from torchrl_dcp.storage.base import Entry, EntryKind, Leftover, Location, SaveTarget, ShareWrite, WriteOutcome
from torchrl_dcp.storage.chunk_writer import KeptChunk
from torchrl_dcp.storage.objectstore import ObjectStoreContainer, list_objects, listed_child, store_error
from torchrl_dcp.storage.urls import StorePath, supports_copy

logger = get_logger(__name__)


class ObjectStoreSaveTarget(SaveTarget):
    """A save into an object-store prefix: the objects go to the destination itself, the manifest last."""

    def __init__(self, destination: StorePath) -> None:
        self.destination = destination
        self.token, self.where, self.checkpoint_id = str(destination), destination, str(destination)

    def write(self, share: ShareWrite) -> WriteOutcome:
        return objectstore_save.write_share(self.destination, share)

    def write_member(self, name: str, data: bytes) -> dict[str, Any]:
        try:
            self.destination.fs.pipe_file((self.destination / name).key, data)
        except Exception as err:
            raise store_error(err, f"writing {name}", self.destination / name) from None
        return {"size": len(data), "checksum": format_crc(crc32(data))}

    def commit(self, manifest: bytes, files: Mapping[str, Mapping[str, Any]]) -> None:
        try:
            objectstore_save.check_uploaded(self.destination, files)
            objectstore_save.commit_manifest(self.destination, manifest)
        except CheckpointError:
            raise
        except Exception as err:
            raise store_error(err, "committing the checkpoint", self.destination) from None

    def abandon(self) -> None:
        objectstore_save.abandon(self.destination)


class ObjectStoreLocation(Location):
    """A prefix in an object store: one checkpoint, or a rotation prefix holding ``step-<N>`` ones."""

    kind = "object store"
    holds_archives = False  # an entry is already one prefix
    is_local = False
    path: StorePath

    def container(self) -> ObjectStoreContainer:
        return ObjectStoreContainer(self.path)

    def open_source(self, *, whole: bool = True) -> Any:
        from torchrl_dcp.storage.objectstore_source import open_store_source  # torch: only where tensors are read

        return open_store_source(self.path, listing=whole)

    # ------------------------------------------------------------------ saving
    def prepare_save(self, save_id: str, kept_from: Collection[str] = ()) -> SaveTarget:
        _refuse_bucket(self.path)
        try:
            objectstore_save.begin(self.path, save_id, kept_from)
        except FileNotFoundError as err:
            if _bucket_exists(self.path):  # (a key the store does not take, e.g. one holding a newline)
                raise CheckpointError(
                    f"preparing the destination prefix: the store answered 'not found' for a key under it ({err}), "
                    "although its bucket exists: the key may hold characters this store or its client does not "
                    "take (a newline, a control character); choose a plainer key",
                    path=self.path,
                ) from None
            raise CheckpointError(
                "preparing the destination prefix: its bucket does not exist (or is not visible with these "
                "credentials); create it, or check the URL and storage_options",
                path=self.path,
            ) from None
        except Exception as err:
            raise store_error(err, "preparing the destination prefix", self.path) from None
        return ObjectStoreSaveTarget(self.path)

    def save_refusal(self) -> str | None:
        try:
            objectstore_save.refuse_an_object_at(self.path)
            found = list_objects(self.path)
            if not found:
                return None
            if MANIFEST not in found:  # (a killed save's prefix: the save's sweep removes it first)
                try:
                    if objectstore_save.swept_next(self.path, found):
                        return None
                except CheckpointError as err:  # the store did not answer: nothing said ahead (the save will)
                    logger.info("%s: whether a save may replace it is not known now: %s", self.path, err)
                    return None
            objectstore_save.replaced_save(self.path, found)
        except CheckpointError as err:
            return err.message
        return None

    def attach_save(self, token: str) -> SaveTarget:
        return ObjectStoreSaveTarget(self.path)

    def check_writer(self, backend: str) -> None:
        if backend != "fast":
            raise CheckpointError(
                "sharded (DTensor) components cannot be saved to an object store yet: save to a local or shared "
                "directory and copy it, or leave them out (components=...)",
                path=self.path,
            )

    # ------------------------------------------------------------------ listing and removing
    def child(self, name: str) -> ObjectStoreLocation:
        return ObjectStoreLocation(self.path / name)

    def children(self) -> list[Entry]:
        out = []
        found = list_objects(self.path)
        for name, info in sorted(found.items()):
            if name.endswith("/") and (path := listed_child(self.path, name[:-1])) is not None:
                # an object and a prefix of one name (``step-2`` uploaded beside ``step-2/...``): the child is the
                # prefix, which a save writes and a load of the path reads (the object is no entry of ours)
                out.append(Entry(name[:-1], "checkpoint", ObjectStoreLocation(path)))
                continue
            path = listed_child(self.path, name)  # a stray key "..", a user's "x?versionId=1": no child
            if path is None or f"{name}/" in found:
                continue
            kind: EntryKind = "checkpoint" if info.get("type") == "directory" else "other"  # archives: never in stores
            out.append(Entry(name, kind, ObjectStoreLocation(path)))
        return out

    def entry_kind(self) -> EntryKind | None:
        if list_objects(self.path):
            return "checkpoint"
        return "other" if self.path.is_file() else None

    def size(self) -> int | None:
        if self.path.is_file():
            return int(self.path.fs.info(self.path.key)["size"])
        return sum(int(i.get("size") or 0) for i in list_objects(self.path).values())

    def remove(self) -> bool:
        if not list_objects(self.path):
            return False
        objectstore_save.remove_prefix(self.path)
        return True

    def leftovers(self) -> list[Leftover]:
        """Prefixes of saves killed before their commit (a pending marker names them, and they hold no manifest;
        a save running now looks the same): the next save's sweep removes them (:func:`objectstore_save.sweep`),
        so tools show them as a directory's staging areas are shown, not as entries."""
        found = list_objects(self.path)
        out = []
        for name in found:
            entry = name[1 : -len(objectstore_save.PENDING)] if name.endswith(objectstore_save.PENDING) else ""
            if name.startswith(".") and is_plain_name(entry) and entry in found:
                if not (self.path / entry / MANIFEST).is_file():
                    out.append(Leftover(entry, entry))
        return out

    # ------------------------------------------------------------------ incremental saves
    def keeps_files(self) -> bool:
        return supports_copy(self.path.fs)

    def can_keep_from(self, base: Location) -> bool:
        return isinstance(base, ObjectStoreLocation) and base.path.same_store(self.path) and self.keeps_files()

    def keepable(self, keeps: Mapping[str, KeptChunk], rows: Mapping[str, Any]) -> dict[str, KeptChunk]:
        return objectstore_save.keepable_objects(dict(keeps))

    # ------------------------------------------------------------------ conversions
    @contextlib.contextmanager
    def local_copy(self, kind: str, scratch: Path) -> Iterator[Path]:
        from torchrl_dcp.storage.objectstore_tools import download_checkpoint, download_object

        if kind == "checkpoint":
            yield download_checkpoint(self.path, scratch / "src")
        else:
            yield download_object(self.path, scratch)

    def occupied(self) -> bool:
        return self.path.is_file() or bool(list_objects(self.path))

    def check_destination(self, kind: str, overwrite: bool) -> None:
        from torchrl_dcp.storage.objectstore_tools import check_replaceable

        _refuse_bucket(self.path)  # (what a save refuses, a conversion too)
        objectstore_save.refuse_inside_checkpoint(self.path)
        if kind == "checkpoint":  # (an archive's destination is an object: replaced, if it is an archive of ours)
            objectstore_save.refuse_an_object_at(self.path)
        if self.occupied():  # first: what overwrite=True would not replace either is said so at once
            if kind == "checkpoint":
                objectstore_save.replaced_save(self.path, list_objects(self.path))
            check_replaceable(self.path, kind)
            if not overwrite:
                raise CheckpointError(
                    "already exists; pass overwrite=True (CLI: --overwrite) to replace it", path=self.path
                )

    def receive(self, local: Path, kind: str) -> None:
        from torchrl_dcp.storage.objectstore_tools import upload_result

        upload_result(local, self.path, kind)


def _refuse_bucket(path: StorePath) -> None:
    """A checkpoint or archive is a key inside a bucket, never the bucket itself (a save's marker and lock live
    beside it, in its parent)."""
    if "/" not in path.key.strip("/"):
        raise CheckpointError(
            "is a bucket, not a checkpoint prefix or an archive inside one: name a key in it (e.g. "
            "s3://bucket/run/step-1)",
            path=path,
        )


def _bucket_exists(path: StorePath) -> bool:
    """Whether the bucket of ``path`` answers (``False`` when it does not, or when asking fails)."""
    try:
        return bool(path.fs.exists(path.key.strip("/").split("/")[0]))
    except Exception:  # noqa: BLE001 - no answer: the message that names the bucket stands
        return False
