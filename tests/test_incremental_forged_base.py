"""Incremental saves never keep a base file on the manifest's word: forged bases give honest checkpoints.

The forger can write the base checkpoint and reseal every checksum the format documents
(each file's size and CRC-32, the chunk table and storage entries, the rank's manifest shard,
``.metadata``, the manifest's own checksum). A chunk file
is kept only when this process wrote (or compared) it and a ``fstat`` shows it unchanged,
or when it is read and found byte for byte equal to the live rows
(:mod:`torchrl_dcp.storage.proven`); otherwise its rows are written anew. Each case: the
incremental checkpoint equals a full save of the same live state, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import torchrl_dcp as tdcp
from tests import forging
from tests.test_incremental import (
    assert_same_checkpoint,
    base_and_buffer,
    chunk_files,
    fill,
    kept_files,
    small_chunks,  # noqa: F401 - the autouse fixture: chunk files of a few KiB
)
from torchrl_dcp.storage import chunk_writer, proven


def edit_manifest(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest (root and shards, as readers see it) and reseal it; where the storage entries (the chunk
    table's places) changed, ``.metadata`` is rewritten to say the same (a forger moves a record in both)."""
    m = forging.read_parts(path)
    before = forging.places(m)
    fn(m)
    if forging.places(m) != before:
        assert forging.mirror_into_metadata(path, m)
    forging.write_parts(path, m)


def reseal(path: Path, *names: str) -> None:
    forging.reseal(path, *names)


def rewrite_rows_in_place(base: Path, name: str) -> int:
    """Overwrite bytes inside the rows of the chunk file ``name`` (same inode, same size), then reseal its
    checksum; the chunk table's fingerprint still names the genuine rows."""
    with open(base / name, "r+b") as f:
        f.seek(os.path.getsize(base / name) // 2)
        f.write(b"\x7f" * 16)
    reseal(base, name)
    return 1  # the first chunk is forged


def swap_chunk_table_files(base: Path, _name: str) -> int:
    """Swap the ``file`` fields of two entries of the base's sealed chunk table (fingerprints stay put)."""

    def fn(m: dict[str, Any]) -> None:
        entries = next(iter(m["chunks"].values()))
        entries[0]["file"], entries[1]["file"] = entries[1]["file"], entries[0]["file"]

    edit_manifest(base, fn)
    return 2  # the first two chunks name each other's files


def swap_chunk_table_entries(base: Path, _name: str) -> int:
    """Swap the ``file`` and ``fingerprint`` fields of two entries: each names the other chunk's file whole."""

    def fn(m: dict[str, Any]) -> None:
        entries = next(iter(m["chunks"].values()))
        for field in ("file", "fingerprint"):
            entries[0][field], entries[1][field] = entries[1][field], entries[0][field]

    edit_manifest(base, fn)
    return 2


FORGERIES: dict[str, Callable[[Path, str], int]] = {  # -> how many leading chunks are forged
    f.__name__: f for f in (rewrite_rows_in_place, swap_chunk_table_files, swap_chunk_table_entries)
}


@pytest.mark.parametrize("remembered", [True, False], ids=["same_process", "fresh_process"])
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_base_chunks_are_written_anew(tmp_path: Path, forgery: str, remembered: bool) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    key, entries = next(iter(tdcp.read_manifest(base)["chunks"].items()))
    forged = FORGERIES[forgery](base, entries[0]["file"])
    if not remembered:
        proven.forget_all()  # what a resumed job knows of files it did not write this run
    fill(rb, 3, 777)  # a change elsewhere: the victims' rows are unchanged (tracked, and by content)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))
    victims = {e["file"] for e in tdcp.read_manifest(inc)["chunks"][key][:forged]}  # the forged chunks, in inc
    assert not kept_files(inc) & victims
    assert kept_files(inc), "the genuine chunk files are still kept"
    assert tdcp.verify(inc)["unchecked"] == []


def test_a_file_this_process_wrote_is_kept_for_a_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady state: rotation prunes entries whose chunk files newer ones still link; the files stay proven, so
    no save reads a kept file back."""
    reads: list[Any] = []
    real = chunk_writer._same_bytes
    monkeypatch.setattr(chunk_writer, "_same_bytes", lambda *a: reads.append(a) or real(*a))
    rb, ckpt, _ = base_and_buffer(tmp_path)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=2)
    kept = []
    for step in range(5):
        fill(rb, 2, 1000 * step)
        kept.append(len(kept_files(rotation.save(ckpt, step=step))))
    assert reads == []
    assert min(kept[1:]) >= len(chunk_files(rotation.latest())) - 2, kept


def test_a_file_unknown_to_this_process_is_proved_by_reading_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Any] = []
    real = chunk_writer._same_bytes
    monkeypatch.setattr(chunk_writer, "_same_bytes", lambda *a: reads.append(a) or real(*a))
    rb, ckpt, base = base_and_buffer(tmp_path)
    proven.forget_all()
    fill(rb, 2, 5)
    first = ckpt.save(tmp_path / "first", incremental_from=base)
    assert len(reads) == len(kept_files(first)) > 0
    reads.clear()
    fill(rb, 2, 9)
    second = ckpt.save(tmp_path / "second", incremental_from=first)
    assert reads == [] and kept_files(second)


def test_record_bytes_do_not_depend_on_how_a_shape_was_spelled_first() -> None:
    """``torch.Size`` hashes like its tuple but pickles differently: whichever a process asked for first (a load
    asks with ``torch.Size``) must not change the bytes it writes, or files it wrote could not be proved later."""
    import torch

    from torchrl_dcp.format.record import expected_pickle, template

    shape = (37, 5)
    first = template(torch.float16, torch.Size(shape)).head, expected_pickle(torch.float16, torch.Size(shape))
    assert (template(torch.float16, shape).head, expected_pickle(torch.float16, shape)) == first
    assert b"Size" not in first[0] and b"Size" not in first[1]


def test_an_older_checkpoint_claiming_the_newest_saves_identity_is_compared_by_content(tmp_path: Path) -> None:
    """Probe u2: an older checkpoint of the job resealed to claim the save id of the newest commit (no data file
    touched): the row trackers proved its rows unchanged since that save, and its own files vouched for its own
    records, so the new checkpoint kept the older rows. The trackers' word now holds for a save where it committed."""
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(256), batch_size=4)
    fill(rb, 256, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    old = ckpt.save(tmp_path / "old")
    fill(rb, 256, 1000)  # every row written again
    newest = ckpt.save(tmp_path / "newest", incremental_from=old)
    claimed = tdcp.read_manifest(newest)["save_id"]

    def forge(m: dict[str, Any]) -> None:
        own = m["save_id"]
        m["save_id"] = claimed
        for name in {c["file"] for parts in m["chunks"].values() for c in parts}:
            m["files"][name]["origin"] = own  # (its chunk files' trailers name it: recorded as kept from it)

    edit_manifest(old, forge)
    forged_base = ckpt.save(tmp_path / "from_forged", incremental_from=old)
    assert_same_checkpoint(forged_base, ckpt.save(tmp_path / "full"))
