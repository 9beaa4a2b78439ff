"""Races in the staging directory: names planted or swapped while a save runs never make it write outside the
checkpoint, and never get committed.

Every write of a save goes through the staging directory's descriptor (opened once,
``O_DIRECTORY | O_NOFOLLOW``; files created ``O_CREAT | O_EXCL | O_NOFOLLOW`` with
unpredictable temporary names), and the staged tree is checked (names, regular files,
sizes) before the atomic rename, which refuses a staging path that no longer names the
directory written. Each case: the save raises a ``CheckpointError``, nothing outside
changes, and the previous checkpoint (also a rotation's, with ``keep_last=1``) is intact.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.storage import writer


def _plant_metadata_tmp(staging: Path, outside: Path) -> None:
    (staging / ".metadata.tmp").symlink_to(outside / "victim")  # the name older versions wrote through


def _plant_extra_file(staging: Path, outside: Path) -> None:
    (staging / "__7_0.distcp").write_bytes(b"planted")


def _swap_staging_for_link(staging: Path, outside: Path) -> None:
    staging.rename(staging.with_name(staging.name + ".moved"))
    staging.symlink_to(outside, target_is_directory=True)


def _swap_data_file_for_link(staging: Path, outside: Path) -> None:
    data = staging / "__0_shared.distcp"
    size = data.stat().st_size
    (outside / "same-size").write_bytes(b"\0" * size)
    data.unlink()
    data.symlink_to(outside / "same-size")


RACES: dict[str, Callable[[Path, Path], None]] = {
    "planted .metadata.tmp link": _plant_metadata_tmp,
    "planted extra file": _plant_extra_file,
    "staging swapped for a link": _swap_staging_for_link,
    "data file swapped for a link": _swap_data_file_for_link,
}


@pytest.mark.parametrize("race", sorted(RACES))
def test_a_race_in_staging_is_refused_and_nothing_outside_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=1)
    state = {"w": torch.arange(1000.0)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    rotation.save(ckpt, step=1)
    original = writer.write_share
    raced: list[Path] = []

    def write_then_race(flat, keys, directory, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(flat, keys, directory, *args, **kwargs)
        where = getattr(directory, "path", directory)  # the staging directory (its handle's path)
        raced.append(where)
        RACES[race](where, outside)
        return out

    monkeypatch.setattr(writer, "write_share", write_then_race)
    state["w"] += 1
    with pytest.raises(tdcp.CheckpointError, match="tampered|replaced|not the regular file|appeared"):
        rotation.save(ckpt, step=2)
    monkeypatch.undo()
    assert raced, "the race was never run"
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        ["victim"] + (["same-size"] if race == "data file swapped for a link" else [])
    ), "the save wrote outside its checkpoint"
    assert [e.step for e in rotation.entries()] == [1]
    fresh = {"w": torch.zeros(1000)}
    assert tdcp.resume(tdcp.DistributedCheckpoint(state=fresh), tmp_path / "run").step == 1
    assert torch.equal(fresh["w"], torch.arange(1000.0))
    os.sync()


@pytest.mark.parametrize("race", sorted(RACES))
def test_a_race_while_an_archive_is_unpacked_is_refused_and_nothing_outside_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    """``to_directory`` (an archive back to a checkpoint directory) stages the same way: every file created through
    the staging directory's descriptor, the staged tree checked, the rename refusing a swapped staging path; the
    checkpoint already at the destination is kept."""
    from torchrl_dcp import convert

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    state = {"w": torch.arange(1000.0)}
    archive = tdcp.to_archive(tdcp.DistributedCheckpoint(state=state).save(tmp_path / "c"), tmp_path / "c.zip")
    previous = tdcp.DistributedCheckpoint(state={"w": torch.ones(1000)}).save(tmp_path / "back")
    original = convert.copy_ranges
    raced: list[Path] = []

    def copy_then_race(ranges, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(ranges, *args, **kwargs)
        (staging,) = [p for p in tmp_path.iterdir() if ".tdcp-staging-" in p.name]
        raced.append(staging)
        RACES[race](staging, outside)
        return out

    monkeypatch.setattr(convert, "copy_ranges", copy_then_race)
    with pytest.raises(tdcp.CheckpointError, match="tampered|replaced|not the regular file|appeared"):
        tdcp.to_directory(archive, previous, overwrite=True)
    monkeypatch.undo()
    assert raced, "the race was never run"
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        ["victim"] + (["same-size"] if race == "data file swapped for a link" else [])
    ), "the conversion wrote outside its checkpoint"
    fresh = {"w": torch.zeros(1000)}
    tdcp.DistributedCheckpoint(state=fresh).load(previous)
    assert torch.equal(fresh["w"], torch.ones(1000))
