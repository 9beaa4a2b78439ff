"""Checkpoint paths that are fsspec URLs (``s3://bucket/run/step-100``, ``gs://…``, ``memory://…``).

:func:`resolve_path` parses a path: a local path
(``str``/``os.PathLike``, and ``file://`` URLs) stays a :class:`pathlib.Path` and
keeps the POSIX code paths; any other ``<protocol>://`` URL becomes a
:class:`StorePath`, a small path-like value that carries its fsspec file system
(endpoints and credentials come from fsspec's own configuration, or from
``storage_options``, passed as is to the file system's constructor).

Example:
    >>> from torchrl_dcp.storage.urls import StorePath, resolve_path
    >>> p = resolve_path("memory://bucket/run/step-100")
    >>> isinstance(p, StorePath), p.name, str(p.parent)
    (True, 'step-100', 'memory://bucket/run')
    >>> resolve_path("file:///tmp/x")
    PosixPath('/tmp/x')
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import CheckpointError, CheckpointIntegrityError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}

__all__ = ["StorePath", "copy_object", "is_url", "resolve_path", "supports_copy"]


def is_url(path: Any) -> bool:
    """Whether ``path`` is a ``<protocol>://`` string (``file://`` included)."""
    return isinstance(path, str) and _URL.match(path) is not None


def _check_resolved(fs: Any, url: str) -> None:
    """Refuse a URL the store resolves to another object than its path says: s3fs reads ``?versionId=`` in a key as
    an object version (``s3://b/run?versionId=1/step-1/x`` is the object ``run``, outside the prefix), gcsfs ``#``
    as a generation. Every object of such a checkpoint would land on (and its cleanup delete) another key."""
    split = getattr(fs, "split_path", None)
    if split is None:
        return
    try:
        parts = split(url)
    except Exception:  # noqa: BLE001 - a store that cannot split it: its own calls say why
        return
    if not isinstance(parts, tuple) or len(parts) < 2:
        return
    resolved = "/".join(str(p) for p in parts[:2] if p).rstrip("/")
    version = parts[2] if len(parts) > 2 else None
    if version is not None or resolved != fs._strip_protocol(url).strip("/"):
        raise CheckpointError(
            f"the store reads this URL as object {resolved!r}"
            + (f" at version {version!r}" if version else "")
            + ", not the key its path names (s3fs takes '?versionId=' for an object version, gcsfs '#' for a "
            "generation): choose a prefix without it",
            path=url,
        )


class StorePath:
    """An object-store location: its URL, its fsspec file system and the key prefix inside it.

    Supports the few ``pathlib`` operations the library uses: ``/``, ``name``,
    ``parent``, ``exists()``, ``is_file()``, ``is_dir()``, ``unlink()``; ``str()`` is the URL.
    It is deliberately not ``os.PathLike``: no local file function can take it by mistake.

    Example:
        >>> p = StorePath("memory://b/ckpts") / "step-1"
        >>> str(p), p.key
        ('memory://b/ckpts/step-1', '/b/ckpts/step-1')
    """

    __slots__ = ("url", "storage_options", "_fs")

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, fs: Any = None) -> None:
        m = _URL.match(url)
        if m is None:
            raise CheckpointError("not a URL (expected <protocol>://...)", path=url)
        rest = url[m.end() :].rstrip("/")
        if not rest or any(part in ("", ".", "..") for part in rest.split("/")[1:]):
            raise CheckpointError(
                "a checkpoint URL needs a bucket and a key without empty, '.' or '..' parts (e.g. s3://bucket/run/step-1)",
                path=url,
            )
        self.url = f"{m.group(1)}://{rest}"
        self.storage_options = dict(storage_options or {})
        self._fs = fs
        if fs is not None:
            _check_resolved(fs, self.url)

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def fs(self) -> Any:
        """The fsspec file system (created on first use; fsspec caches instances by their arguments)."""
        if self._fs is None:
            fs = _filesystem(self.protocol, self.storage_options, self.url)
            _check_resolved(fs, self.url)
            self._fs = fs
        return self._fs

    @property
    def key(self) -> str:
        """The path inside the file system (what its methods take)."""
        return self.fs._strip_protocol(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        """The enclosing prefix; the top one (a bucket, or the first part of ``memory:///run``) is its own parent."""
        head = self.url.rsplit("/", 1)[0]
        if head.endswith(":/") or head.endswith("://"):
            return self
        return StorePath(head, self.storage_options, self._fs)

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(f"{self.url}/{name}", self.storage_options, self._fs)

    def _kind(self) -> str | None:
        """What is at this key: ``"file"``, ``"directory"`` (a prefix with objects under it) or ``None`` (nothing).
        A request that fails raises: fsspec's ``exists``/``isfile`` answer ``False`` to a 503 or a dropped
        connection, and a sweep took a committed checkpoint's manifest for absent and deleted the checkpoint."""
        self.fs.invalidate_cache(self.key)  # (a listing cached by this process may predate another's upload)
        try:
            info = self.fs.info(self.key)
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - any other failure is no answer: raised, naming the object
            raise store_error(err, "asking the store what is at this key", self) from None
        return "file" if info.get("type") == "file" else "directory"

    def exists(self) -> bool:
        return self._kind() is not None

    def is_file(self) -> bool:
        return self._kind() == "file"

    def is_dir(self) -> bool:
        return self._kind() == "directory"

    def is_symlink(self) -> bool:
        return False

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StorePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __getstate__(self) -> tuple[str, dict[str, Any]]:  # sent between ranks: the file system is made again there
        return self.url, self.storage_options

    def __setstate__(self, state: tuple[str, dict[str, Any]]) -> None:
        self.url, self.storage_options = state
        self._fs = None

    def same_store(self, other: Any) -> bool:
        """Whether ``other`` is a location in the same store (protocol and options): a server-side copy can join them."""
        return isinstance(other, StorePath) and (self.protocol, self.storage_options) == (
            other.protocol,
            other.storage_options,
        )


def _filesystem(protocol: str, options: Mapping[str, Any], url: str) -> Any:
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with torch
        raise CheckpointError("object-store paths need fsspec: pip install torchrl_dcp[s3]", path=url) from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as err:
        extra = _EXTRA.get(protocol)
        hint = (
            f"pip install torchrl_dcp[s3] (or {extra})" if extra == "s3" else f"install {extra or 'its fsspec backend'}"
        )
        raise CheckpointError(f"no fsspec file system for {protocol}:// ({err}); {hint}", path=url) from None
    try:
        return cls(**dict(options))
    except Exception as err:
        raise CheckpointError(
            f"cannot set up the {protocol}:// file system ({type(err).__name__}: {err}); check storage_options",
            path=url,
        ) from None


def is_file_url(path: Any) -> bool:
    """Whether ``path`` is a ``file://`` URL (a local path spelled as a URL: :func:`resolve_path` maps it).

    Example:
        >>> is_file_url("FILE:///tmp/x"), is_file_url("/tmp/x"), is_file_url("s3://b/x")
        (True, False, False)
    """
    return isinstance(path, str) and path[: len("file://")].lower() == "file://"


def resolve_path(path: str | os.PathLike | StorePath, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A local path as an absolute :class:`~pathlib.Path`, a URL as a :class:`StorePath`.

    ``file://`` URLs map to the local path (``file:///x`` and ``file://localhost/x`` are ``/x``; a URL naming
    another host is refused). A :class:`StorePath` is returned as is (its own ``storage_options`` win over
    ``storage_options``).
    """
    if isinstance(path, StorePath):
        return path
    if isinstance(path, (str, os.PathLike)) and os.fspath(path) == "":  # (an unset variable: never "here")
        raise CheckpointError(
            "an empty path names no checkpoint (an unset variable?): pass the checkpoint's path ('.' for the "
            "current directory)",
            path="",  # (the path given; the message shows it quoted)
        )
    if isinstance(path, str) and is_url(path):
        if is_file_url(path):
            return _file_url_path(path)
        return StorePath(path, storage_options)
    if isinstance(path, str) and path[:5].lower() == "file:":  # file:/x (one slash): a URL meant, not ./file:/x
        raise CheckpointError(
            "a file: URL takes two slashes before its host: file:///absolute/path (or a plain path)", path=path
        )
    return local_path(Path(path).expanduser())


def location_key(path: Any) -> str:
    """What names one location however it is spelt: a local path with its links resolved (``ckpts/c`` through
    ``ckpts -> /scratch/ckpts`` is ``/scratch/ckpts/c``), a URL (a store's path) as it is.

    Example:
        >>> location_key("s3://bucket/run/c")
        's3://bucket/run/c'
    """
    text = str(path)
    return text if "://" in text else os.path.realpath(text)


def local_path(path: str | os.PathLike) -> Path:
    """``path`` made absolute, its ``..`` steps taken as the file system takes them: ``ckpt/x/../..`` is the directory
    holding ``ckpt``, a link before a ``..`` followed first. What the library then creates (parents, a lock, staging)
    is on the path the checks saw: ``Path.mkdir(parents=True)`` of ``ckpt/x/..`` would first make ``ckpt/x``, an
    entry inside a committed checkpoint that it no longer loads with.

    Example:
        >>> str(local_path("/tmp/run/x/../../step-1"))
        '/tmp/step-1'
    """
    path = Path(path).absolute()
    parts = path.parts
    if ".." not in parts:
        return path
    last = len(parts) - 1 - parts[::-1].index("..")
    return Path(os.path.realpath(Path(*parts[: last + 1]))).joinpath(*parts[last + 1 :])


def _file_url_path(url: str) -> Path:
    """The local path of a ``file://`` URL (RFC 8089): ``file:///x`` and ``file://localhost/x`` are ``/x``.

    Another host (``file://server/x``, or ``file://run/x`` meant as a relative path) is refused: it names no
    path of this machine, and reading it as ``./server/x`` would write where nobody asked.
    """
    rest = url[len("file://") :]
    host, slash, tail = rest.partition("/")
    tail = urllib.parse.unquote(tail)  # percent-encoded, as Path.as_uri() writes it ("my%20run" is "my run")
    if host.lower() not in ("", "localhost"):
        raise CheckpointError(
            f"a file:// URL names a path on this machine: file:///absolute/path or file://localhost/absolute/path, "
            f"not host {host!r} (for a relative path, drop the file:// prefix)",
            path=url,
        )
    if not tail.strip("/"):
        raise CheckpointError("a file:// URL needs a path (e.g. file:///runs/step-1)", path=url)
    if "\x00" in tail:
        raise CheckpointError(
            "a file:// URL decodes to a path holding a NUL byte (%00): no file has that name", path=url
        )
    return local_path(slash + tail)


def copy_object(fs: Any, src: str, dst: str, *, if_match: str | None = None) -> str | None:
    """Copy one object inside a store server-side (S3 ``CopyObject``, GCS rewrite), never through this host.

    For incremental saves: an unchanged chunk file is copied from the previous
    checkpoint's prefix instead of being uploaded again (local saves hard-link it).
    ``if_match`` (an S3 ETag): copy only if the source is still that object. Returns the
    copy's ETag when the store says it (S3), else ``None``.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> fs.pipe_file("/b/a", b"x"); copy_object(fs, "/b/a", "/b/c"); fs.cat_file("/b/c")
        b'x'
    """
    try:
        if hasattr(fs, "_call_s3") and hasattr(fs, "loop"):  # s3fs: one CopyObject, without its HEAD first
            from fsspec.asyn import sync

            try:
                return _s3_copy(fs, sync, src, dst, if_match)
            except (ValueError, OSError) as err:  # e.g. over CopyObject's 5 GB: fsspec's managed copy below
                if isinstance(err, FileNotFoundError) or if_match is not None:
                    raise
        fs.cp_file(src, dst)  # (never fs.copy: it expands '*', '?' and '[' in a key into other objects)
        return None
    except FileNotFoundError:
        raise CheckpointError(f"cannot copy {src}: the object does not exist", path=dst) from None
    except OSError as err:
        raise CheckpointError(f"copying {src} failed ({type(err).__name__}: {err})", path=dst) from None


_GLOB = re.compile(r"[*?\[]")


def delete_objects(fs: Any, keys: list[str]) -> None:
    """Delete exactly the objects ``keys`` (absent ones skipped): every deletion of a store object goes here.

    fsspec's ``rm`` expands ``*``, ``?`` and ``[`` in a key as a glob, and such characters are legal in keys (a
    rotation of ``s3://b/run*``): ``rm("b/run*/step-1/x")`` also deleted ``b/run-A/step-1/x``, another run's
    object. Keys without those characters go to ``rm`` in one call (S3: batched deletes); any other key is
    deleted on its own with ``rm_file``, which never expands.

    Example:
        >>> import fsspec
        >>> fs = fsspec.filesystem("memory")
        >>> for k in ("/dx/r*/x", "/dx/r-A/x"): fs.pipe_file(k, b"1")
        >>> delete_objects(fs, ["/dx/r*/x"]); sorted(fs.find("/dx"))
        ['/dx/r-A/x']
    """
    literal = [k for k in keys if not _GLOB.search(k)]
    try:
        if literal:
            fs.rm(literal)
    except FileNotFoundError:
        pass
    for key in keys:
        if _GLOB.search(key):
            try:
                fs.rm_file(key)
            except FileNotFoundError:
                pass


def _s3_copy(fs: Any, sync: Any, src: str, dst: str, if_match: str | None) -> str | None:
    buc1, key1, _ = fs.split_path(src)
    buc2, key2, _ = fs.split_path(dst)
    condition = {} if if_match is None else {"CopySourceIfMatch": if_match}
    try:  # s3fs translates the store's errors into OSError (FileNotFoundError, PermissionError, ...)
        out = sync(
            fs.loop,
            fs._call_s3,
            "copy_object",
            Bucket=buc2,
            Key=key2,
            CopySource={"Bucket": buc1, "Key": key1},
            **condition,
        )
    finally:
        fs.invalidate_cache(dst)
    return (out.get("CopyObjectResult") or {}).get("ETag")


def supports_copy(fs: Any) -> bool:
    """Whether the fsspec file system ``fs`` copies objects itself (S3, GCS, Azure, memory), not through this host.

    Example:
        >>> import fsspec
        >>> supports_copy(fsspec.filesystem("memory"))
        True
    """
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    cls = type(fs)
    if isinstance(fs, AsyncFileSystem):
        return cls._cp_file is not AsyncFileSystem._cp_file
    return cls.cp_file is not AbstractFileSystem.cp_file


def store_error(err: BaseException, what: str, where: Any) -> CheckpointError:
    """An object-store failure as a :class:`CheckpointError` naming the object and what to check."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, FileNotFoundError):
        return CheckpointIntegrityError(f"{what}: the object does not exist (deleted meanwhile?)", path=where)
    if isinstance(err, PermissionError):
        return CheckpointError(f"{what}: access denied; check the credentials and storage_options", path=where)
    return CheckpointError(
        f"{what} failed ({type(err).__name__}: {err}); check the endpoint, credentials and storage_options",
        path=where,
    )
