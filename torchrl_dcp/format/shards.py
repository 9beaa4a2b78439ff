"""Manifest shards (format 5, files since format 7): each rank's part of the manifest in a file of its own.

The root ``manifest.json`` holds what every rank needs: the components (adapter, version,
placement, totals; the state and inventory of replicated and sharded ones), the size and
checksum of every file more than one rank reads (shared data files, their chunk files, the
shards, ``.metadata``), the chunk table and storage entries of the tensors that are not any one
rank's (``index``), and per rank the number and bytes of the files its shard lists
(``rank_table``). When the save held per-rank components (``"sharded": true``), each rank
``r`` wrote ``manifest-<r>.json`` (its size and CRC-32 in the root's ``rank_table``, checked like
any file's) with its per-rank states and inventories, its tensors' chunk table and storage
entries, and the records of its own files (``__<r>_<n>.distcp`` holding only its per-rank
tensors)::

    {"format": "torchrl_dcp.shard", "format_version": 7, "save_id": ..., "rank": r,
     "components": {name: {"state": <skeleton>, "inventory": {key: {"dtype", "shape"}}}},
     "chunks": {key: [{"start", "rows", "file", "offset", "length", "fingerprint"}]},
     "entries": [[key, file, offset, length], ...],
     "files": {name: {"size", "checksum", "origin"?}}}

Shards of format 5 and 6 checkpoints (``rank_table.shard_version`` 5 once migrated) are version 5:
no ``files``, the root lists every file. The shards of format 7 and 8 are the same (version 7).

A load reads the root and the shards of the ranks it restores; ``verify``, ``inspect`` and
the tools read them all. Either way the result has the shape every reader knows
(:func:`assemble`): per-rank components with ``ranks`` and ``inventory``, one ``chunks``
table, one ``index``, the ``files`` of the root, the records of the shards read and the files they list;
``shards_read`` says
which ranks' shards it holds (``None``: the checkpoint has none, everything was in the root).
``entries`` and ``index`` are ``null`` when DCP's own writer wrote the data (then
``.metadata`` alone says where tensors are).

Example:
    >>> from torchrl_dcp.format.shards import assemble, split
    >>> full = {"world_size": 2, "save_id": "0" * 32, "sharded": True, "files": {}, "chunks": {}, "format_version": 8,
    ...         "index": {"entries": []}, "components": {"b": {"adapter": "a", "adapter_version": 1,
    ...         "placement": "per_rank", "num_tensors": 0, "nbytes": 0, "inventory": {},
    ...         "ranks": {"0": {"state": 1}, "1": {"state": 2}}}}}
    >>> root, shards = split(full)
    >>> "ranks" in root["components"]["b"], sorted(shards), shards[1]["components"]["b"]["state"]
    (False, [0, 1], 2)
    >>> assemble(root, {1: shards[1]}, "m")["components"]["b"]["ranks"]
    {'1': {'state': 2}}
"""

from __future__ import annotations

import copy
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.format import rank_table
from torchrl_dcp.format.layout import own_file_rank, shard_name
from torchrl_dcp.format.manifest import (
    FORMAT_VERSION,
    check_entries,
    decode_json,
    validate_chunk_table,
    validate_file_record,
)
from torchrl_dcp.placement import key_prefix

SHARD_FORMAT = "torchrl_dcp.shard"
SHARD_VERSION = 7
#: the shards of a format 5 or 6 checkpoint (its root lists every file; they list none)
FILELESS_SHARD_VERSION = 5


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def per_rank_names(root: Mapping[str, Any]) -> list[str]:
    """The per-rank components of a manifest, sorted."""
    return sorted(n for n, rec in root["components"].items() if rec.get("placement") == "per_rank")


def shard_body(
    *,
    save_id: str,
    rank: int,
    components: Mapping[str, Mapping[str, Any]],
    chunks: Mapping[str, list[dict[str, Any]]],
    entries: list[list[Any]] | None,
    files: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """One rank's shard: ``components`` maps each per-rank component to ``{"state", "inventory"}``; ``files``: the
    records of the files only this rank reads (``None``: a shard of format 5, whose root lists every file)."""
    body = {
        "format": SHARD_FORMAT,
        "format_version": SHARD_VERSION if files is not None else FILELESS_SHARD_VERSION,
        "save_id": save_id,
        "rank": rank,
        "components": dict(components),
        "chunks": dict(chunks),
        "entries": entries,
    }
    if files is not None:
        body["files"] = {n: dict(r) for n, r in sorted(files.items())}
    return body


def parse_shard(data: bytes, root: Mapping[str, Any], rank: int, source: Any) -> dict[str, Any]:
    """A shard's bytes decoded and checked against its root (save, rank, components, files, keys).

    The caller checked the bytes against the root's size and checksum. Raises
    :class:`~torchrl_dcp.errors.CheckpointFormatError` naming ``source``.
    """
    return check_shard(decode_json(data, source, "manifest shard"), root, rank, source)


def check_shard(raw: Any, root: Mapping[str, Any], rank: int, source: Any) -> dict[str, Any]:
    """Validate a decoded shard against its root: it must be this save's, this rank's, hold exactly the root's
    per-rank components, name only listed files, and place only its own tensors."""

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"malformed manifest shard: {what}", path=source)

    version = rank_table.shard_version(root)
    if (
        not isinstance(raw, dict)
        or raw.get("format") != SHARD_FORMAT
        or not _is_int(raw.get("format_version"))
        or raw["format_version"] != version
    ):
        raise bad(f"not a {SHARD_FORMAT} v{version} object")
    if raw.get("save_id") != root.get("save_id") or not _is_int(raw.get("rank")) or raw["rank"] != rank:
        raise CheckpointIntegrityError(
            f"manifest shard belongs to save {raw.get('save_id')!r} rank {raw.get('rank')!r}, the manifest expects "
            f"save {root.get('save_id')!r} rank {rank}: a shard of another save or rank was copied in; refused",
            path=source,
        )
    components = raw.get("components")
    if not isinstance(components, dict) or sorted(components) != per_rank_names(root):
        raise bad(f"components must be the manifest's per-rank components {per_rank_names(root)}")
    own: set[str] = set()
    for name, part in components.items():
        if not isinstance(part, dict) or set(part) != {"state", "inventory"} or not isinstance(part["inventory"], dict):
            raise bad(f"components[{name!r}] must hold exactly a state and an inventory")
        own.update(part["inventory"])
    entries = raw.get("entries")
    if (entries is None) != (root.get("index") is None):
        raise bad("entries must be a list exactly when the manifest has an index")
    if version != SHARD_VERSION and "files" in raw:  # (assembled into what the tools read: never unchecked)
        raise bad(f"a v{version} shard lists no files (the root lists every file of a format 5 or 6 checkpoint)")
    files = (
        root["files"] if version != SHARD_VERSION else ChainMap(_own_files(raw, root, rank, source, bad), root["files"])
    )
    check_entries([] if entries is None else entries, files, own, bad)  # (0 or false: no list)
    chunks = raw.get("chunks")
    if not isinstance(chunks, dict) or not all(k in own for k in chunks):
        raise bad("chunks may only name this rank's tensors")
    validate_chunk_table(chunks, files, bad)  # in the root's files or its own (never another rank's own files)
    return raw


def _own_files(
    raw: dict[str, Any], root: Mapping[str, Any], rank: int, source: Any, bad: Callable[[str], CheckpointFormatError]
) -> dict[str, Any]:
    """A format-7 shard's ``files``: records of this rank's data and chunk files that the root does not list, as
    many and as large as the root's ``rank_table`` says."""
    files = raw.get("files")
    if not isinstance(files, dict):
        raise bad("files must be an object")
    for name, rec in files.items():
        validate_file_record(name, rec, bad, root.get("save_id"))
        if own_file_rank(name) != rank or name in root["files"]:
            raise bad(f"files may only list this rank's own data and chunk files (__{rank}_<n>.distcp), not {name!r}")
    count, nbytes = rank_table.own_files(root, rank)
    total = sum(r["size"] for r in files.values())
    if (len(files), total) != (count, nbytes):
        raise CheckpointIntegrityError(
            f"manifest shard lists {len(files)} files of {total} bytes, the manifest says {count} of {nbytes}: "
            "damaged or altered",
            path=source,
        )
    return files


def assemble(root: Mapping[str, Any], shards: Mapping[int, Mapping[str, Any]], source: Any) -> dict[str, Any]:
    """The manifest in the shape readers use, from a root and the (checked) shards of some ranks.

    Per-rank components get ``ranks`` (the shards' states) and ``inventory``; ``chunks`` and
    ``index`` gain the shards' tables; ``shards_read`` lists the ranks included. A root
    without shards comes back as it is, ``shards_read`` ``None``.
    """
    if not root.get("sharded"):
        return {**root, "shards_read": None}
    out = {k: v for k, v in root.items() if k not in ("components", "chunks", "index", "files")}
    files = dict(root["files"])
    for r in sorted(shards):
        record = rank_table.shard_record(root, r)
        if record is not None:  # (a root of format 7 or older, unmigrated, lists its shards in files)
            files[shard_name(r)] = record
        files.update(shards[r].get("files") or {})
    out["files"] = files
    out["components"] = components = {}
    for name, rec in root["components"].items():
        if rec["placement"] != "per_rank":
            components[name] = rec
            continue
        inventory: dict[str, Any] = {}
        ranks = {}
        for r in sorted(shards):
            part = shards[r]["components"][name]
            ranks[str(r)] = {"state": part["state"]}
            inventory.update(part["inventory"])
        components[name] = {**rec, "ranks": ranks, "inventory": dict(sorted(inventory.items()))}
    chunks = dict(root["chunks"])
    for r in sorted(shards):
        chunks.update(shards[r]["chunks"])
    out["chunks"] = dict(sorted(chunks.items()))
    index = root.get("index")
    if index is not None:
        entries = list(index["entries"])
        for r in sorted(shards):
            entries.extend(shards[r]["entries"])
        index = {"entries": entries}
    out["index"] = index
    out["shards_read"] = sorted(shards)
    return out


def split(manifest: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The root and the shards (``{rank: shard}``) of a whole assembled manifest: the inverse of :func:`assemble`,
    what a tool that rewrites a checkpoint writes back (resealing the root, each shard's record in its rank table:
    :func:`record_shards`).
    A manifest without per-rank components has no shards."""
    m = copy.deepcopy(dict(manifest))
    m.pop("shards_read", None)
    names = per_rank_names(m)
    m["sharded"] = bool(names)
    if not names:
        return m, {}
    shards: dict[int, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    for r in range(m["world_size"]):
        parts = {}
        for name in names:
            rec = m["components"][name]
            if str(r) not in rec["ranks"]:
                continue  # (a manifest claiming ranks it holds no state of: such a shard is incomplete)
            prefix = key_prefix("per_rank", name, r) + "/"
            inventory = {k: v for k, v in rec["inventory"].items() if k.startswith(prefix)}
            owner.update(dict.fromkeys(inventory, r))
            parts[name] = {"state": rec["ranks"][str(r)]["state"], "inventory": inventory}
        shards[r] = {"components": parts, "chunks": {}, "entries": None if m.get("index") is None else []}
    for name in names:
        for field in ("ranks", "inventory"):
            m["components"][name].pop(field, None)
    chunks = {}
    for key, entries in m["chunks"].items():
        if key in owner:
            shards[owner[key]]["chunks"][key] = entries
        else:
            chunks[key] = entries
    m["chunks"] = chunks
    if m.get("index") is not None:
        shared = []
        for e in m["index"]["entries"]:
            if e[0] in owner:
                shards[owner[e[0]]]["entries"].append(e)
            else:
                shared.append(e)
        m["index"] = {"entries": shared}
    version = m.get("format_version", FORMAT_VERSION)
    with_files = version >= 7
    if with_files:
        _move_own_files(m, shards)
    out = {
        r: shard_body(
            save_id=m["save_id"],
            rank=r,
            components=s["components"],
            chunks=s["chunks"],
            entries=s["entries"],
            files=s["files"] if with_files else None,
        )
        for r, s in shards.items()
    }
    _leave_shard_records(m, out, version)
    return m, out  # (the caller records the bytes of the shards it writes: record_shards)


def _leave_shard_records(m: dict[str, Any], shards: Mapping[int, Any], version: int) -> None:
    """Where a root of ``version`` records its shards: its rank table (format 8), else a placeholder in ``files``."""
    if version >= 8:
        _pack_rank_table(m)
        return
    for r in shards:
        m["files"].setdefault(shard_name(r), {"size": 0, "checksum": ""})


def record_shards(root: dict[str, Any], records: Mapping[int, Mapping[str, Any]]) -> None:
    """Record the size and checksum (``{"size", "checksum": "crc32:..."}``) of the shards written for ``root`` (as
    :func:`split` gave it): in its ``rank_table`` (format 8), else in its ``files``."""
    if root.get("format_version", FORMAT_VERSION) < 8:
        root["files"].update({shard_name(r): dict(rec) for r, rec in records.items()})
        return
    if not records:
        return
    rows = rank_table.rows(root)
    for r, rec in records.items():
        rows[r] = rows[r]._replace(shard_size=rec["size"], shard_crc=rank_table.crc_value(rec["checksum"]))
    root["rank_table"] = rank_table.rank_table(rows, rank_table.shard_version(root) or SHARD_VERSION)


def _pack_rank_table(m: dict[str, Any]) -> None:
    """Format 8: the shards' records (popped from ``files``) and the own files' counts (``rank_files``, as
    :func:`_move_own_files` left them) in one ``rank_table``."""
    counted = m.pop("rank_files", None)
    rows = []
    for r in range(m["world_size"]):
        rec = m["files"].pop(shard_name(r), None)  # (a shard not read: recorded by the caller, record_shards)
        size, crc = (rec["size"], rank_table.crc_value(rec["checksum"])) if rec else (0, 0)
        own = counted[r] if counted else (0, 0)
        rows.append(rank_table.RankRow(size, crc, *own))
    m["rank_table"] = rank_table.rank_table(rows, SHARD_VERSION if counted is not None else FILELESS_SHARD_VERSION)


def _move_own_files(m: dict[str, Any], shards: dict[int, dict[str, Any]]) -> None:
    """Format 7: each rank's own files move from the root's ``files`` to its shard's, counted in ``rank_files``."""
    m["rank_files"] = [[0, 0] for _ in range(m["world_size"])]
    for r, listed in _own_file_names(m, shards).items():
        shards[r]["files"] = {n: m["files"].pop(n) for n in listed}
        m["rank_files"][r] = [len(listed), sum(shards[r]["files"][n]["size"] for n in listed)]


def _own_file_names(m: Mapping[str, Any], shards: Mapping[int, Mapping[str, Any]]) -> dict[int, list[str]]:
    """Each rank's own files (format 7): the listed ``__<r>_<n>.distcp`` files its shard's entries and chunks name
    and nothing else does (what a save lists in the rank's shard)."""

    def named(entries: Any, chunks: Mapping[str, Any]) -> set[str]:  # (a forged manifest may hold anything)
        files = [e[1] for e in entries or [] if isinstance(e, list) and len(e) > 1]
        files += [
            c.get("file") for parts in chunks.values() if isinstance(parts, list) for c in parts if isinstance(c, dict)
        ]
        return {f for f in files if isinstance(f, str)}

    by_rank = {r: named(s["entries"], s["chunks"]) for r, s in shards.items()}
    index = m.get("index")
    elsewhere = named(None if index is None else index["entries"], m["chunks"])
    readers: dict[str, int] = {}
    for names in by_rank.values():
        for n in names:
            readers[n] = readers.get(n, 0) + 1
    return {
        r: sorted(
            n for n in names if own_file_rank(n) == r and n in m["files"] and n not in elsewhere and readers[n] == 1
        )
        for r, names in by_rank.items()
    }
