"""Incremental saves: keep the chunk files of an earlier checkpoint whose rows are proven unchanged.

``save(path, incremental_from=BASE)`` plans the save as usual (large tensors cut into
chunk files, :mod:`torchrl_dcp.chunking`), then each rank looks at the chunks it writes:
a chunk is **kept** (the base's file hard-linked into the new checkpoint, see
:mod:`torchrl_dcp.storage.chunk_writer`) when BASE holds a chunk of the same key, rows,
dtype and row shape, and its rows are proven unchanged:

- exactly, from what the replay buffer's storage recorded of its writes since BASE
  committed (:mod:`torchrl_dcp.tracking`), when BASE is the last save that storage took
  part in; otherwise
- by content: the live rows' CRC-32 and Adler-32 (64 bits) equal the fingerprint BASE
  recorded for that chunk.

Everything else is written as in a full save. The new checkpoint is complete: its
manifest lists every file (kept ones with the ``origin`` save whose identity trailer
they carry), DCP's metadata maps every chunk, and nothing refers to BASE any more.

Example:
    >>> import tempfile, torch
    >>> import torchrl_dcp as tdcp
    >>> state = {"table": torch.zeros(1 << 16, 64)}  # 16 MiB: cut into chunks
    >>> ckpt = tdcp.DistributedCheckpoint(state=state)
    >>> d = tempfile.mkdtemp()
    >>> base = ckpt.save(d + "/a")
    >>> state["table"][0] = 1.0  # only the first chunk changes
    >>> ckpt.save(d + "/b", incremental_from=base).name
    'b'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrl_dcp import _dist
from torchrl_dcp._log import get_logger
from torchrl_dcp.collective import scatter_step
from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.checksums import content_fingerprint
from torchrl_dcp.format.record import tensor_bytes
from torchrl_dcp.planner import ChunkPlan, WritePlan, is_own_key
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.storage.base import Location
from torchrl_dcp.storage.chunk_writer import KeptChunk
from torchrl_dcp.storage.copying import default_threads, run_split
from torchrl_dcp.storage.urls import location_key

logger = get_logger(__name__)


def epoch_of(save_id: str, where: Any) -> str:
    """What names a committed save to the row trackers (:mod:`torchrl_dcp.tracking`): its id and where it was
    committed (:func:`~torchrl_dcp.storage.urls.location_key`). A base is kept on the trackers' word only where both
    are the base's: another checkpoint whose manifest claims that id (forged, or a copy moved elsewhere) is compared
    by content instead.

    Example:
        >>> epoch_of("abc", "s3://bucket/run/step-1")
        'abc s3://bucket/run/step-1'
    """
    return f"{save_id} {location_key(where)}"


@dataclass
class Base:
    """What an incremental save needs of its base checkpoint (read by rank 0; each rank receives its :meth:`part`)."""

    location: Location  # a directory, or a prefix: its kept objects are copied server-side
    save_id: str
    world_size: int
    chunks: dict[str, dict[tuple[int, int], KeptChunk]] = field(default_factory=dict)
    inventory: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # the saves whose identity trailers the chunk files of the whole base carry (every rank's): what a save keeping
    # them copies in (an object store's pending marker names them, so a sweep can prove those copies)
    origins: frozenset[str] = frozenset()

    def part(self, rank: int) -> Base:
        """What ``rank`` can keep: the shared keys and its own (``rank/<rank>/...``), not the other ranks'."""
        own = f"rank/{rank}/"

        def wanted(key: str) -> bool:
            return not is_own_key(key) or key.startswith(own)

        return Base(
            self.location,
            self.save_id,
            self.world_size,
            {k: v for k, v in self.chunks.items() if wanted(k)},
            {k: v for k, v in self.inventory.items() if wanted(k)},
            self.origins,
        )


def read_base(location: Location, world_size: int) -> Base | None:
    """The base at ``location``, or ``None`` when nothing of it can be kept (said in the log).

    Raises:
        CheckpointError: it is not a committed checkpoint (or its manifest is damaged).
    """
    path = location.path
    try:
        manifest = location.manifest()  # (an archive's too: a file that is no checkpoint is refused, not ignored)
    except CheckpointError as err:  # (its kind, and the file it names: the base's damaged manifest shard, ...)
        where = "" if err.path is not None and str(err.path) == str(path) else f" (base {path})"
        err.reword(
            f"incremental_from{where}: {err.message}; pass a committed checkpoint directory (or prefix), or "
            "incremental_from=None"
        )
        if err.path is None:
            err.path = str(path)
            err.reword(err.message)
        raise err from None
    if not location.can_be_base:
        logger.info("incremental base %s is an %s: chunk files cannot be kept; saving in full", path, location.kind)
        return None
    save_id = manifest.get("save_id")
    if save_id is None:
        logger.info("incremental base %s predates save identities (format < 3); saving in full", path)
        return None
    if manifest["world_size"] != world_size:
        logger.info(
            "incremental base %s was saved by %d ranks, this job has %d: saving in full",
            path,
            manifest["world_size"],
            world_size,
        )
        return None
    base = Base(location, save_id, manifest["world_size"])
    for comp in manifest["components"].values():
        for key, t in comp["inventory"].items():
            base.inventory[key] = (f"torch.{t['dtype']}", tuple(t["shape"]))
    for key, entries in manifest["chunks"].items():
        table = base.chunks.setdefault(key, {})
        for e in entries:
            rec = manifest["files"][e["file"]]
            origin = rec.get("origin", save_id)
            table[(e["start"], e["rows"])] = KeptChunk(
                path / e["file"], rec["size"], rec["checksum"], origin, e["fingerprint"], key, e["start"], e["rows"]
            )
    base.origins = frozenset(k.origin for table in base.chunks.values() for k in table.values())
    return base


def share_base(group: Any, request: Any, rank: int, before: Callable[[], None] | None = None) -> Base | None:
    """Rank 0 reads the base (:func:`read_base`), every rank receives its part of it (collective; the same error
    everywhere). A rank receives the shared keys' chunks and its own, not every rank's. ``before``: what rank 0 does
    first, before any rank can prove the base's files (e.g. the destination's
    :meth:`~torchrl_dcp.storage.base.Location.sweep_before_save`)."""
    if request is None:
        return None
    size = _dist.group_size(group)

    def parts() -> list[Base | None]:
        if before is not None:
            before()
        base = read_base(request, size)
        return [None if base is None else base.part(r) for r in range(size)]

    return scatter_step(group, "reading the incremental base", parts, rank=rank)


def plan_keeps(
    base: Base | None, plan: WritePlan, flat: dict[str, torch.Tensor], changes: dict[str, Any], rank: int
) -> dict[str, KeptChunk]:
    """The chunk files of this rank's share that can be kept from ``base``, by new file name."""
    if base is None or plan.backend != "fast":
        return {}
    candidates: list[tuple[ChunkPlan, KeptChunk]] = []
    for c in plan.chunk_share(rank):
        kept = base.chunks.get(c.key, {}).get((c.start, c.rows))
        saved = base.inventory.get(c.key)
        info = plan.tensors[c.key]
        if kept is None or saved is None or saved[0] != info.dtype or saved[1][1:] != tuple(info.shape[1:]):
            continue
        candidates.append((c, kept))
    keeps: dict[str, KeptChunk] = {}
    by_content: list[tuple[ChunkPlan, KeptChunk]] = []
    epoch = epoch_of(base.save_id, base.location.path)  # (the trackers' word holds for that save, committed there)
    for c, kept in candidates:
        snap = changes.get(c.key)
        if snap is not None and snap.unchanged(epoch, c.key, c.start, c.rows):
            keeps[c.file] = kept
        else:
            by_content.append((c, kept))
    keeps.update(_same_content(by_content, flat))
    rows = {c.file: flat[c.key].detach().narrow(0, c.start, c.rows) for c, _ in candidates if c.file in keeps}
    return base.location.keepable(keeps, rows)


def _same_content(pairs: list[tuple[ChunkPlan, KeptChunk]], flat: dict[str, torch.Tensor]) -> dict[str, KeptChunk]:
    """The chunks whose live rows have the fingerprint recorded in the base (computed in threads)."""
    same: dict[str, KeptChunk] = {}

    def work(part: list[tuple[ChunkPlan, KeptChunk]]) -> None:
        for c, kept in part:
            rows = flat[c.key].detach().narrow(0, c.start, c.rows)
            if content_fingerprint(tensor_bytes(rows))[0] == kept.fingerprint:
                same[c.file] = kept

    if pairs:
        run_split(pairs, [c.rows for c, _ in pairs], max(1, min(default_threads(), len(pairs))), work)
    return same


def incremental_base(incremental_from: Any, destination: Location, storage_options: Any) -> Location | None:
    """The base of an incremental save: a checkpoint whose chunk files the destination can keep (local files:
    hard links; an object store: server-side copies within it); ``None`` otherwise (a full save, said in the log)."""
    if incremental_from is None:
        return None
    base = location_for(incremental_from, storage_options)
    if not destination.is_local and str(base.path).rstrip("/") == str(destination.path).rstrip("/"):
        # a store's save retires the destination's objects before it copies kept chunks: an async save, whose kept
        # rows are not staged, then had nothing to write them from (the checkpoint was lost); saved in full
        logger.info("%s is its own incremental base on an object store: saving it in full", destination.path)
        return None
    if destination.can_keep_from(base):
        return base
    logger.info(
        "incremental saves keep chunk files within one file system or store (with server-side copy): saving %s in full",
        destination.path,
    )
    return None
