"""Names of the files in a checkpoint, spelled once (no torch needed).

A committed checkpoint (directory or archive) holds ``manifest.json`` (written last: it
is what makes the checkpoint exist), one manifest shard per rank ``manifest-<rank>.json``
(that rank's per-rank states and where its tensors are), DCP's ``.metadata``, and the data
files of each rank that wrote tensors: ``__<rank>_0.distcp`` (its per-rank tensors),
``__<rank>_shared.distcp`` (the replicated tensors it was chosen to write: every rank reads
them, so they are kept apart from any one rank's state) and chunk files ``__<rank>_<n>.distcp``.

Example:
    >>> from torchrl_dcp.format.layout import MANIFEST, DCP_METADATA, data_file_name, shared_file_name, shard_name
    >>> MANIFEST, DCP_METADATA, data_file_name(3), shared_file_name(3), shard_name(3)
    ('manifest.json', '.metadata', '__3_0.distcp', '__3_shared.distcp', 'manifest-3.json')
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
MAX_MANIFEST_BYTES = 256 << 20  # a manifest (or .metadata) larger than this is refused before it is parsed
MAX_WORLD_SIZE = 10**9  # file and shard names spell a rank in at most 9 digits: no checkpoint holds more ranks


def data_file_name(rank: int) -> str:
    """The data file of rank ``rank``'s per-rank tensors (DCP's own writer gives its first file the same name)."""
    return f"__{rank}_0.distcp"


def shared_file_name(rank: int) -> str:
    """The data file of the replicated (shared) tensors rank ``rank`` writes (format 6): every rank reads it whole
    at load, so it holds nothing that only one rank needs."""
    return f"__{rank}_shared.distcp"


_DATA_FILE = re.compile(r"^__([0-9]{1,9})_([0-9]{1,12}|shared)\.distcp\Z")  # (\Z: "$" takes a final newline)
_SHARD = re.compile(r"^manifest-(0|[1-9][0-9]{0,8})\.json\Z")


def shard_name(rank: int) -> str:
    """The manifest shard of rank ``rank`` (format 5): its per-rank states, inventories and storage entries."""
    return f"manifest-{rank}.json"


def shard_rank(name: str) -> int | None:
    """The rank whose manifest shard ``name`` is (``None``: not a shard name).

    Example:
        >>> shard_rank("manifest-12.json"), shard_rank("manifest-012.json"), shard_rank("__0_0.distcp")
        (12, None, None)
    """
    m = _SHARD.match(name)
    return None if m is None else int(m.group(1))


def is_data_file(name: str) -> bool:
    """A data, shared or chunk file (``__<rank>_<n>.distcp``, ``__<rank>_shared.distcp``): what ends with a save's
    identity trailer.

    Example:
        >>> [is_data_file(n) for n in ("__0_0.distcp", "__2_shared.distcp", "__2_other.distcp", "manifest.json")]
        [True, True, False, False]
    """
    return _DATA_FILE.match(name) is not None


#: what a component may be named (its name is a segment of DCP keys, of paths in exports and of CLI output)
COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")


def is_component_name(name: object) -> bool:
    """Whether ``name`` is a component name a save accepts (:data:`COMPONENT_NAME`, no ``..``): a manifest naming
    another was not written by a save.

    Example:
        >>> [is_component_name(n) for n in ("policy", "replay_buffer.0", "a/b", "..", "x..y", "")]
        [True, True, False, False, False, False]
    """
    return isinstance(name, str) and COMPONENT_NAME.fullmatch(name) is not None and ".." not in name


def is_library_file(name: str) -> bool:
    """Whether ``name`` is a file name this library writes into a checkpoint (data and chunk files, DCP's
    metadata, the manifest and its shards): what a sweep of a killed save's leftovers may delete.

    Example:
        >>> [is_library_file(n) for n in ("__0_0.distcp", "__3_12.distcp", ".metadata", "manifest-1.json", "a.csv")]
        [True, True, True, True, False]
    """
    return name in (MANIFEST, DCP_METADATA) or _DATA_FILE.match(name) is not None or _SHARD.match(name) is not None


def own_file_rank(name: str) -> int | None:
    """The writing rank of a file that may be one rank's own (format 7: listed in that rank's manifest shard, not
    in the root): a data or chunk file ``__<rank>_<n>.distcp``; ``None`` for any other name (shared files too).

    Example:
        >>> own_file_rank("__3_0.distcp"), own_file_rank("__3_12.distcp"), own_file_rank("__3_shared.distcp")
        (3, 3, None)
    """
    m = _DATA_FILE.match(name)
    return None if m is None or not m.group(2).isdigit() else int(m.group(1))


def data_file_rank(name: str) -> int | None:
    """The rank a data, shared or chunk file's name says wrote it (``__<rank>_<n>.distcp``,
    ``__<rank>_shared.distcp``): what its identity trailer names, unless an incremental save kept it from an
    earlier save (written there by whichever rank wrote that chunk); ``None`` for any other name.

    Example:
        >>> data_file_rank("__3_0.distcp"), data_file_rank("__3_shared.distcp"), data_file_rank(".metadata")
        (3, 3, None)
    """
    m = _DATA_FILE.match(name)
    return None if m is None else int(m.group(1))


def is_chunk_file(name: str) -> bool:
    """A chunk file (``__<rank>_<n>.distcp``, ``n >= 1``): one an incremental save may have kept from another save."""
    m = _DATA_FILE.match(name)
    return m is not None and m.group(2).isdigit() and int(m.group(2)) >= 1


def is_plain_name(name: str) -> bool:
    """A file name that stays inside its checkpoint and that every file system and object store can name: no
    separator, no ``..``, no control character (NUL, newline), no lone surrogate (not encodable: ``os.open`` failed
    with a bare ``UnicodeEncodeError`` naming no file).

    Example:
        >>> is_plain_name("__0_0.distcp"), is_plain_name("../x"), is_plain_name("\\ud800.distcp")
        (True, False, False)
    """
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..")
        and not any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in name)
    )


# ---------------------------------------------------------------------- save identity
TRAILER_SIZE = 64
_TRAILER_HEAD, _TRAILER_TAIL = b"TDCP.SID", b"TDCP.END"


def identity_trailer(save_id: str, rank: int) -> bytes:
    """The 64 bytes at the end of every data file: which save (and rank) wrote it.

    DCP never reads them (its metadata addresses each record by offset and length), so
    a plain ``dcp.load`` is unaffected; a reader refuses a data file whose trailer names
    another save, e.g. one copied in from another checkpoint with its manifest entry.

    Example:
        >>> t = identity_trailer("0" * 32, 1)
        >>> len(t), read_identity(t)
        (64, ('00000000000000000000000000000000', 1))
    """
    body = _TRAILER_HEAD + save_id.encode("ascii") + rank.to_bytes(8, "little")
    return body + b"\0" * (TRAILER_SIZE - len(body) - len(_TRAILER_TAIL)) + _TRAILER_TAIL


def read_identity(trailer: bytes) -> tuple[str, int] | None:
    """``(save_id, rank)`` from the last 64 bytes of a data file, or ``None`` when they are not a trailer."""
    if len(trailer) != TRAILER_SIZE or not trailer.startswith(_TRAILER_HEAD) or not trailer.endswith(_TRAILER_TAIL):
        return None
    try:
        save_id = trailer[8:40].decode("ascii")
    except UnicodeDecodeError:
        return None
    return save_id, int.from_bytes(trailer[40:48], "little")
