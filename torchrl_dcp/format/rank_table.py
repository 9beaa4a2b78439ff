"""The root manifest's per-rank table (format 8): each saved rank's shard record and own-file counts, packed.

What the root must say of every rank, whatever the rank saved: the size and CRC-32 of its shard
``manifest-<r>.json`` and how many files of how many bytes that shard lists (its own data and chunk
files). Format 7 spelled it as one ``files`` record and one ``rank_files`` pair per rank (~77 bytes of
JSON, ~500 bytes of Python objects once parsed, on every rank of a load); format 8 packs it in one
string, fixed-width rows of little-endian integers in base64, which a parse keeps as that one string
and a reader decodes a row of where it needs it (:func:`shard_record`, :func:`own_files`)::

    "rank_table": {"shard_version": 7, "rows": "<base64>"}
    row r (24 bytes, 32 characters):  shard size u64 | shard CRC-32 u32 | own files u32 | own bytes u64

``shard_version`` is the version its shards are written in: 7 (they list their rank's own files) or 5 (a
checkpoint saved in format 5 or 6, whose root lists every file: the counts are 0). A root without
per-rank components has ``"rank_table": null``.

Example:
    >>> table = rank_table([RankRow(100, 0xDEADBEEF, 2, 4096), RankRow(90, 1, 1, 10)])
    >>> table["rows"][:32], len(table["rows"])
    ('ZAAAAAAAAADvvq3eAgAAAAAQAAAAAAAA', 64)
    >>> root = {"rank_table": table, "world_size": 2}
    >>> shard_record(root, 0), own_files(root, 1), shard_record(root, 2)
    ({'size': 100, 'checksum': 'crc32:deadbeef'}, (1, 10), None)
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from torchrl_dcp.errors import CheckpointFormatError
from torchrl_dcp.format.layout import shard_name, shard_rank

ROW = struct.Struct("<QIIQ")
ROW_CHARS = ROW.size * 4 // 3  # 24 bytes: 32 base64 characters, no padding (a row decodes on its own)
SHARD_VERSIONS = (5, 7)
_CRC = re.compile(r"crc32:([0-9a-f]{8})\Z")


class RankRow(NamedTuple):
    """One rank's row: its shard's size and CRC-32, and the count and bytes of the files its shard lists."""

    shard_size: int
    shard_crc: int
    own_files: int
    own_bytes: int


def rank_table(rows: Sequence[RankRow], shard_version: int = 7) -> dict[str, Any]:
    """The root's ``rank_table`` for ``rows`` (one per saved rank, in rank order)."""
    return {"shard_version": shard_version, "rows": base64.b64encode(b"".join(ROW.pack(*r) for r in rows)).decode()}


def crc_of(checksum: str) -> int | None:
    """The CRC-32 of a file record's ``checksum`` (``"crc32:<8 hex digits>"``); ``None`` for any other spelling."""
    m = _CRC.match(checksum) if isinstance(checksum, str) else None
    return None if m is None else int(m.group(1), 16)


def crc_value(checksum: str) -> int:
    """:func:`crc_of` for a shard record a writer made (every target records a CRC-32): anything else is an error."""
    crc = crc_of(checksum)
    if crc is None:
        raise ValueError(f"a shard's checksum is {checksum!r}, not a CRC-32 (crc32:<8 hex digits>)")
    return crc


def _row(root: Mapping[str, Any], rank: int) -> RankRow | None:
    table = root.get("rank_table")
    if table is None or not 0 <= rank < root["world_size"]:
        return None
    return RankRow(*ROW.unpack(base64.b64decode(table["rows"][rank * ROW_CHARS : (rank + 1) * ROW_CHARS])))


def shard_record(root: Mapping[str, Any], rank: int) -> dict[str, Any] | None:
    """The ``files`` record (size, checksum) of rank ``rank``'s shard; ``None`` where the root has none."""
    row = _row(root, rank)
    return None if row is None else {"size": row.shard_size, "checksum": f"crc32:{row.shard_crc:08x}"}


def own_files(root: Mapping[str, Any], rank: int) -> tuple[int, int]:
    """How many files of how many bytes rank ``rank``'s shard lists (``(0, 0)``: shards of version 5 list none)."""
    row = _row(root, rank)
    return (0, 0) if row is None else (row.own_files, row.own_bytes)


def shard_version(root: Mapping[str, Any]) -> int | None:
    """The version of the root's shards (``None``: it has none)."""
    table = root.get("rank_table")
    return None if table is None else table["shard_version"]


def counted_own_files(root: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    """Per saved rank, the count and bytes of the files its shard lists (one decode of the whole table: rank 0's
    listing check); ``None`` where the shards list none (version 5: the root lists every file) or there are none."""
    return [(r.own_files, r.own_bytes) for r in rows(root)] if shard_version(root) == 7 else None


def rows(root: Mapping[str, Any]) -> list[RankRow]:
    """Every rank's row (one decode of the whole table: for rank 0's listing check and the tools)."""
    table = root.get("rank_table")
    return [] if table is None else [RankRow(*r) for r in ROW.iter_unpack(base64.b64decode(table["rows"]))]


class ShardRecords(Mapping[str, dict[str, Any]]):
    """The shards' ``files`` records of a root, by name, decoded on lookup (nothing is built until asked):
    what a container lists beside the root's ``files``."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self._root = root
        self._n = root["world_size"] if root.get("rank_table") is not None else 0

    def __getitem__(self, name: str) -> dict[str, Any]:
        rank = shard_rank(name) if isinstance(name, str) else None
        rec = None if rank is None else shard_record(self._root, rank)
        if rec is None:
            raise KeyError(name)
        return rec

    def __contains__(self, name: object) -> bool:
        rank = shard_rank(name) if isinstance(name, str) else None
        return rank is not None and rank < self._n

    def __iter__(self) -> Iterator[str]:
        return (shard_name(r) for r in range(self._n))

    def __len__(self) -> int:
        return self._n


def validate_rank_table(m: Mapping[str, Any], bad: Callable[[str], CheckpointFormatError]) -> None:
    """``rank_table``: ``null`` exactly when the root has no per-rank components, else a known shard version and one
    row per saved rank, in strict base64; the root's ``files`` list no shard (the table records them)."""
    if "rank_table" not in m:
        raise bad("rank_table is missing")
    table = m["rank_table"]
    if any(shard_rank(name) is not None for name in m["files"]):
        raise bad("files may not list the shards: the rank table records them")
    if table is None:
        if m["sharded"]:
            raise bad("a sharded manifest needs a rank table (one row per saved rank)")
        return
    if not m["sharded"] or not isinstance(table, dict) or set(table) != {"shard_version", "rows"}:
        raise bad("rank_table must be null, or (a sharded manifest) {shard_version, rows}")
    if type(table["shard_version"]) is not int or table["shard_version"] not in SHARD_VERSIONS:
        raise bad(f"rank_table.shard_version must be one of {list(SHARD_VERSIONS)}")
    text = table["rows"]
    if type(text) is not str or len(text) != m["world_size"] * ROW_CHARS:
        shown = len(text) if type(text) is str else type(text).__name__
        raise bad(
            f"rank_table must record one shard per saved rank: {ROW_CHARS} base64 characters each (world_size "
            f"{m['world_size']}, rows of {shown} characters)"
        )
    try:
        packed = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad("rank_table.rows is not base64") from None
    if len(packed) != m["world_size"] * ROW.size:  # (padding inside: rows would not decode one by one; without it,
        raise bad("rank_table.rows is not one row per saved rank")  # 4 characters spell 3 bytes one way only)
    if table["shard_version"] == 5 and any(r[2] or r[3] for r in ROW.iter_unpack(packed)):
        raise bad("rank_table: shards of version 5 list no files, yet a row counts some")
