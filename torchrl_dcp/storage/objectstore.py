"""Checkpoints under an object-store prefix (any fsspec URL): the transfers and the container (no torch).

A checkpoint at ``s3://bucket/run/step-100`` is the objects under that prefix, named
exactly as the files of a local checkpoint (``__<rank>_0.distcp``, ``.metadata``,
``manifest.json``), with the same bytes. A prefix without ``manifest.json`` is not a
checkpoint (a save that never committed). Reading:

- :class:`ObjectStoreContainer`: the manifest (size-bounded before it is fetched),
  the listing (sizes of every listed object, nothing unlisted), checksums computed
  from parallel ranged reads, small members read whole;
- :class:`~torchrl_dcp.storage.objectstore_source.ObjectStoreSource`: a
  :class:`~torchrl_dcp.storage.source.CheckpointSource` whose DCP reader fetches byte ranges planned from DCP's metadata (one GET per chunk
  object, :mod:`~torchrl_dcp.storage.objectstore_read`) and copies the tensor bytes
  into the destinations, checksums and save identities checked from the bytes fetched.
  ``.metadata`` goes through the allow-list unpickler only: nothing is ever unpickled otherwise.

Writing (:func:`upload_pieces`): S3 (s3fs) objects are uploaded as multipart uploads,
``TDCP_STORE_CONCURRENCY`` parts (default 8) of ``TDCP_STORE_PART_SIZE`` bytes (default
16 MiB) in flight at once, memory bounded by their product; other stores through
``fs.open(path, "wb", block_size=part size)`` (their own chunked uploads).

Example:
    >>> import torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.backends import open_source
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}).save("memory://doc/objectstore/c")
    >>> src = open_source(path)
    >>> type(src).__name__, sorted(src.manifest()["files"])
    ('ObjectStoreSource', ['.metadata', '__0_shared.distcp'])
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
)
from torchrl_dcp.format import manifest as schema
from torchrl_dcp.format.checksums import checksum_mismatch, crc32, crc32_combine, format_crc
from torchrl_dcp.format.layout import DCP_METADATA, MANIFEST, MAX_MANIFEST_BYTES, TRAILER_SIZE, is_plain_name
from torchrl_dcp.settings import setting
from torchrl_dcp.storage.base import ByteRange, ManifestParts, check_listing, files_to_check, no_manifest
from torchrl_dcp.storage.urls import StorePath, store_error

READ_PIECE = 8 << 20  # bytes per ranged read when checksumming or downloading


def part_size() -> int:
    """Bytes per uploaded part (``TDCP_STORE_PART_SIZE``, at least 5 MiB: S3's minimum part)."""
    return setting("TDCP_STORE_PART_SIZE")


def range_size() -> int:
    """Most bytes per ranged GET of a load (``TDCP_STORE_RANGE_SIZE``, default 32 MiB; larger records: several)."""
    return setting("TDCP_STORE_RANGE_SIZE")


def concurrency() -> int:
    """Requests in flight per rank (``TDCP_STORE_CONCURRENCY``, default 8)."""
    return setting("TDCP_STORE_CONCURRENCY")


# ---------------------------------------------------------------------- listing and ranged reads
#: the suffix of the marker object a save writes beside its prefix first and deletes at its commit
PENDING = ".tdcp-pending"


def marker_for(destination: StorePath) -> StorePath:
    """The marker object a save to ``destination`` writes first and deletes after its commit."""
    return destination.parent / f".{destination.name}{PENDING}"


def list_objects(path: StorePath) -> dict[str, dict[str, Any]]:
    """``{name: info}`` of what is directly under the prefix ``path`` (``{}`` when nothing is)."""
    fs = path.fs
    fs.invalidate_cache(path.key)
    try:
        entries = fs.ls(path.key, detail=True)
        if len(entries) == 1 and entries[0].get("type") == "file" and _hides_prefix(fs):
            entries = _under_an_object(fs, path.key)
    except FileNotFoundError:
        check_bucket(path)  # (a typo in the bucket's name is no empty prefix: a resume would start fresh)
        return {}
    except Exception as err:
        raise store_error(err, "listing the prefix", path) from None
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
        if str(e["name"]).rstrip("/") == path.key.rstrip("/"):
            if e.get("type") == "file":  # some stores list a file as itself (a console's folder marker ``x/``)
                continue
            name = "/"  # keys under ``x//`` (an empty segment): a prefix of the key itself, a name no file has
        held = out.get(name)
        if held is not None and (held.get("type") == "file") != (e.get("type") == "file"):
            # an object and a prefix of one name (``x`` and ``x/y``): both listed, the prefix as ``x/`` (a name no
            # file has: never a file the manifest lists, always a foreign entry), the object under its own name
            out[name], out[f"{name}/"] = (held, e) if held.get("type") == "file" else (e, held)
            continue
        out[name] = e
    return out


def _hides_prefix(fs: Any) -> bool:
    """Whether ``fs`` lists a key that is an object and a prefix as the object alone (fsspec's in-memory store;
    S3, GCS and Azure list the prefix's objects)."""
    return type(fs).__name__ == "MemoryFileSystem" and isinstance(getattr(fs, "store", None), dict)


def _under_an_object(fs: Any, key: str) -> list[dict[str, Any]]:
    """What an in-memory store holds under ``key/`` (objects, and sub-prefixes as directories), as ``ls`` would list
    it if no object sat at ``key`` itself (:func:`_hides_prefix`)."""
    root = "/" + key.strip("/") + "/"
    found: dict[str, dict[str, Any]] = {}
    for name, obj in list(fs.store.items()):
        if name.startswith(root):
            head, _, rest = name[len(root) :].partition("/")
            entry = root + head
            if rest:
                found.setdefault(entry, {"name": entry, "size": 0, "type": "directory"})
            else:
                found[entry] = {"name": entry, "size": obj.size, "type": "file"}
    return list(found.values())


def listed_child(path: StorePath, name: str) -> StorePath | None:
    """The path of ``name`` (from :func:`list_objects`) under ``path``; ``None`` where no path can name it: no plain
    name (a stray ``..`` key, a prefix listed as ``x/``), or a key the store reads as another one (a user's
    ``results?versionId=1.csv``: s3fs takes an object version there). Such a name is never an entry of ours."""
    if not is_plain_name(name):
        return None
    try:
        return path / name
    except CheckpointError:
        return None


def listed_path(path: StorePath, name: str) -> StorePath | str:
    """What names ``name`` (from :func:`list_objects`) in errors: its path, or its URL as a string where no path
    can name it (:func:`listed_child`)."""
    child = listed_child(path, name)
    return f"{path}/{name}" if child is None else child


#: protocols whose first path segment is a bucket (or container) that must exist before anything is under it
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})


def check_bucket(path: StorePath) -> None:
    """Raise when ``path``'s bucket does not exist (or is not visible with these credentials); nothing for stores
    without buckets, or when the store cannot say."""
    if path.protocol not in _BUCKETED:
        return
    bucket = path.key.strip("/").split("/", 1)[0]
    try:
        path.fs.info(bucket)  # (not fsspec's exists: it answers False to a 503 or a dropped connection)
        exists = True
    except FileNotFoundError:
        exists = False
    except Exception as err:  # noqa: BLE001 - no answer is not "no bucket": said as the failed request it is
        raise store_error(err, "listing the prefix (asking whether its bucket exists)", path) from None
    if not exists:
        raise CheckpointError(
            f"its bucket does not exist ({bucket!r}, or it is not visible with these credentials and endpoint): "
            "check the URL and storage_options, or create the bucket",
            path=path,
        )


def read_range(path: StorePath, start: int, size: int, expected_total: int | None = None) -> bytes:
    """``size`` bytes at ``start`` of the object ``path``; a short read is a truncated object."""
    if size == 0:
        return b""
    try:
        data = path.fs.cat_file(path.key, start=start, end=start + size)
    except Exception as err:
        raise store_error(err, f"reading bytes {start}..{start + size}", path) from None
    if len(data) > size:  # a store (or a proxy) that ignores the Range header: not a truncated object
        raise CheckpointError(
            f"asked for bytes {start}..{start + size} and the store returned {len(data)} bytes: it ignores ranged "
            "reads (Range headers); use a store or endpoint that serves them",
            path=path,
        )
    if len(data) != size:
        total = "" if expected_total is None else f" of the {expected_total} the manifest records"
        raise CheckpointIntegrityError(
            f"object ended {size - len(data)} bytes early at byte {start + len(data)}{total}: truncated", path=path
        )
    return data


def map_pieces(spans: list[tuple[StorePath, int, int]], work: Callable[[int, bytes], Any], threads: int) -> list[Any]:
    """Fetch every ``(object, start, size)`` span with ``threads`` requests in flight; ``work(i, data)`` on each."""
    if threads <= 1 or len(spans) <= 1:
        return [work(i, read_range(p, s, n)) for i, (p, s, n) in enumerate(spans)]
    with ThreadPoolExecutor(min(threads, len(spans)), thread_name_prefix="tdcp-store-read") as pool:
        futures = [pool.submit(lambda i=i, sp=sp: work(i, read_range(*sp))) for i, sp in enumerate(spans)]
        return [f.result() for f in futures]


def _pieces(size: int) -> list[tuple[int, int]]:
    """``(start, size)`` of equal reads of 8-16 MiB covering ``size`` bytes (a chunk file: one read)."""
    k = max(1, size // READ_PIECE)
    bounds = [size * i // k for i in range(k)] + [size]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def object_checksums(
    objects: list[tuple[StorePath, int]],
    threads: int | None = None,
    tails: dict[str, bytes] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """``"crc32:<hex>"`` of each ``(object, size)``, from parallel ranged reads (memory: threads × 16 MiB).

    ``tails``, when given, receives each object's last :data:`TRAILER_SIZE` bytes (its save identity), by URL;
    ``progress`` is called with the bytes of each piece read (from any thread, one at a time).
    """
    spans = [(p, s, n) for p, size in objects for s, n in _pieces(size)]
    lock = threading.Lock()

    def work(i: int, data: bytes) -> int:
        p, s, n = spans[i]
        if tails is not None and n >= TRAILER_SIZE and s + n == dict(objects)[p]:
            tails[str(p)] = data[-TRAILER_SIZE:]
        if progress is not None:
            with lock:
                progress(n)
        return crc32(data)

    crcs = map_pieces(spans, work, threads or concurrency())
    out, k = [], 0
    for _, size in objects:
        value = 0
        for _s, n in _pieces(size):
            value = crc32_combine(value, crcs[k], n)
            k += 1
        out.append(format_crc(value))
    return out


def download(path: StorePath, local: str | os.PathLike, size: int, checksum: str | None = None) -> None:
    """Copy the object ``path`` (``size`` bytes) into the new local file ``local`` by parallel ranged reads."""
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        spans = [(path, s, min(READ_PIECE, size - s)) for s in range(0, size, READ_PIECE)]

        def write(i: int, data: bytes) -> int:
            view, at = memoryview(data), spans[i][1]
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            return crc32(data)

        crcs = map_pieces(spans, write, concurrency())
    finally:
        os.close(fd)
    value = 0
    for (_, _, n), crc in zip(spans, crcs):
        value = crc32_combine(value, crc, n)
    if checksum is not None and format_crc(value) != checksum:
        raise checksum_mismatch(format_crc(value), checksum, path)


# ---------------------------------------------------------------------- uploads
def upload_pieces(path: StorePath, pieces: Iterable[Any], size: int) -> str | None:
    """Write the object ``path`` from the bytes-like ``pieces`` (``size`` bytes in all), in parallel parts; the new
    object's ETag when the store answers one (S3), else ``None``.

    Nothing is visible at ``path`` until the upload completes (an S3 multipart upload
    is only published by its completion; a failed one is aborted).
    """
    fs, part = path.fs, part_size()
    try:
        if size <= part:
            out = fs.pipe_file(path.key, b"".join(bytes(p) for p in pieces))
            return out.get("ETag") if isinstance(out, dict) else None
        if hasattr(fs, "_call_s3"):
            return _s3_multipart(path, _parts(pieces, part))
        with fs.open(path.key, "wb", block_size=part) as f:
            for p in pieces:
                f.write(p)
        return None
    except CheckpointError:
        raise
    except Exception as err:
        raise store_error(err, "uploading", path) from None


def _parts(pieces: Iterable[Any], part: int) -> Iterator[bytes | bytearray]:
    buf = bytearray()
    for p in pieces:
        view = memoryview(p).cast("B")
        while view:
            take = min(len(view), part - len(buf))
            buf += view[:take]
            view = view[take:]
            if len(buf) == part:
                yield buf
                buf = bytearray()
    if buf:
        yield buf


def _s3_multipart(path: StorePath, parts: Iterator[bytes | bytearray]) -> str | None:
    """An S3 multipart upload with up to :func:`concurrency` parts in flight, through s3fs's client."""
    from fsspec.asyn import sync

    fs = path.fs
    bucket, key, _ = fs.split_path(path.key)
    mpu = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]

    def send(number: int, body: bytes | bytearray) -> dict[str, Any]:
        out = sync(
            fs.loop,
            fs._call_s3,
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    done: list[dict[str, Any]] = []
    slots = threading.BoundedSemaphore(concurrency())
    try:
        with ThreadPoolExecutor(concurrency(), thread_name_prefix="tdcp-store-upload") as pool:
            futures: list[Future[dict[str, Any]]] = []
            for number, body in enumerate(parts, start=1):
                slots.acquire()  # bounded memory: at most concurrency() parts built and in flight
                fut = pool.submit(send, number, body)
                fut.add_done_callback(lambda _f: slots.release())
                futures.append(fut)
            done = [f.result() for f in futures]
        out = sync(
            fs.loop,
            fs._call_s3,
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": done},
        )
    except BaseException:
        try:
            sync(fs.loop, fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the original failure is what the user needs to see
            pass
        raise
    fs.invalidate_cache(path.key)
    return out.get("ETag")


def _bounded(obj: StorePath) -> bytes | None:
    """The object whole in one GET, up to one byte past :data:`MAX_MANIFEST_BYTES` (``None``: no such object)."""
    try:  # a range past the end of an object gives what there is
        return obj.fs.cat_file(obj.key, start=0, end=MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError:  # S3 answers a range of an empty object with 416 (not satisfiable): an empty object, not a failure
        if _is_empty(obj):
            return b""
        raise


def _is_empty(obj: StorePath) -> bool:
    try:
        return int(obj.fs.info(obj.key).get("size", -1)) == 0
    except Exception:  # noqa: BLE001 - asked only to tell an empty object from a failed read (which is raised)
        return False


# ---------------------------------------------------------------------- the container
class ObjectStoreContainer(ManifestParts):
    """A committed checkpoint under an object-store prefix (the :class:`~torchrl_dcp.storage.base.Container` protocol)."""

    def __init__(self, path: StorePath) -> None:
        self.path: Any = path
        self._manifest: dict[str, Any] | None = None
        self.tails: dict[str, bytes] = {}  # {object URL: last 64 bytes} of the objects checksummed
        self._early: dict[str, Future[Any]] = {}

    def prefetch(self, *, listing: bool = True) -> None:
        """Send the requests a reader makes first at once: the manifest (a bounded GET) and, with ``listing``, the
        listing, instead of one after the other. Their checks are unchanged (they run on use). (DCP's ``.metadata``
        is not among them: a format-5 load never reads it.) One rank of a load (``listing=False``) never lists
        the prefix: :meth:`check` with ``only`` needs no listing."""
        with ThreadPoolExecutor(2, thread_name_prefix="tdcp-store-open") as pool:
            self._early = {MANIFEST: pool.submit(_bounded, self.path / MANIFEST)}
            if listing:
                self._early[""] = pool.submit(list_objects, self.path)

    def _take(self, name: str) -> Any:
        """A prefetched answer (``""``: the listing), else the request now."""
        early = self._early.pop(name, None)
        if early is not None:
            return early.result()
        return list_objects(self.path) if name == "" else _bounded(self.path / name)

    def root(self) -> dict[str, Any]:
        if self._manifest is None:
            file = self.path / MANIFEST
            try:
                data = self._take(MANIFEST)
            except Exception as err:
                raise store_error(err, "reading the manifest", file) from None
            if data is None:
                if not list_objects(self.path):
                    if self.path.is_file():
                        raise CheckpointFormatError(
                            "is a single object (an archive?), not a checkpoint prefix: use to_directory to unpack "
                            "an archive of ours; a torchrl.checkpoint archive is read from a local path (copy it "
                            "there first)",
                            path=self.path,
                        )
                    raise CheckpointNotFoundError("no checkpoint here: nothing under this prefix", path=self.path)
                if marker_for(self.path).is_file():  # what a directory's staging beside it is: no checkpoint
                    raise CheckpointNotFoundError(
                        "no checkpoint here: a save to this prefix has not committed (it is running, or it was "
                        "killed: the next save here removes what it left)",
                        path=self.path,
                    )
                raise CheckpointFormatError(no_manifest((self.path / DCP_METADATA).is_file()), path=self.path)
            if len(data) > MAX_MANIFEST_BYTES:
                raise CheckpointFormatError(
                    f"is implausibly large (over {MAX_MANIFEST_BYTES} bytes expected at most)", path=file
                )
            self._root_bytes, self._root_read = data, True  # (kept before the parse: a damaged one is told apart)
            self._manifest = schema.loads_manifest(data, file)
        return self._manifest

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """As :meth:`Container.check`. With ``only`` (one rank of a load) the prefix is not listed, unless a listing
        was fetched already: each of these objects is then read only within its recorded size, a short read fails as
        truncated, and rank 0 of the same load (``only=None``) compares every object's size with the one listing
        the load makes (at 1,000 ranks: 1 LIST instead of 1,000, each of every object)."""
        files = self.listed()
        wanted = set(files) if checksum is True else set() if checksum is False else set(checksum)
        found: dict[str, Any] | None = self._take("") if only is None or "" in self._early else None
        if found is not None:
            for name, rec in files_to_check(files, wanted, only).items():
                info = found.get(name)
                if info is None or info.get("type") != "file":
                    raise CheckpointIntegrityError("object listed in the manifest is missing", path=self.path / name)
                if int(info.get("size") or 0) != rec["size"]:
                    raise CheckpointIntegrityError(
                        f"size is {info.get('size')} bytes, the manifest says {rec['size']}: truncated or altered",
                        path=self.path / name,
                    )
            if only is None:
                check_listing(
                    ((n, int(i.get("size") or 0) if i.get("type") == "file" else None) for n, i in found.items()),
                    self,
                    lambda name: listed_path(self.path, name),
                    "object",
                )
        names = sorted(wanted)
        actual = object_checksums(
            [(self.path / n, files[n]["size"]) for n in names], tails=self.tails, progress=progress
        )
        for name, value in zip(names, actual):
            if value != files[name]["checksum"]:
                raise checksum_mismatch(value, files[name]["checksum"], self.path / name)

    def read_member(self, name: str, limit: int) -> bytes | None:
        rec = self.listed().get(name)
        if rec is None:
            return None
        if rec["size"] > limit:
            raise CheckpointFormatError(
                f"is implausibly large ({rec['size']} bytes, at most {limit} expected)", path=self.path / name
            )
        try:
            return read_range(self.path / name, 0, rec["size"], rec["size"])
        except CheckpointIntegrityError as err:
            if not isinstance(err.__context__, FileNotFoundError):  # (store_error's, raised from None)
                raise
            # (in the words of the other backends: a listed file that is not there)
            raise CheckpointIntegrityError("object listed in the manifest is missing", path=self.path / name) from None

    def byte_range(self, name: str) -> ByteRange:
        rec = self.listed().get(name)
        if rec is None:
            raise CheckpointIntegrityError("data file is not listed in the manifest: refused", path=self.path / name)
        return ByteRange((self.path / name).key, 0, rec["size"], str(self.path / name))
