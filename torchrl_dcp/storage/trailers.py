"""Save-identity trailers: every data file ends with the id of the save that wrote it and the writing rank.

One rule for what a data file's trailer must name (:func:`trailer_identity`), one comparison
(:func:`check_trailer`), and the batch check of a container's files (:func:`check_identities`) that
loads, ``verify``, the tools and conversions run: a file copied in from another checkpoint with its
record resealed, or another rank's file under this rank's name, is refused and named.

Example:
    >>> from torchrl_dcp.storage.trailers import trailer_identity
    >>> trailer_identity("__3_0.distcp", {}, "save-a")
    ('save-a', 3)
    >>> trailer_identity("__0_shared.distcp", {}, "save-a")
    ('save-a', 0)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.layout import TRAILER_SIZE, data_file_rank, is_chunk_file, read_identity
from torchrl_dcp.storage.files import open_regular

if TYPE_CHECKING:
    from torchrl_dcp.storage.base import ByteRange, Container


def check_identities(container: Container, names: Iterable[str], files: Mapping[str, Any], save_id: str) -> None:
    """Every data file in ``names`` of ``container`` ends with the identity trailer of save ``save_id`` (format 3 and
    later), or of the save its record names as its ``origin`` (a chunk file an incremental save kept), naming the
    rank its name says (:func:`trailer_identity`).

    Refuses a data file copied in from another checkpoint together with its record (size and checksum match, the
    save does not), and one of another rank of the same save under this rank's name (two ranks' files swapped, their
    records resealed): what loads, ``verify``, the tools and conversions check, through one function.
    """
    ordered = sorted(set(names))
    for at in range(0, len(ordered), _TRAILERS_AT_ONCE):
        opened: list[tuple[str, ByteRange, int]] = []
        try:
            for name in ordered[at : at + _TRAILERS_AT_ONCE]:  # every trailer asked for before the first read
                span = container.byte_range(name)
                opened.append((name, span, open_regular(span.path, span.where)))
                end = os.fstat(opened[-1][2]).st_size
                if span.base + span.size > end:  # (a forged size past any file: no read, no hint at it)
                    raise CheckpointIntegrityError(
                        f"the manifest records {span.size} bytes, which end past the {end - span.base} there are: "
                        "truncated, or a forged size",
                        path=span.where,
                    )
                if span.size >= TRAILER_SIZE:  # cold: the reads then run at once (7 -> 4.5 ms, 128 files)
                    _will_need(opened[-1][2], span.base + span.size - TRAILER_SIZE, TRAILER_SIZE)
            for name, span, fd in opened:
                tail = (
                    os.pread(fd, TRAILER_SIZE, span.base + span.size - TRAILER_SIZE)
                    if span.size >= TRAILER_SIZE
                    else b""
                )
                expected, rank = trailer_identity(name, files.get(name, {}), save_id, span.where)
                check_trailer(tail, expected, span.where, rank=rank)
        finally:
            for _, _, fd in opened:
                os.close(fd)


_TRAILERS_AT_ONCE = 64  # files open at once while their identities are read


def _will_need(fd: int, offset: int, size: int) -> None:
    """A trailer's read-ahead hint (not :func:`copying.will_need`: that one announces the data reads)."""
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError, OverflowError):  # not on every platform (the reads wait in turn); a forged size
        pass  # past a C long (the reads then find the file shorter, and say so)


def trailer_identity(name: str, record: Mapping[str, Any], save_id: str, where: Any = None) -> tuple[str, int | None]:
    """``(save, rank)`` the identity trailer of data file ``name`` (manifest record ``record``) of save ``save_id``
    must name: this save and the rank its name says (``__<rank>_<n>.distcp``, ``__<rank>_shared.distcp``: every save
    writes its files under the writing rank; ``None``: a name that says no rank), or, for a chunk file an incremental
    save kept from an earlier save (its ``origin``), that save (written there by whichever rank wrote that chunk:
    no rank to compare).

    Raises:
        CheckpointIntegrityError: an ``origin`` on anything but a chunk file, or naming this very save: no save
            writes one (it would waive the comparisons above: another save's shared file, two ranks' files swapped).
    """
    origin = record.get("origin")
    if origin is None:
        return save_id, data_file_rank(name)
    if not is_chunk_file(name) or origin == save_id:
        raise CheckpointIntegrityError(
            f"the manifest records this file as kept from save {origin!r}, which "
            + ("is this save itself" if origin == save_id else "only a chunk file an incremental save kept can be")
            + ": no save writes that (forged, to take a file of another save or rank); refused",
            path=name if where is None else where,
        )
    return origin, None


def check_trailer(tail: bytes, save_id: str, where: Any, kind: str = "a file", rank: int | None = None) -> None:
    """``tail`` (a data file's last bytes) carries the identity of save ``save_id`` and, unless ``rank`` is
    ``None``, of rank ``rank`` (:func:`trailer_identity`); ``kind`` names what it is."""
    found = read_identity(bytes(tail))
    if found is None or found[0] != save_id:
        who = "no save identity" if found is None else f"the identity of save {found[0]!r}"
        raise CheckpointIntegrityError(
            f"data file carries {who}, the manifest is save {save_id!r}: {kind} from another checkpoint "
            "(or a damaged one); refused",
            path=where,
        )
    if rank is not None and found[1] != rank:
        raise CheckpointIntegrityError(
            f"data file's identity trailer names rank {found[1]}, its name says rank {rank}: {kind} of another rank "
            "under this rank's name (ranks' files swapped or renamed, their records resealed); refused",
            path=where,
        )
