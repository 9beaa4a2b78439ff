"""What a save's commit records, split so that no rank handles every rank's metadata (formats 5 and 7).

Before the commit gather each rank writes its manifest shard (its per-rank states and
inventories, its tensors' chunk table and storage entries, the records of the files only it
reads: :mod:`torchrl_dcp.format.shards`) into the staging area and pickles its part of DCP's
``.metadata`` (:func:`~torchrl_dcp.format.dcp_metadata.metadata_fragments`). Rank 0 then
receives, per rank, its file records (to check the staging area before the commit), which of
them its shard lists, what it wrote of tensors no one rank owns, its components' totals and
those pickled bytes (:class:`RankPart`), writes ``.metadata`` by concatenating them, and the
root manifest, which lists the other files and counts each rank's own.

Example:
    >>> from torchrl_dcp.commit_records import RankPart
    >>> RankPart(None, {}, [], {}, []).totals
    {}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchrl_dcp.errors import CheckpointFormatError, EncodingError
from torchrl_dcp.format.codec import dtype_from_name
from torchrl_dcp.format.dcp_metadata import metadata_fragments, spliced_metadata
from torchrl_dcp.format.layout import own_file_rank, shard_name, shard_rank
from torchrl_dcp.format.manifest import check_parse_cost, dumps, new_manifest
from torchrl_dcp.format.rank_table import RankRow, crc_value, rank_table
from torchrl_dcp.format.shards import shard_body
from torchrl_dcp.planner import is_own_key
from torchrl_dcp.storage.base import ChunkEntry, SaveTarget, WriteOutcome
from torchrl_dcp.storage.writer import build_metadata


@dataclass
class RankPart:
    """What one rank sends rank 0 at commit: its status, file records (its shard's included), the storage entries
    and chunks of the shared tensors it wrote, each per-rank component's ``(num_tensors, nbytes)`` on it, its
    pickled part of ``.metadata`` (``None``: DCP's writer wrote ``.metadata``) and which files its shard lists."""

    status: Any
    files: dict[str, dict[str, Any]]
    shared_entries: list[tuple[str, str, int, int]]
    totals: dict[str, tuple[int, int]]
    shared_chunks: list[ChunkEntry]
    fragments: tuple[bytes, bytes] | None = None
    own_files: list[str] = field(default_factory=list)  # the files its shard lists (format 7)


def chunk_record(c: ChunkEntry) -> dict[str, Any]:
    """A chunk's entry in a chunk table: rows, file, where in it, and content fingerprint."""
    return {
        "start": c.start,
        "rows": c.rows,
        "file": c.file,
        "offset": c.offset,
        "length": c.length,
        "fingerprint": c.fingerprint,
    }


def chunk_table(chunks: list[ChunkEntry]) -> dict[str, list[dict[str, Any]]]:
    """Each chunked tensor's row ranges, files, places and fingerprints, in row order."""
    table: dict[str, list[dict[str, Any]]] = {}
    for c in sorted(chunks, key=lambda c: (c.key, c.start)):
        table.setdefault(c.key, []).append(chunk_record(c))
    return dict(sorted(table.items()))


def write_rank_part(
    *,
    records: dict[str, Any],
    outcome: WriteOutcome,
    target: SaveTarget,
    rank: int,
    save_id: str,
    indexed: bool,
    checkpoint_id: Any,
) -> RankPart:
    """Write this rank's manifest shard into the staging area (when the save has per-rank components) and return
    what rank 0 needs of it. ``records``: the rank's component records; ``indexed``: our writer wrote the data
    (its storage entries are known; otherwise DCP's writer wrote ``.metadata``)."""
    per_rank = {name: rec for name, rec in records.items() if rec.placement == "per_rank"}
    files = dict(outcome.files)
    own_entries = [e for e in outcome.entries if is_own_key(e[0])]
    own_chunks = [c for c in outcome.chunks if is_own_key(c.key)]
    own_files: list[str] = []
    if per_rank:
        own_files = own_file_names(outcome, rank) if indexed else []
        body = shard_body(
            save_id=save_id,
            rank=rank,
            components={
                n: {"state": r.state, "inventory": dict(sorted(r.inventory.items()))} for n, r in per_rank.items()
            },
            chunks=chunk_table(own_chunks),
            entries=[list(e) for e in own_entries] if indexed else None,
            files={n: files[n] for n in own_files},
        )
        files[shard_name(rank)] = target.write_member(shard_name(rank), parseable(dumps(body), f"rank {rank}'s shard"))
    fragments = None
    if indexed:
        own = {
            k: (dtype_from_name(t["dtype"]), tuple(t["shape"]))
            for r in per_rank.values()
            for k, t in r.inventory.items()
        }
        fragments = metadata_fragments(build_metadata(own, own_entries, checkpoint_id, save_id, own_chunks))
    return RankPart(
        status=None,
        files=files,
        shared_entries=[e for e in outcome.entries if not is_own_key(e[0])],
        totals={n: (r.num_tensors, r.nbytes) for n, r in per_rank.items()},
        shared_chunks=[c for c in outcome.chunks if not is_own_key(c.key)],
        fragments=fragments,
        own_files=own_files,
    )


def own_file_names(outcome: WriteOutcome, rank: int) -> list[str]:
    """The files of ``outcome`` that only this rank reads: ``__<rank>_<n>.distcp`` files holding its per-rank
    tensors and nothing else (format 7: listed in its shard, not in the root)."""
    holds: dict[str, bool] = {}  # file -> every record in it is one of this rank's own tensors
    for key, file in [(e[0], e[1]) for e in outcome.entries] + [(c.key, c.file) for c in outcome.chunks]:
        holds[file] = holds.get(file, True) and is_own_key(key)
    return sorted(n for n, own in holds.items() if own and n in outcome.files and own_file_rank(n) == rank)


def metadata_bytes(
    shared: dict[str, tuple[torch.dtype, tuple[int, ...]]], parts: list[RankPart], checkpoint_id: Any, save_id: str
) -> bytes:
    """DCP's ``.metadata`` of a save by our writer (rank 0): the shared tensors' (``shared``: their dtypes and
    shapes) from every rank's entries, every rank's own part spliced in as pickled."""
    entries = [e for p in parts for e in p.shared_entries]
    chunks = [c for p in parts for c in p.shared_chunks]
    whole = build_metadata(shared, entries, checkpoint_id, save_id, chunks)
    return spliced_metadata(whole, [p.fragments for p in parts if p.fragments is not None])


def root_manifest(
    *,
    records: dict[str, Any],
    parts: list[RankPart],
    files: dict[str, Any],
    indexed: bool,
    world_size: int,
    metadata: dict[str, Any],
    step: int | None,
    save_id: str,
    sequence: int | None,
) -> bytes:
    """The sealed root manifest (rank 0): per-rank components by their totals over every rank (their states are
    in the shards), the others whole, the shared tensors' chunk table and storage entries; ``files``: every file's
    record, of which the root lists those no shard lists and are not shards (its rank table records each rank's
    shard and counts its own files)."""
    components = {}
    for name, rec in records.items():
        if rec.placement == "per_rank":
            components[name] = {
                "adapter": rec.adapter,
                "adapter_version": rec.adapter_version,
                "placement": rec.placement,
                "num_tensors": sum(p.totals[name][0] for p in parts),
                "nbytes": sum(p.totals[name][1] for p in parts),
            }
        else:
            components[name] = rec.manifest_entry()
    entries = [list(e) for p in parts for e in p.shared_entries]
    sharded = any(rec.placement == "per_rank" for rec in records.values())
    own = {n for p in parts for n in p.own_files}
    table = None
    if sharded:  # (parts in rank order, one per saved rank; each wrote its shard)
        shards = [files[shard_name(r)] for r in range(len(parts))]
        table = rank_table(
            [
                RankRow(
                    s["size"], crc_value(s["checksum"]), len(p.own_files), sum(files[n]["size"] for n in p.own_files)
                )
                for s, p in zip(shards, parts)
            ]
        )
    return parseable(
        dumps(
            new_manifest(
                world_size=world_size,
                components=components,
                files={n: r for n, r in files.items() if n not in own and shard_rank(n) is None},
                metadata=metadata,
                step=step,
                save_id=save_id,
                chunks=chunk_table([c for p in parts for c in p.shared_chunks]),
                sequence=sequence,
                sharded=sharded,
                index={"entries": entries} if indexed else None,
                rank_table=table,
            )
        ),
        "the root manifest",
    )


def parseable(data: bytes, what: str) -> bytes:
    """``data`` (a manifest's bytes about to be written), if a load will parse it: a save never writes what every
    load refuses (:func:`~torchrl_dcp.format.manifest.check_parse_cost`).

    Raises:
        EncodingError: a state holds so many tiny JSON containers that decoding the manifest could take more than
            its parse bound (say which to store as a tensor).
    """
    try:
        check_parse_cost(data, what)
    except CheckpointFormatError as err:
        raise EncodingError(
            f"{what} would be refused by every load: {err.message}; a component holds a long list of tiny JSON "
            "values or containers: store them as a tensor (torch.tensor(values))"
        ) from None
    return data
