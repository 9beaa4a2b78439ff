"""A local tier's commit records: what makes a part on a node's tier exist for a resume.

Once every rank's part of a step and every replica is durable, each node writes, beside each part it
holds, a small JSON record (``step-<N>/rank-<R>.commit.json``) naming the step, the rank, the save,
the job's identity (run id, world size, shared directory), the SHA-256 of the part's manifest and the
newest shared-tier commit the job knew of when it saved the step (:func:`local_is_newer` orders the tiers by
it). A part without its record, with a record that does not parse or match, or whose manifest is not the
one recorded, does not exist for a resume (:func:`read_record`).

Example:
    >>> record_name(3)
    'rank-00003.commit.json'
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import CheckpointError, from_os_error
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.storage.commit import write_file_durably
from torchrl_dcp.storage.files import DirHandle, read_whole

RECORD_FORMAT = "torchrl_dcp.local_tier"
RECORD_VERSION = 1
RECORD = re.compile(r"rank-([0-9]{5})\.commit\.json")
#: a killed record write's temporary (``write_file_durably``)
RECORD_TMP = re.compile(r"\.rank-[0-9]{5}\.commit\.json\.tmp-[0-9a-f]{32}")
_RECORD_LIMIT = 64 << 10
_MANIFEST_LIMIT = 64 << 20  # a part's manifest larger than this is not digested (its record never matches)


@dataclass(frozen=True)
class HeldPart:
    """A committed part this node's tier holds: ``rank``'s state at ``step`` from the save ``save_id``."""

    step: int
    rank: int
    save_id: str
    #: the newest shared-tier commit (the rotation's ``sequence``) the job knew of when it saved the step; ``-1``:
    #: not known (a record written before the tiers were ordered by commit)
    shared_sequence: int = -1
    #: when the part was saved (its rank's clock, seconds since the epoch; ``None``: not recorded)
    saved_at: float | None = None
    #: the run that saved it: the step it resumed (``-1``: a fresh start) and when (rank 0's clock); ``None``: not
    #: recorded (a run that never resumed, or a part saved before runs were recorded); ``local_nodes.abandoned``
    #: reads them
    resumed: tuple[int, float] | None = None


def record_name(rank: int) -> str:
    return f"rank-{rank:05d}.commit.json"


def manifest_digest(part: Path) -> str:
    """The SHA-256 of the part's manifest (:func:`_manifest_bytes`)."""
    return hashlib.sha256(_manifest_bytes(part)).hexdigest()


def _manifest_bytes(part: Path) -> bytes:
    """The part's manifest, read through the part's directory opened without following a link (``DirHandle``: a
    link planted in place of the part, or swapped in after a check, is refused)."""
    try:
        handle = DirHandle.open(part)
        try:
            fd = handle.open_file("manifest.json")
        finally:
            handle.close()
    except OSError as err:  # (a link or a file in the part's place: CheckpointError, from DirHandle)
        raise from_os_error(err, "reading the part's manifest", part / "manifest.json") from None
    try:
        size = os.fstat(fd).st_size
        if size > _MANIFEST_LIMIT:
            raise CheckpointError(f"is implausibly large ({size} bytes)", path=part / "manifest.json")
        chunks, done = [], 0
        while done < size:
            chunk = os.pread(fd, min(size - done, 1 << 20), done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _described(data: bytes) -> tuple[Any, Any, Any, Any, Any]:
    """``(step, rank, shared sequence, saved at, resumed)`` a part's manifest says it holds: its step, and what its
    local-tier save recorded: the rank, the newest shared commit (``-1``: a part saved before the tiers were ordered
    by commit), when it was saved and the run that saved it (:class:`HeldPart`; ``None``: not recorded)."""
    try:
        manifest = loads_json(data)
    except ValueError:
        return None, None, None, None, None
    if not isinstance(manifest, dict):
        return None, None, None, None, None
    metadata = manifest.get("metadata")
    tier = metadata.get("local_tier") if isinstance(metadata, dict) else None
    if not isinstance(tier, dict):
        return manifest.get("step"), None, None, None, None
    return (
        manifest.get("step"),
        tier.get("rank"),
        tier.get("shared_sequence", -1),
        tier.get("saved_at"),
        tier.get("resumed"),
    )


def _is_time(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 1e12  # (seconds since the epoch, finite)


def run_of(saved_at: Any, resumed: Any) -> tuple[float | None, tuple[int, float] | None] | None:
    """``(saved at, resumed)`` as :class:`HeldPart` holds them, from a manifest's values; ``None`` when they are
    not what a save records (a part whose manifest says so is damaged)."""
    if saved_at is not None and not _is_time(saved_at):
        return None
    if resumed is None:
        return (None if saved_at is None else float(saved_at)), None
    if not (isinstance(resumed, list) and len(resumed) == 2 and _is_sequence(resumed[0]) and _is_time(resumed[1])):
        return None
    return (None if saved_at is None else float(saved_at)), (resumed[0], float(resumed[1]))


def write_record(
    step_dir: Path, rank: int, step: int, save_id: str, identity: Mapping[str, Any], shared_sequence: int = -1
) -> None:
    part = step_dir / f"rank-{rank:05d}"
    record = {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "step": step,
        "rank": rank,
        "save_id": save_id,
        "identity": dict(identity),
        "manifest_sha256": manifest_digest(part),
        "shared_sequence": shared_sequence,
    }
    handle = DirHandle.open(step_dir)
    try:
        write_file_durably(step_dir / record_name(rank), json.dumps(record).encode(), within=handle)
        handle.fsync()
    finally:
        handle.close()


def read_record(step_dir: Path, rank: int, step: int, identity: Mapping[str, Any] | None) -> HeldPart | None:
    """The part a commit record names, if the record is well formed, matches and the part's manifest is its own."""
    found = check_record(step_dir, rank, step, identity)
    return found if isinstance(found, HeldPart) else None


def check_record(step_dir: Path, rank: int, step: int, identity: Mapping[str, Any] | None) -> HeldPart | str | None:
    """The part rank ``rank``'s commit record in ``step_dir`` names (:class:`HeldPart`); else why it does not count:
    ``None`` for a record of another job, world size or shared directory (``identity``; ``None``: any), a string
    for a damaged one (it does not parse or describe this part, or the part's manifest is not the one it names)."""
    try:
        record = loads_json(read_whole(step_dir / record_name(rank), _RECORD_LIMIT, step_dir))
    except (OSError, ValueError, CheckpointError) as err:
        return f"its commit record cannot be read ({err})"
    if not (
        isinstance(record, dict)
        and record.get("format") == RECORD_FORMAT
        and record.get("version") == RECORD_VERSION
        and record.get("step") == step
        and record.get("rank") == rank
        and isinstance(record.get("save_id"), str)
        and _is_sequence(record.get("shared_sequence", -1))
    ):
        return "its commit record is not this part's"
    if identity is not None and record.get("identity") != json.loads(json.dumps(dict(identity))):
        return None
    try:
        data = _manifest_bytes(step_dir / f"rank-{rank:05d}")
    except (OSError, CheckpointError) as err:
        return f"its manifest cannot be read ({err})"
    if record.get("manifest_sha256") != hashlib.sha256(data).hexdigest():
        return "its manifest is not the one its commit record names (damaged or altered)"
    held = _described(data)
    if held[:2] != (step, rank):  # (a record resealed over another step's or rank's part: never restored as this one)
        return f"its manifest holds step {held[0]!r} of rank {held[1]!r}, its commit record step {step} of rank {rank}"
    known = record.get("shared_sequence", -1)
    if held[2] != known:  # (a record edited to order a stale step after the shared tier's newer commits)
        return f"its manifest names shared commit {held[2]!r}, its commit record {known!r} (altered)"
    run = run_of(held[3], held[4])
    if run is None:
        return f"its manifest records the run that saved it as {held[3]!r}, {held[4]!r} (no save writes that)"
    return HeldPart(step, rank, record["save_id"], known, *run)


def _is_sequence(value: Any) -> bool:
    return type(value) is int and value >= -1


def plain(part: HeldPart) -> tuple[int, int, str, int, float | None, list[Any] | None]:
    """``part`` as the ranks exchange it (:func:`~torchrl_dcp.local_nodes.newest_complete` reads it)."""
    resumed = None if part.resumed is None else list(part.resumed)
    return part.step, part.rank, part.save_id, part.shared_sequence, part.saved_at, resumed


def local_is_newer(local: tuple[int, int], shared: tuple[int, int | None]) -> bool:
    """Whether a local step ``(step, shared sequence its record names)`` is to be resumed rather than the shared
    tier's newest entry ``(step, its commit sequence)``: the tiers ordered by commit where both are known.

    The local step is newer when no shared commit came after it: the entry's sequence is one the job knew of when it
    saved the step (after a roll-back to an older step, this run's local steps come after the abandoned run's higher
    shared steps; a local save due with a shared one names the commit that shared save will make: the same state,
    the local copy restores faster). Where either sequence is not known (a record written before, a
    damaged entry, an entry saved by hand into the rotation's directory), by step, the local tier winning ties.

    Example:
        >>> local_is_newer((48, 7), (64, 7))  # saved after a roll-back from step 64 (commit 7) to 32
        True
        >>> local_is_newer((48, 5), (64, 7)), local_is_newer((64, 5), (64, 6)), local_is_newer((48, -1), (32, None))
        (False, False, True)
    """
    (step, known), (shared_step, sequence) = local, shared
    if known >= 0 and sequence is not None:
        return sequence <= known
    return step >= shared_step
