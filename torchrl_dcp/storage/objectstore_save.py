"""Saving to an object-store prefix: every rank uploads its data file in parallel parts; the manifest commits.

The object-store save target (:mod:`torchrl_dcp.storage.objectstore_location`) runs these
steps of the one save sequence (``save_engine.run``):

1. **prepare** (rank 0): sweep what killed saves left in the parent prefix (each save
   announces itself with a marker object ``<parent>/.<name>.tdcp-pending`` before it
   writes anything; a marker whose checkpoint has no manifest marks a dead save, whose
   objects are deleted), refuse a prefix holding foreign objects, write this save's
   marker, and when the destination holds a committed checkpoint, delete its
   ``manifest.json`` first (it is no longer a checkpoint), then its objects;
2. **write** (every rank, at once): ``__<rank>_0.distcp`` in the local format (the
   records of ``storage/writer.py``, the identity trailer), streamed from the tensors
   in multipart uploads with its CRC-32 computed on the way;
3. **commit** (rank 0, after gathering every rank's file records): ``.metadata``, then
   ``manifest.json`` **last** (one PUT: it appears whole or not at all), then the marker
   is deleted. Every rank learns the outcome.

A kill at any point leaves every other checkpoint intact and this prefix without a
manifest (absent to readers); the next save into the same parent prefix removes it.

Example:
    >>> import torch, torchrl_dcp as tdcp
    >>> ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)})
    >>> str(ckpt.save("memory://doc/save/step-1", step=1))
    'memory://doc/save/step-1'
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from collections.abc import Collection, Container, Mapping
from typing import Any

import torch

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.checksums import crc32, crc32_combine, format_crc
from torchrl_dcp.format.layout import (
    DCP_METADATA,
    MANIFEST,
    TRAILER_SIZE,
    identity_trailer,
    is_chunk_file,
    is_data_file,
    is_library_file,
    read_identity,
)
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.storage import proven
from torchrl_dcp.storage.base import ShareWrite, WriteOutcome
from torchrl_dcp.storage.chunk_writer import ChunkFile, ChunkJob, KeptChunk, chunk_file_parts
from torchrl_dcp.storage.objectstore import (
    PENDING,
    ObjectStoreContainer,
    concurrency,
    list_objects,
    listed_child,
    map_pieces,
    marker_for,
    upload_pieces,
)
from torchrl_dcp.storage.proven import ChunkIdentity
from torchrl_dcp.storage.urls import StorePath, copy_object, delete_objects, store_error
from torchrl_dcp.storage.writer import plan_layout

logger = get_logger(__name__)


# ---------------------------------------------------------------------- markers and sweeping
def remove_prefix(path: StorePath, manifest_first: bool = True) -> None:
    """Delete the checkpoint objects directly under ``path`` (its ``manifest.json`` first, so it stops being a
    checkpoint at once); only names this library writes, never a sub-prefix or anything else found there."""
    fs = path.fs
    names = list_objects(path)
    if manifest_first and MANIFEST in names:
        fs.rm_file((path / MANIFEST).key)
    keys = [
        (path / n).key
        for n, info in names.items()
        if is_library_file(n) and info.get("type") == "file" and (n != MANIFEST or not manifest_first)
    ]
    delete_objects(fs, keys)
    fs.invalidate_cache(path.key)


def foreign_objects(
    path: StorePath, found: dict[str, dict[str, Any]] | None = None, listed: Container[str] | None = None
) -> list[str]:
    """What is under ``path`` that a save never writes there: other names, sub-prefixes and, given the files its
    manifest lists (``listed``, its shards' included), objects named like ours that it does not list (a save leaves
    none: a user's ``__7_0.distcp`` is theirs), as :func:`~torchrl_dcp.storage.directory.foreign_entries` says of a
    directory."""
    found = list_objects(path) if found is None else found
    return sorted(
        n
        for n, info in found.items()
        if not is_library_file(n)
        or info.get("type") != "file"
        or (listed is not None and n != MANIFEST and n not in listed)
    )


def _is_save_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 32 and value.isalnum()


#: a marker's size limit: it names the save, the save it replaces and the saves of the chunk files it may keep
_MARKER_MAX = 64 << 10


def _marker_saves(marker: StorePath) -> tuple[set[str], set[str]] | None:
    """``(saves, kept_from)`` a marker names (``None``: no marker there, or not one this library wrote): the save it
    announces and the saves of the checkpoint it replaces (``replaces``: the committed one's, or those a damaged one's
    objects carry), whose objects a killed or failed retirement leaves; and the saves whose chunk files may lie there
    (``kept_from``: what the save may copy from its incremental base, and the replaced checkpoint's kept chunks).

    Raises:
        CheckpointError: the store failed to answer (a 503, a dropped connection): never read as "no marker".
    """
    try:
        raw = marker.fs.cat_file(marker.key, start=0, end=_MARKER_MAX)
    except FileNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - s3fs lets a dropped connection out as botocore's own error
        raise store_error(err, "reading a pending marker", marker) from None
    try:
        body = loads_json(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or not _is_save_id(body.get("save_id")):
        return None
    replaces, kept = body.get("replaces"), body.get("kept_from")
    replaced = replaces if isinstance(replaces, list) else [replaces]
    return (
        {body["save_id"], *(s for s in replaced if _is_save_id(s))},
        {s for s in kept if _is_save_id(s)} if isinstance(kept, list) else set(),
    )


def _data_trailers(target: StorePath, found: dict[str, dict[str, Any]]) -> dict[str, str] | None:
    """``{data object: the save its identity trailer names}`` under ``target``; ``None`` when anything there is no
    library object, or a data object carries no trailer."""
    if foreign_objects(target, found):
        return None
    names = sorted(n for n in found if is_data_file(n))  # (the manifest, its shards and .metadata carry none)
    sizes = [int(found[n].get("size") or 0) for n in names]
    if any(size < TRAILER_SIZE for size in sizes):
        return None
    spans = [(target / n, size - TRAILER_SIZE, TRAILER_SIZE) for n, size in zip(names, sizes)]
    tails = map_pieces(spans, lambda i, data: read_identity(bytes(data)), concurrency())
    if any(t is None for t in tails):
        return None
    return {n: t[0] for n, t in zip(names, tails)}


def _left_by(
    target: StorePath, found: dict[str, dict[str, Any]], saves: set[str] | None, kept_from: Collection[str] = ()
) -> bool:
    """Whether every object under ``target`` is one the saves ``saves`` write (``None``: any save): library names
    only, each data file ending with one of those saves' identity trailer, or, for a chunk file, that of a save in
    ``kept_from`` (copied from the incremental base)."""
    trailers = _data_trailers(target, found)
    return trailers is not None and all(
        saves is None or save in saves or (is_chunk_file(n) and save in kept_from) for n, save in trailers.items()
    )


def sweep(parent: StorePath) -> list[str]:
    """Remove what killed saves left under ``parent``; returns the checkpoint names cleaned.

    Only what this library wrote goes: a marker ``.<name>.tdcp-pending`` naming an entry
    (never ``parent`` itself) whose body names a save, and, when that entry has no manifest,
    its objects, once each is proven that save's (library names, identity trailers).
    Anything else found is logged and left alone. A marker whose checkpoint has a manifest
    belongs to a save killed after its commit: only the marker goes. Assumes one job writes
    checkpoints under ``parent`` at a time.
    """
    cleaned = []
    for name in list_objects(parent):
        if not (name.startswith(".") and name.endswith(PENDING)):
            continue
        entry = name[1 : -len(PENDING)]
        marker, target = listed_child(parent, name), listed_child(parent, entry)  # (None: a name no save makes)
        try:
            named = None if marker is None or target is None or entry.startswith(".") else _marker_saves(marker)
        except CheckpointError as err:  # (a 503: the marker is read again by the next save)
            logger.warning("left %s/%s alone for now: %s", parent, name, err)
            continue
        if named is None or target is None:
            logger.warning(
                "left %s/%s alone: not a marker torchrl_dcp writes (remove it if it is not yours)", parent, name
            )
            continue
        if not (target / MANIFEST).is_file():
            found = list_objects(target)
            if found and not _left_by(target, found, *named):
                logger.warning(
                    "left %s alone: the marker %s names saves %s, but the prefix holds objects they did not write "
                    "(%s); remove what is not yours by hand",
                    target,
                    marker.name,
                    sorted(named[0]),
                    foreign_objects(target, found) or "other saves' data files",
                )
                continue
            remove_prefix(target)
            cleaned.append(target.name)
        marker.unlink(missing_ok=True)
    if cleaned:
        logger.info("removed leftovers of killed saves under %s: %s", parent, cleaned)
    return cleaned


def swept_next(destination: StorePath, found: dict[str, dict[str, Any]]) -> bool:
    """Whether the next save's sweep (:func:`sweep`) removes ``destination`` (holding ``found``, no manifest): a
    killed save's prefix, named by its pending marker, every object proven that save's.

    Raises:
        CheckpointError: the store failed to answer.
    """
    named = _marker_saves(marker_for(destination))
    return named is not None and _left_by(destination, found, *named)


def refuse_inside_checkpoint(destination: StorePath) -> None:
    """Refuse a destination under a committed checkpoint's prefix (what a save or conversion writes there is an object
    that checkpoint's manifest does not list: it would no longer load), as local paths are refused
    (:func:`~torchrl_dcp.storage.directory.refuse_inside_checkpoint`). One ``isfile`` per level of the key."""
    current = destination
    while (parent := current.parent) != current:
        if (parent / MANIFEST).is_file():
            try:
                ObjectStoreContainer(parent).manifest()
            except CheckpointError:
                pass  # a manifest.json that is not a checkpoint's: nothing of ours to damage
            else:
                raise CheckpointError(
                    f"is inside the checkpoint {parent}: anything written there is an object its manifest does not "
                    "list, and it would no longer load; choose a prefix outside it",
                    path=destination,
                )
        current = parent


def refuse_an_object_at(destination: StorePath) -> None:
    """Refuse a checkpoint prefix whose key is itself an object (a user's file): the checkpoint's objects would lie
    beside it, under ``<key>/`` (a store has no directories to refuse it), and the path would name both."""
    if destination.is_file():
        raise CheckpointError(
            "is an object (a file), not a prefix: a checkpoint written here would lie beside it, under its name; "
            "choose another path, or move the object",
            path=destination,
        )


def replaced_save(destination: StorePath, found: dict[str, dict[str, Any]]) -> tuple[list[str], set[str]]:
    """``(saves, kept chunks' origins)`` of the checkpoint a save to ``destination`` (holding the objects ``found``)
    replaces: its save and the saves its kept chunk objects come from, or, for a damaged checkpoint of ours (replaced
    as well), the saves its data objects' identity trailers name: what a marker names so that the next sweep proves
    what a killed retirement leaves. A :class:`CheckpointError` when it holds anything a save may not replace (a
    user's objects, beside a checkpoint or alone)."""
    container = ObjectStoreContainer(destination)
    replaces: list[str] = []
    origins: set[str] = set()
    listed = None
    try:
        manifest = container.manifest()
        replaces, listed = [manifest["save_id"]] if manifest.get("save_id") else [], manifest["files"]
        origins = {rec["origin"] for rec in listed.values() if isinstance(rec.get("origin"), str)}
    except CheckpointError as err:
        # a damaged checkpoint of ours (its manifest there and ours, every data object a save's) is replaced
        # (and holds data objects: a user's own manifest.json and .metadata are no evidence a save wrote them)
        ours = container.root_damaged(err) and any(is_data_file(n) for n in found)
        trailers = _data_trailers(destination, found) if ours else None
        if trailers is not None:
            replaces = sorted(set(trailers.values()))
        else:
            raise CheckpointError(
                f"holds {len(found)} object(s) but no valid {MANIFEST}: not a torchrl_dcp checkpoint; refusing to "
                "overwrite it (choose another path, or delete the objects)",
                path=destination,
            ) from None
    foreign = foreign_objects(destination, found, listed)
    if foreign:
        raise CheckpointError(
            f"holds objects a checkpoint never holds ({foreign[:5]}); refusing to replace it: move them, or "
            "save elsewhere",
            path=destination,
        )
    return replaces, origins


def begin(destination: StorePath, save_id: str, kept_from: Collection[str] = ()) -> None:
    """Step 1 (one process): sweep, refuse foreign objects, write the marker, retire a committed checkpoint.
    ``kept_from``: the saves whose chunk files the save may copy in (named by the marker: a sweep proves them)."""
    refuse_inside_checkpoint(destination)
    refuse_an_object_at(destination)
    sweep(destination.parent)
    found = list_objects(destination)
    replaces, origins = replaced_save(destination, found) if found else ([], set())
    # the marker names the replaced checkpoint's saves too: a retirement that fails or is killed half-way leaves
    # objects of those saves (its kept chunks: of their origins), which the next sweep then proves and removes
    kept = sorted({*kept_from, *origins})
    body = json.dumps({"save_id": save_id, "started": time.time(), "replaces": replaces, "kept_from": kept}).encode()
    if len(body) > _MARKER_MAX:  # (a base of chunk files kept over thousands of saves: proven by hand, if killed)
        body = json.dumps({"save_id": save_id, "started": time.time(), "replaces": replaces}).encode()
    marker_for(destination).fs.pipe_file(marker_for(destination).key, body)
    if found:  # replacing a committed checkpoint: it stops being one before any object changes
        remove_prefix(destination)


def finish(destination: StorePath, metadata_bytes: bytes | None, manifest_bytes: bytes) -> None:
    """Step 3 (one process): ``.metadata``, then ``manifest.json`` last (the commit), then drop the marker."""
    if metadata_bytes is not None:
        destination.fs.pipe_file((destination / DCP_METADATA).key, metadata_bytes)
    commit_manifest(destination, manifest_bytes)


def check_uploaded(destination: StorePath, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Exactly ``files`` (the manifest's records) are under ``destination``, each of its recorded size."""
    found = list_objects(destination)
    for name in sorted(set(found) - set(files)):
        raise CheckpointError(
            "appeared under the prefix while the save ran (another writer?); nothing was committed",
            path=destination / name,
        )
    for name, rec in sorted(files.items()):
        info = found.get(name)
        if info is None:  # uploaded (its writer said so) but not listed here: another store, or deleted meanwhile
            raise CheckpointError(
                f"is absent, though its writer uploaded its {rec['size']} bytes: do all ranks write to the same "
                "store (the same endpoint_url and storage_options everywhere; memory:// is one store per process, "
                "for one-rank jobs), or was it deleted meanwhile? Nothing was committed",
                path=destination / name,
            )
        if info.get("type") != "file" or int(info.get("size") or -1) != int(rec["size"]):
            raise CheckpointError(
                f"is not the object of {rec['size']} bytes this save uploaded; nothing was committed",
                path=destination / name,
            )


def commit_manifest(destination: StorePath, manifest_bytes: bytes) -> None:
    """``manifest.json`` (one PUT: it appears whole or not at all: the commit), then drop the marker (a failure to
    drop it is logged: the save is committed, and the next sweep under the parent removes the marker alone)."""
    fs = destination.fs
    fs.pipe_file((destination / MANIFEST).key, manifest_bytes)
    fs.invalidate_cache(destination.key)
    try:
        marker_for(destination).unlink(missing_ok=True)
    except Exception as err:  # noqa: BLE001 - committed: a leftover marker is swept, never a reason to say it failed
        logger.warning(
            "%s: committed; its marker %s was left (%s), the next save under %s removes it",
            destination,
            marker_for(destination).name,
            err,
            destination.parent,
        )


def abandon(destination: StorePath) -> None:
    """Best-effort clean-up after a failed save (the next save sweeps what this leaves)."""
    try:
        if not (destination / MANIFEST).is_file():
            remove_prefix(destination)
        marker_for(destination).unlink(missing_ok=True)
    except Exception as err:  # noqa: BLE001 - the save's own failure is what is raised
        logger.warning("could not clean up %s after a failed save: %s", destination, err)


# ---------------------------------------------------------------------- step 2: one rank's data file
def file_pieces(tensors: list[tuple[str, torch.Tensor]], trailer: bytes) -> tuple[Any, list[Any]]:
    """The layout of one data file (``storage/writer.py``'s records) and its pieces in file order, CRCs set."""
    layout = plan_layout(tensors, trailer)
    for tpl, head, data_units, tail in layout.large:  # large records: their headers hold the CRC of their bytes
        value = 0
        for u in data_units:  # (a device window is copied here for its CRC and again when uploaded)
            u.crc = crc32(u.bytes())
            value = crc32_combine(value, u.crc, u.length)
        head.data, tail.data = tpl.parts(value)
    return layout, layout.units


def write_data_file(
    destination: StorePath, name: str, rank: int, tensors: list[tuple[str, torch.Tensor]], save_id: str
) -> Any:
    """Upload one of this rank's data files (``ShareWrite.data_files``); returns ``(entries, {"size", "checksum"})``."""
    layout, units = file_pieces(tensors, identity_trailer(save_id, rank))
    large = {id(u) for _, _, data_units, _ in layout.large for u in data_units}

    def stream() -> Any:
        for u in units:
            data = u.bytes()
            if id(u) not in large:
                u.crc = crc32(data)
            yield data

    upload_pieces(destination / name, stream(), layout.size)
    value = 0
    for u in units:
        value = crc32_combine(value, u.crc, u.length)
    return layout.entries, {"size": layout.size, "checksum": format_crc(value)}


def write_share(destination: StorePath, share: ShareWrite) -> WriteOutcome:
    """Upload this rank's share: its data file, and its chunk files (a kept one copied server-side from the
    base's prefix, :func:`keep_object`, never through this host)."""
    out = WriteOutcome()
    for name, tensors in share.data_files():
        out.add_data_file(name, *write_data_file(destination, name, share.rank, tensors, share.save_id))
    if share.chunks:
        threads = min(concurrency(), len(share.chunks))
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tdcp-store-chunk") as pool:
            for job, result in zip(share.chunks, pool.map(lambda j: put_chunk(destination, j, share), share.chunks)):
                job.result = result
        out.add_chunks(share.chunks)
    return out


def put_chunk(destination: StorePath, job: ChunkJob, share: ShareWrite) -> ChunkFile:
    """One chunk file into ``destination``: copied from the base when kept (and still the object proven), else
    uploaded from its rows. Either way the new object's version is recorded as proven for later saves."""
    kept = job.keep
    if kept is not None:
        if keep_object(kept, destination / job.file):
            return ChunkFile(kept.size, kept.checksum, kept.size - TRAILER_SIZE, kept.fingerprint, kept.origin)
        if job.tensor is None:  # async save: its rows were not staged
            raise CheckpointError(
                f"{kept.source} changed after the incremental save checked it; save again (or without "
                "incremental_from)",
                path=destination,
            )
    assert job.tensor is not None
    parts, record = chunk_file_parts(job.tensor, share.save_id, share.rank, stable=True)
    target = destination / job.file
    etag = upload_pieces(target, iter(parts), record.size)
    chunk = ChunkIdentity(job.key, job.start, job.rows, record.size, record.checksum, record.fingerprint)
    proven.record_object(str(target), _version(target, etag), chunk)
    return record


def keep_object(kept: KeptChunk, dst: StorePath) -> bool:
    """Copy the kept chunk object to ``dst`` server-side, only while it is the version proven
    (:func:`keepable_objects`; S3: a conditional copy); ``False`` (nothing left at ``dst``) otherwise."""
    src: StorePath = kept.source  # type: ignore[assignment]
    version = proven.object_version_of(str(src), kept.identity())
    if version is None:
        return False
    etag = version[len("ETag:") :] if version.startswith("ETag:") else None
    try:
        copied = copy_object(src.fs, src.key, dst.key, if_match=etag)
    except CheckpointError as err:
        logger.info("could not copy %s (%s): uploading its rows", src, err.message)
        dst.unlink(missing_ok=True)
        return False
    if (etag is None or copied != etag) and proven.object_version(_info(src)) != version:  # condition ignored
        dst.unlink(missing_ok=True)  # (an identical single-part copy keeps its ETag; else the source is asked)
        return False
    proven.record_object(str(dst), _version(dst, copied), kept.identity())
    return True


def _info(obj: StorePath) -> dict[str, Any]:
    try:
        obj.fs.invalidate_cache(obj.key)
        return dict(obj.fs.info(obj.key))
    except (OSError, ValueError):
        return {}


def _version(obj: StorePath, etag: str | None) -> str | None:
    """The version of the object just written: the ETag the store answered, else one ``info`` (HEAD)."""
    return f"ETag:{etag}" if etag else proven.object_version(_info(obj))


def keepable_objects(keeps: dict[str, KeptChunk]) -> dict[str, KeptChunk]:
    """The kept chunks whose base object is, at the version listed now, one this process uploaded or copied as
    holding that chunk (:mod:`~torchrl_dcp.storage.proven`): one listing per base prefix, no reads. Objects it
    knows nothing of (a forger may have resealed the manifest) are uploaded again."""
    listed: dict[str, dict[str, Any]] = {}
    for prefix in {k.source.parent for k in keeps.values()}:  # type: ignore[union-attr]
        for name, info in list_objects(prefix).items():
            if (child := listed_child(prefix, name)) is not None:  # (a stray ``..`` key, ``x/``: no chunk of a base)
                listed[str(child)] = info
    out = {}
    for f, k in keeps.items():
        info = listed.get(str(k.source), {})
        if int(info.get("size") or -1) == k.size and proven.vouches_object(
            str(k.source), proven.object_version(info), k.identity()
        ):
            out[f] = k
    return out


def publish_directory(local: Any, destination: StorePath, manifest: dict[str, Any], raw_manifest: bytes) -> None:
    """Upload the verified local checkpoint directory ``local`` to ``destination``, manifest last (conversions)."""
    origins = {rec["origin"] for rec in manifest["files"].values() if isinstance(rec.get("origin"), str)}
    begin(destination, manifest.get("save_id") or uuid.uuid4().hex, origins)
    try:
        for name, rec in manifest["files"].items():
            if name == DCP_METADATA:
                continue
            with open(local / name, "rb") as f:
                upload_pieces(destination / name, iter(lambda f=f: f.read(8 << 20), b""), rec["size"])
        meta = (local / DCP_METADATA).read_bytes() if DCP_METADATA in manifest["files"] else None
        finish(destination, meta, raw_manifest)
    except BaseException:
        abandon(destination)
        raise
