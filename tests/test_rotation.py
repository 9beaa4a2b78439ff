"""Rotation (keep_last, keep_best, archives), latest-from-committed-only, and resume (one process)."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp


def ckpt_for(step: int) -> tuple[tdcp.DistributedCheckpoint, torch.nn.Module]:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    return tdcp.DistributedCheckpoint(model=model, counters={"step": step}), model


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_keep_last_and_keep_best(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2, keep_best=("reward", "max"))
    rewards = {1: 0.5, 2: 9.0, 3: 1.0, 4: 2.0, 5: 3.0}
    for step, reward in rewards.items():
        path = rotation.save(ckpt_for(step)[0], step=step, metadata={"reward": reward})
        assert path.name == f"step-{step:012d}" and rotation.latest() == path
    assert names(tmp_path) == ["step-000000000002", "step-000000000004", "step-000000000005"]
    assert rotation.best() == tmp_path / "step-000000000002"
    assert [(e.step, e.metric) for e in rotation.entries()] == [(2, 9.0), (4, 2.0), (5, 3.0)]
    low = tdcp.CheckpointRotation(tmp_path, keep_last=1, keep_best=("reward", "min"))
    assert low.best() == tmp_path / "step-000000000004"
    with pytest.raises(ValueError, match="reward"):
        rotation.save(ckpt_for(6)[0], step=6)  # keep_best needs the metric
    with pytest.raises(ValueError):
        tdcp.CheckpointRotation(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        tdcp.CheckpointRotation(tmp_path, keep_best=("reward", "up"))  # type: ignore[arg-type]


def test_archive_rotation_loads_latest_from_the_zip(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2, archive=True)
    for step in (10, 20, 30):
        rotation.save(ckpt_for(step)[0], step=step)
    assert names(tmp_path) == ["step-000000000020.zip", "step-000000000030.zip"]
    ckpt, model = ckpt_for(0)
    result = rotation.load_latest(ckpt)
    assert result.step == 30 and result.values["counters"] == {"step": 30}
    assert torch.equal(model.weight, ckpt_for(30)[1].weight)
    assert all(e.archive and e.committed and e.size > 0 for e in rotation.entries())


def test_latest_never_picks_a_half_written_entry(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    rotation.save(ckpt_for(1)[0], step=1)
    # what killed saves leave: a staging directory, an uncommitted entry, a half-written archive
    staging = tmp_path / (".step-000000000002.tdcp-staging-" + "dead" * 8)
    staging.mkdir()
    (staging / "__0_shared.distcp").write_bytes(b"partial")
    (tmp_path / "step-000000000003").mkdir()
    (tmp_path / "step-000000000003" / "__0_shared.distcp").write_bytes(b"partial")
    (tmp_path / "step-000000000004.zip").write_bytes(b"PK\x03\x04 half an archive")
    assert rotation.latest() == tmp_path / "step-000000000001"
    every = rotation.entries(include_uncommitted=True)
    assert [(e.step, e.committed) for e in every] == [(1, True), (3, False), (4, False)]
    info = tdcp.resume(ckpt_for(0)[0], tmp_path)
    assert info is not None and info.step == 1
    rotation.save(ckpt_for(5)[0], step=5)  # cleans the older staging directory, keeps foreign-looking entries
    assert not staging.exists() and rotation.latest() == tmp_path / "step-000000000005"


def test_resume_starts_fresh_then_resumes_and_skips_a_damaged_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, model = ckpt_for(0)
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"):
        assert tdcp.resume(ckpt, tmp_path / "none") is None
    assert "starting fresh" in caplog.text
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2):
        rotation.save(ckpt_for(step)[0], step=step)
    data = tmp_path / "step-000000000002" / "__0_shared.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"), pytest.warns(tdcp.TorchrlDcpWarning, match="damaged"):
        info = tdcp.resume(ckpt, tmp_path)
    assert info is not None and info.step == 1 and info.path.name == "step-000000000001"
    assert torch.equal(model.weight, ckpt_for(1)[1].weight)
    assert "damaged" in caplog.text and "resumed from step 1" in caplog.text
    with pytest.raises(tdcp.CheckpointIntegrityError):
        rotation.load_latest(ckpt, fallback=False)
    # a user error (not damage) is raised, not skipped
    wrong = tdcp.DistributedCheckpoint(model=torch.nn.Linear(3, 3), counters={})
    with pytest.raises(tdcp.IncompatibleComponentError):
        tdcp.resume(wrong, tmp_path)


@pytest.mark.parametrize("users", ["eval_results.json", ".DS_Store", "plots/"])
def test_a_users_file_in_the_newest_entry_stops_a_resume_saying_what_to_move(tmp_path: Path, users: str) -> None:
    """A user's evaluation results put into the newest entry: the load refuses it (its manifest does not list
    them), and resume passed over it for the older entry with a "damaged" warning; the job then trained to that step
    again and died at its save, which never replaces an entry holding a user's file, at every requeue. The resume
    now stops there naming the file; moved out, the newest entry resumes. A damaged entry is still passed over."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        rotation.save(ckpt_for(step)[0], step=step)
    newest = tmp_path / "step-000000000003"
    mine = newest / users.rstrip("/")
    mine.mkdir() if users.endswith("/") else mine.write_text("{}")
    ckpt, model = ckpt_for(0)
    before = model.weight.clone()
    with pytest.raises(
        tdcp.CheckpointError,
        match=rf"step-000000000003: holds '{re.escape(users.rstrip('/'))}', a file no save writes.*move it out",
    ):
        rotation.resume(ckpt)
    assert torch.equal(model.weight, before) and mine.exists()
    mine.rename(tmp_path / "moved")
    assert rotation.resume(ckpt).step == 3 and torch.equal(model.weight, ckpt_for(3)[1].weight)
    (newest / "__0_9.distcp").write_bytes(b"planted")  # named like a save's file: damage, passed over
    with pytest.warns(tdcp.TorchrlDcpWarning, match="damaged"):
        assert rotation.resume(ckpt).step == 2


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_a_newest_entry_whose_manifest_is_damaged_is_warned_about_and_saved_again(tmp_path: Path, damage: str) -> None:
    """An entry whose manifest was truncated is no committed one: resume skipped it unseen (``fallback=False``
    loaded the older one too), and the job died at that step's save, which refused to replace it. Now it is warned
    about (raised without fallback), and the save of its step replaces it (it holds nothing but a save's files)."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2):
        rotation.save(ckpt_for(step)[0], step=step)
    manifest = tmp_path / "step-000000000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:50] if damage == "truncated" else b"")
    ckpt, model = ckpt_for(0)
    with pytest.raises((tdcp.CheckpointFormatError, tdcp.CheckpointIntegrityError), match="step-000000000002"):
        tdcp.resume(ckpt, tmp_path, fallback=False)
    with pytest.warns(tdcp.TorchrlDcpWarning, match="step-000000000002 is damaged"):
        info = tdcp.resume(ckpt, tmp_path)
    assert info is not None and info.step == 1 and torch.equal(model.weight, ckpt_for(1)[1].weight)
    rotation.save(ckpt_for(2)[0], step=2)  # the job goes on: its step is saved again
    assert [e.step for e in rotation.entries()] == [1, 2]
    (tmp_path / "step-000000000002" / "notes.txt").write_text("mine")
    manifest.write_bytes(b"")
    with pytest.raises(tdcp.CheckpointError, match="notes.txt"):  # a damaged one holding a user's file: kept
        rotation.save(ckpt_for(2)[0], step=2)
    assert (tmp_path / "step-000000000002" / "notes.txt").read_text() == "mine"


def _plain_dcp(path: Path, manifest: bytes | None = None) -> list[str]:
    """A user's plain ``dcp.save`` checkpoint at ``path`` (no identity trailers), with a ``manifest.json`` of theirs
    (``manifest``); returns its names."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path), no_dist=True)
    if manifest is not None:
        (path / "manifest.json").write_bytes(manifest)
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("manifest", [None, b'{"tool": "mine", "format": "other"}', b'{"format": "torchrl_dcp", "x'])
def test_a_users_plain_dcp_checkpoint_is_never_replaced(tmp_path: Path, manifest: bytes | None) -> None:
    """A damaged checkpoint of ours is replaced by the save of its step: a user's plain DCP checkpoint (no manifest,
    another tool's, even one that reads as a damaged one of ours) was taken for one and deleted. Its data files carry
    no save identity: never ours."""
    names = _plain_dcp(tmp_path / "step-000000000003", manifest)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    with pytest.raises(tdcp.CheckpointError, match="refusing to replace"):
        rotation.save(ckpt_for(3)[0], step=3)
    assert sorted(p.name for p in (tmp_path / "step-000000000003").iterdir()) == names
    with pytest.raises(tdcp.CheckpointError, match="refusing to replace"):
        tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2)).save(tmp_path / "step-000000000003")


@pytest.mark.parametrize("where", ["directory", "store"])
def test_a_users_own_manifest_and_metadata_without_data_files_are_never_replaced(tmp_path: Path, where: str) -> None:
    """A user's ``manifest.json`` that is no JSON (YAML, JSON Lines) beside a ``.metadata`` of theirs read as a damaged
    checkpoint of ours holding only a save's files: a save replaced both. With no data file there is no evidence."""
    import fsspec

    files = {"manifest.json": b"tool: mine\nruns: 3\n", ".metadata": b"my metadata"}
    if where == "directory":
        path: Any = tmp_path / "ckpt"
        path.mkdir()
        for name, data in files.items():
            (path / name).write_bytes(data)
        read = lambda name: (path / name).read_bytes()  # noqa: E731
    else:
        fs = fsspec.filesystem("memory")
        prefix = f"/tdcp-tests/{tmp_path.name}/ckpt"
        for name, data in files.items():
            fs.pipe_file(f"{prefix}/{name}", data)
        path = f"memory:/{prefix}"
        read = lambda name: fs.cat_file(f"{prefix}/{name}")  # noqa: E731
    with pytest.raises(tdcp.CheckpointError, match="refusing to"):
        tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2)).save(path)
    assert all(read(name) == data for name, data in files.items())


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_newest_entry_whose_shard_is_damaged_is_no_incremental_base(tmp_path: Path, damage: str) -> None:
    """A resume warned about the newest entry (its manifest shard truncated by a copy) and fell back, then every later
    save failed: the rotation took that entry as the base of its incremental save and read its shard."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)

    def job(step: int) -> tdcp.DistributedCheckpoint:
        ckpt = ckpt_for(step)[0]
        ckpt.register("rng", tdcp.RNGState())  # (per-rank state: a shard)
        return ckpt

    for step in (2, 4):
        rotation.save(job(step), step=step)
    shard = tmp_path / "step-000000000004" / "manifest-0.json"
    shard.write_bytes(shard.read_bytes()[:40]) if damage == "truncated" else shard.unlink()
    with pytest.warns(tdcp.TorchrlDcpWarning, match="step-000000000004 is damaged"):
        assert tdcp.resume(job(0), tmp_path).step == 2
    rotation.save(job(6), step=6)  # (its base: step 2, the newest whole entry)
    assert tdcp.resume(job(0), tmp_path).step == 6


def test_a_damaged_entry_that_cannot_be_replaced_names_the_file_that_stops_it(tmp_path: Path) -> None:
    """Its manifest and a data file truncated (a copy cut short): the save of its step is refused (the data file
    ends with no save identity), and the error named "entries a checkpoint never holds ([])", not that file."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (2, 4):
        rotation.save(ckpt_for(step)[0], step=step)
    entry = tmp_path / "step-000000000004"
    for name in ("manifest.json", "__0_shared.distcp"):
        (entry / name).write_bytes((entry / name).read_bytes()[:50])
    with pytest.raises(tdcp.CheckpointError, match=r"__0_shared.distcp ends with no save identity"):
        rotation.save(ckpt_for(4)[0], step=4)


def test_a_newest_entry_of_a_newer_format_stops_the_resume_and_is_never_replaced(tmp_path: Path) -> None:
    """An entry written by a newer torchrl_dcp (its manifest sealed, format 9) was listed as uncommitted and passed
    over without a word: the job resumed from the older step, trained to that step again, and its save was refused
    as "not a torchrl_dcp checkpoint". The resume now tries it and raises what the load says: upgrade."""
    import json

    from torchrl_dcp.format.manifest import FORMAT_VERSION, seal

    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        rotation.save(ckpt_for(step)[0], step=step)
    manifest = tmp_path / "step-000000000003" / "manifest.json"
    parsed = json.loads(manifest.read_text())
    parsed["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(seal(parsed)))
    with pytest.raises(tdcp.CheckpointVersionError, match=r"step-000000000003.*upgrade torchrl_dcp"):
        rotation.resume(ckpt_for(0)[0])
    with pytest.raises(tdcp.CheckpointError, match=r"holds a checkpoint this version cannot read .*upgrade"):
        rotation.save(ckpt_for(3)[0], step=3)
    assert [e.step for e in rotation.entries()] == [1, 2]  # (committed: what latest, prune and incremental use)
    assert json.loads(manifest.read_text())["format_version"] == FORMAT_VERSION + 1  # kept as it is
    with pytest.raises(tdcp.CheckpointError, match=r"is a checkpoint \(.*upgrade.*\), not a rotation directory"):
        tdcp.resume(ckpt_for(0)[0], manifest.parent)  # (the entry itself, given as the directory)


@pytest.mark.parametrize("given", ["checkpoint", "archive", "file", "store checkpoint"])
def test_a_resume_from_a_checkpoint_or_a_file_instead_of_its_directory_is_refused(tmp_path: Path, given: str) -> None:
    """``resume(ckpt, "ckpts/step-000000001000")`` (the checkpoint, not its rotation directory), an archive or a
    plain file found no entries and started fresh without a word: the job trained again from step 0."""
    ckpt = ckpt_for(1000)[0]
    entry = ckpt.save(tmp_path / "step-000000001000", step=1000)
    path: Any = {
        "checkpoint": entry,
        "archive": tdcp.to_archive(entry, tmp_path / "step-000000001000.zip"),
        "file": tmp_path / "notes.txt",
        "store checkpoint": f"memory://resume-slip-{tmp_path.name}/run/step-000000001000",
    }[given]
    if given == "file":
        path.write_text("mine")
    if given == "store checkpoint":
        ckpt.save(path, step=1000)
    kind = "a file" if given == "file" else "a checkpoint"
    with pytest.raises(tdcp.CheckpointError, match=f"is {kind}, not a rotation directory of checkpoints"):
        tdcp.resume(ckpt_for(0)[0], path)
    assert tdcp.resume(ckpt_for(0)[0], tmp_path / "fresh") is None  # (nothing there: a fresh start, as before)
    assert tdcp.resume(ckpt_for(0)[0], tmp_path).step == 1000  # (its directory: resumed)


def test_entries_without_a_manifest_are_no_damaged_ones_a_resume_tries(tmp_path: Path) -> None:
    """A newer step directory without a manifest (a user's, a prune that kept a user's file: reliability.md) was
    tried first and warned about as damaged, and ``fallback=False`` raised: it is no entry. What is said of it is
    that the save of its step will be refused (it is not replaced)."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    rotation.save(ckpt_for(1)[0], step=1)
    (tmp_path / "step-000000000010").mkdir()
    (tmp_path / "step-000000000010" / "eval.txt").write_text("mine")
    _plain_dcp(tmp_path / "step-000000000011", b'{"tool": "mine"}')
    with pytest.warns(tdcp.TorchrlDcpWarning) as heard:
        info = tdcp.resume(ckpt_for(0)[0], tmp_path, fallback=False)
    assert info is not None and info.step == 1
    (said,) = [str(w.message) for w in heard]
    assert "damaged" not in said and "The save of such a step will be refused" in said
    assert "step-000000000010 (" in said and "step-000000000011 (" in said


def test_a_rotation_keeps_a_users_file_named_like_an_archive_entry(tmp_path: Path) -> None:
    """A save of step 5 (directories) unlinked any regular file ``step-5.zip``, a user's text included."""
    (tmp_path / "step-000000000005.zip").write_text("mine")
    tdcp.CheckpointRotation(tmp_path, keep_last=3).save(ckpt_for(5)[0], step=5)
    assert (tmp_path / "step-000000000005.zip").read_text() == "mine"


@pytest.mark.parametrize("archive", [False, True])
def test_a_users_zip_of_a_checkpoint_named_like_an_entry_is_kept(tmp_path: Path, archive: bool) -> None:
    """The user's own (compressed) ZIP of a checkpoint, plus notes, named ``step-5.zip``: its first member is
    ``manifest.json`` as in an archive of ours, so a save of step 5 took it for a damaged one and deleted it."""
    import zipfile

    source = tdcp.DistributedCheckpoint(m=torch.nn.Linear(2, 2)).save(tmp_path / "elsewhere" / "c")
    mine = tmp_path / "run" / "step-000000000005.zip"
    mine.parent.mkdir()
    with zipfile.ZipFile(mine, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in ["manifest.json", *sorted(p.name for p in source.iterdir() if p.name != "manifest.json")]:
            zf.write(source / name, name)
        zf.writestr("my_notes.txt", "lr 3e-4 was better")
    before = mine.read_bytes()
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=3, archive=archive)
    if archive:  # its own archive cannot take the name: refused, the user's file kept
        with pytest.raises(tdcp.CheckpointError):
            rotation.save(ckpt_for(5)[0], step=5)
    else:
        rotation.save(ckpt_for(5)[0], step=5)
    assert mine.read_bytes() == before


def test_a_damaged_newest_archive_entry_is_replaced_by_the_save_of_its_step(tmp_path: Path) -> None:
    """With archives, a truncated newest ``step-5.zip`` was warned about at resume, then every save of step 5 was
    refused ("not a torchrl_dcp checkpoint"), leaving a committed directory beside it."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3, archive=True)
    for step in (4, 5):
        rotation.save(ckpt_for(step)[0], step=step)
    damaged = tmp_path / "step-000000000005.zip"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.warns(tdcp.TorchrlDcpWarning, match="step-000000000005.zip is damaged"):
        assert tdcp.resume(ckpt_for(0)[0], tmp_path).step == 4
    rotation.save(ckpt_for(5)[0], step=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000004.zip", "step-000000000005.zip"]
    tdcp.verify(damaged)


def test_resume_warns_when_it_starts_fresh_because_every_committed_entry_is_damaged(tmp_path: Path) -> None:
    """A job whose every checkpoint is damaged retrains from scratch (and its next saves prune them): that is a
    warning naming them, not a log line no job without logging shows."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2):
        rotation.save(ckpt_for(step)[0], step=step)
        data = tmp_path / f"step-{step:012d}" / "__0_shared.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 1
        data.write_bytes(raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tdcp.resume(ckpt_for(0)[0], tmp_path) is None
    texts = [str(w.message) for w in caught if issubclass(w.category, tdcp.TorchrlDcpWarning)]
    assert any("every committed one is damaged" in t and "step-000000000002" in t for t in texts), texts
    ours = [w.filename for w in caught if issubclass(w.category, tdcp.TorchrlDcpWarning)]
    assert ours and all(f == __file__ for f in ours), ours  # the user's call, not a line of the library


# ---------------------------------------------------------------------- commit order, not step order
def _earlier_run(directory: Path, steps: tuple[int, ...]) -> None:
    """Checkpoints of an earlier run (or of the run before a rollback), committed before anything below."""
    for step in steps:
        ckpt_for(step)[0].save(directory / f"step-{step:012d}", step=step, metadata={"reward": 0.0})


def test_a_checkpoint_saved_by_hand_into_the_directory_is_ordered_after_the_rotations_earlier_saves(
    tmp_path: Path,
) -> None:
    """Probe m1: ``ckpt.save(rotation.path_for(30))`` after the rotation's saves of steps 10 and 20 writes no commit
    counter, and was ordered before every counted entry: ``latest()`` was step 20, a resume took step 20 silently, and
    the next save (``keep_last=2``) pruned step 30. It follows the newest counted commit created before it."""
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.zeros(1)})
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2)
    rotation.save(ckpt, step=10)
    rotation.save(ckpt, step=20)
    ckpt.components["w"]["x"] += 30
    ckpt.save(rotation.path_for(30), step=30)
    assert rotation.latest() == rotation.path_for(30)
    again = tdcp.DistributedCheckpoint(w={"x": torch.zeros(1)})
    assert tdcp.resume(again, tmp_path).step == 30 and again.components["w"]["x"].item() == 30
    rotation.save(ckpt, step=40)
    assert [e.step for e in tdcp.by_commit(rotation.entries())] == [30, 40]
    ckpt.save(rotation.path_for(5), step=5)  # (by hand, after step 40: the newest, whatever its step)
    assert rotation.latest() == rotation.path_for(5)


@pytest.mark.parametrize("archive", [False, True])
@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("stale", [(100,), (100, 200, 300)])
def test_a_higher_stale_step_never_deletes_the_checkpoint_just_saved(
    tmp_path: Path, archive: bool, keep_last: int, stale: tuple[int, ...]
) -> None:
    _earlier_run(tmp_path, stale)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=keep_last, archive=archive)
    saved = []
    for step in (10, 20, 30, 40):
        higher = [e.path.name for e in rotation.entries() if e.step > step]  # left by the earlier run
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            path = rotation.save(ckpt_for(step)[0], step=step)
        stale_warnings = [w for w in record if issubclass(w.category, tdcp.StaleCheckpointWarning)]
        assert len(stale_warnings) == (1 if higher else 0)
        assert all(name in str(stale_warnings[0].message) for name in higher) if higher else True
        assert path.exists() and rotation.latest() == path
        saved.append(path)
        kept = [e.path for e in tdcp.by_commit(rotation.entries())]
        assert len(kept) == min(keep_last, len(stale) + len(saved)) and kept[-1] == path  # newest commits, any step
    assert [p for p in saved if p.exists()] == saved[-keep_last:]
    info = tdcp.resume(ckpt_for(0)[0], tmp_path)
    assert info is not None and info.step == 40


def test_rollback_resumes_from_the_new_commit_and_keep_best_survives(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2, keep_best=("reward", "max"))
    for step, reward in ((10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0)):
        rotation.save(ckpt_for(step)[0], step=step, metadata={"reward": reward})
    # roll back to step 20, train again: step 30 is saved anew (same path), step 40 is now stale
    with pytest.warns(tdcp.StaleCheckpointWarning, match="step-000000000040"):
        path = rotation.save(ckpt_for(31)[0], step=30, metadata={"reward": 0.5})
    assert rotation.latest() == path and rotation.best() == tmp_path / "step-000000000020"
    assert names(tmp_path) == ["step-000000000020", "step-000000000030", "step-000000000040"]
    ckpt, model = ckpt_for(0)
    info = rotation.resume(ckpt)
    assert info is not None and info.step == 30 and torch.equal(model.weight, ckpt_for(31)[1].weight)
    rotation.save(ckpt_for(41)[0], step=40, metadata={"reward": 0.1})  # overwrites the stale one, no warning now
    assert names(tmp_path) == ["step-000000000020", "step-000000000030", "step-000000000040"]


def test_entries_vanishing_while_listed_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from torchrl_dcp.format import manifest as manifest_module

    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        rotation.save(ckpt_for(step)[0], step=step)
    (tmp_path / "step-000000000004").mkdir()  # uncommitted
    original = manifest_module.loads_manifest

    def read_then_vanish(data: bytes, source: object) -> dict:
        out = original(data, source)
        if "step-000000000002" in str(source):  # another process prunes it right after we read its manifest
            shutil.rmtree(tmp_path / "step-000000000002")
        return out

    monkeypatch.setattr(manifest_module, "loads_manifest", read_then_vanish)
    assert rotation.latest() == tmp_path / "step-000000000003"
    monkeypatch.undo()
    ckpt_for(2)[0].save(tmp_path / "step-000000000002", step=2)
    monkeypatch.setattr(manifest_module, "loads_manifest", read_then_vanish)
    assert [e.step for e in rotation.entries(include_uncommitted=True)] == [1, 3, 4]
    monkeypatch.undo()
    ckpt_for(2)[0].save(tmp_path / "step-000000000002", step=2)

    real_iterdir = Path.iterdir

    def listed_then_removed(self: Path):  # the listing is taken, then entries vanish before they are read
        entries = list(real_iterdir(self))
        if self == tmp_path:
            shutil.rmtree(tmp_path / "step-000000000003")
            shutil.rmtree(tmp_path / "step-000000000004")
        return iter(entries)

    monkeypatch.setattr(Path, "iterdir", listed_then_removed)
    assert [e.step for e in rotation.entries(include_uncommitted=True)] == [1, 2]
    monkeypatch.undo()


def test_prune_skips_entries_another_process_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from torchrl_dcp.storage import commit

    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    rotation.save(ckpt_for(1)[0], step=1)
    original = commit.trash_path

    def pruned_elsewhere(path: Path) -> Path:
        if path.exists() and path.name.startswith("step-"):
            shutil.rmtree(path)  # the other process was faster
        return original(path)

    monkeypatch.setattr(commit, "trash_path", pruned_elsewhere)
    path = rotation.save(ckpt_for(2)[0], step=2)
    assert path.exists() and names(tmp_path) == ["step-000000000002"]


def test_listing_reads_each_manifest_once_and_skips_foreign_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from torchrl_dcp.format import manifest as manifest_module

    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        rotation.save(ckpt_for(step)[0], step=step)
    os.mkfifo(tmp_path / "step-000000000007")  # not a directory
    (tmp_path / "step-000000000008.zip").mkdir()  # not a file
    (tmp_path / "step-000000000009").symlink_to(tmp_path / "step-000000000001")  # a link: never ours
    calls: list[str] = []
    original = manifest_module.loads_manifest
    monkeypatch.setattr(manifest_module, "loads_manifest", lambda d, s: calls.append(str(s)) or original(d, s))
    entries = rotation.entries(include_uncommitted=True)
    assert [e.step for e in entries] == [1, 2, 3] and len(calls) == 3


def test_commit_order_does_not_depend_on_the_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later job whose coordinator's clock is an hour behind: its saves are still the newest commits."""
    import datetime as real

    import torchrl_dcp.format.manifest as mf

    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        rotation.save(ckpt, step=step)

    original = real.datetime

    class Behind(original):  # type: ignore[misc, valid-type]
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
            return original.now(tz) - real.timedelta(hours=1)

    monkeypatch.setattr(mf.datetime, "datetime", Behind)
    for step in (40, 50):
        rotation.save(ckpt, step=step)
    assert [e.step for e in rotation.entries()] == [40, 50]
    assert rotation.latest() == rotation.path_for(50)
    assert [tdcp.read_manifest(e.path)["sequence"] for e in rotation.entries()] == [4, 5]


def _uncover_w(md: Any) -> None:
    """DCP metadata in which the tensor ``replicated/state/w`` has no chunk and no record: nothing covers it."""
    md.state_dict_metadata["replicated/state/w"].chunks = []
    for index in [i for i in md.storage_data if i.fqn == "replicated/state/w"]:
        del md.storage_data[index]


@pytest.mark.parametrize("damage", ["truncated data file", "foreign data file", "storage entries resealed uncovered"])
def test_an_entry_damaged_between_its_commit_and_the_prune_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """With ``keep_last=1`` the prune would leave only the new entry: it runs only after that entry passes the checks
    a load runs on its files and storage entries, so a damaged one is refused and the previous entry still resumes.
    (Format 5: a load finds records through the manifest's storage entries; the uncovered tensor is damaged there,
    and in ``.metadata`` alike, everything resealed.)"""
    from tests import forging

    state = {"w": torch.arange(64.0)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1, incremental=False)
    rotation.save(ckpt, step=1)
    other = tdcp.DistributedCheckpoint(state={"w": torch.ones(64)}).save(tmp_path.parent / f"{tmp_path.name}-other")
    original = tdcp.DistributedCheckpoint.save

    def save_then_damage(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(self, path, *args, **kwargs)
        data = out / "__0_shared.distcp"
        if damage == "truncated data file":
            data.write_bytes(data.read_bytes()[:-10])
        elif damage == "foreign data file":  # another save's file, its size and checksum resealed
            data.write_bytes((other / "__0_shared.distcp").read_bytes())
            forging.reseal(out, "__0_shared.distcp")
        else:
            assert forging.forge_metadata(out, _uncover_w)  # the manifest's entries place no bytes for w either
            assert not forging.read_parts(out)["index"]["entries"]
        return out

    monkeypatch.setattr(tdcp.DistributedCheckpoint, "save", save_then_damage)
    state["w"] += 1
    with pytest.raises(tdcp.CheckpointError, match="no older entry was pruned"):
        rotation.save(ckpt, step=2)
    monkeypatch.undo()
    assert 1 in [e.step for e in rotation.entries()]
    fresh = {"w": torch.zeros(64)}
    info = tdcp.resume(tdcp.DistributedCheckpoint(state=fresh), tmp_path)
    assert info.step == 1 and torch.equal(fresh["w"], torch.arange(64.0))


def test_an_entry_whose_metadata_alone_is_damaged_resumes_as_saved_or_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Format 5: loads never read ``.metadata``; damaged alone (resealed, uncovering a tensor) it is no load's
    concern: either the rotation still refuses the entry (prunes nothing, the previous entry resumes) or the entry
    resumes exactly as saved. ``verify``, which reads ``.metadata``, refuses it naming it."""
    import pickle

    from tests import forging
    from torchrl_dcp.storage.filesystem import safe_load_metadata

    state = {"w": torch.arange(64.0)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1, incremental=False)
    rotation.save(ckpt, step=1)
    original = tdcp.DistributedCheckpoint.save
    damaged: list[Path] = []

    def save_then_damage(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(self, path, *args, **kwargs)
        before = forging.read_parts(out)["index"]
        md = safe_load_metadata(out / ".metadata")
        md.state_dict_metadata["replicated/state/w"].chunks = []
        (out / ".metadata").write_bytes(pickle.dumps(md))  # not mirrored: the manifest still places w's record
        forging.reseal(out, ".metadata")
        assert forging.read_parts(out)["index"] == before
        damaged.append(out)
        return out

    monkeypatch.setattr(tdcp.DistributedCheckpoint, "save", save_then_damage)
    state["w"] += 1
    try:
        rotation.save(ckpt, step=2)
        refused = None
    except tdcp.CheckpointError as err:
        refused = err
    monkeypatch.undo()
    with pytest.raises(tdcp.CheckpointError, match="metadata"):
        tdcp.verify(damaged[0])
    fresh = {"w": torch.zeros(64)}
    info = tdcp.resume(tdcp.DistributedCheckpoint(state=fresh), tmp_path)
    if refused is not None:
        assert "no older entry was pruned" in str(refused) and 1 in [e.step for e in rotation.entries()]
        assert info.step == 1 and torch.equal(fresh["w"], torch.arange(64.0))
    else:
        assert info.step == 2 and torch.equal(fresh["w"], torch.arange(64.0) + 1)


def test_a_printed_resume_reads_in_one_line(tmp_path: Path) -> None:
    """Printing tdcp.resume's result dumped the whole manifest; it now says where, which step and what loaded."""
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2))
    tdcp.CheckpointRotation(tmp_path).save(ckpt, step=3)
    info = tdcp.resume(ckpt, tmp_path)
    text = repr(info)
    assert text.startswith("ResumeInfo(step=3, path=") and "loaded=['model']" in text and "\n" not in text
    assert len(text) < 200 and "format_version" not in text
    assert info.loaded == {"model"}  # what the repr shows is an attribute too (it raised AttributeError)
    result = repr(info.result)
    assert result.startswith("LoadResult(path=") and "step=3" in result and "format_version" not in result


def test_an_entry_whose_metric_is_an_integer_past_a_float_is_never_ranked(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A committed entry whose metric is valid JSON but no float (``10**400``, left by a plain save) is not ranked:
    ``best()``, the next rotation save and ``ls --metric`` go on; a rotation save given one refuses it, named."""
    from torchrl_dcp.cli import main

    ckpt = ckpt_for(1)[0]
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3, keep_best=("reward", "max"))
    rotation.save(ckpt, step=1, metadata={"reward": 1.0})
    ckpt.save(tmp_path / "step-000000000002", step=2, metadata={"reward": 10**400})
    assert rotation.best().name == "step-000000000001"
    rotation.save(ckpt, step=3, metadata={"reward": 3.0})
    assert rotation.best().name == "step-000000000003"
    assert main(["ls", str(tmp_path), "--metric", "reward"]) == 0
    with pytest.raises(ValueError, match=r"keep_best needs a finite number in metadata\['reward'\], got 1000.*\.\.\.$"):
        rotation.save(ckpt, step=4, metadata={"reward": 10**400})


@pytest.mark.parametrize("async_saves", [False, True], ids=["sync", "async"])
def test_a_save_that_fails_leaves_its_step_due(tmp_path: Path, async_saves: bool) -> None:
    """``every_steps`` counts from the previous *save*: a due save that raised (a refused metric) is not one, so
    the retry of that step, and the next steps, still save (the failed call moved the count on: nothing was saved
    for a whole interval)."""
    ckpt = ckpt_for(0)[0]
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=5, keep_best=("reward", "max"), async_saves=async_saves)
    with pytest.raises(ValueError, match="keep_best needs a finite number"):
        rotation.maybe_save(ckpt, 5, {"reward": float("nan")})
    assert rotation.maybe_save(ckpt, 5, {"reward": 1.0}) is not None
    rotation.wait()
    assert [rotation.maybe_save(ckpt, s, {"reward": 1.0}) for s in range(6, 10)] == [None] * 4
    assert rotation.maybe_save(ckpt, 10, {"reward": 2.0}) is not None
    rotation.close()
    assert [e.step for e in rotation.entries()] == [5, 10]


def test_resume_over_torchrls_rotation_says_it_starts_fresh(tmp_path: Path) -> None:
    """A run moving from torchrl's ``CheckpointRotation`` to ours, resumed in the same directory: nothing of ours to
    resume from, so it starts fresh, but says so as a warning naming torchrl's entries (it was an INFO line: a job
    could retrain from scratch unnoticed)."""

    from torchrl.checkpoint import Checkpoint
    from torchrl.checkpoint import CheckpointRotation as TorchrlRotation

    TorchrlRotation(tmp_path, keep_last=2).save(Checkpoint(policy=torch.nn.Linear(2, 2)), step=3)
    with pytest.warns(tdcp.TorchrlDcpWarning, match=r"checkpoint-000000000003.*ckpt\.load\(path\)"):
        assert tdcp.resume(ckpt_for(0)[0], tmp_path) is None  # (a warning: a log line shows only with logging set)


def test_steps_as_numpy_integers_or_0d_tensors_are_accepted_as_save_takes_them(tmp_path: Path) -> None:
    """A step counted in NumPy (``np.int64``) or a 0-d integer tensor is a step for the rotation as for
    ``DistributedCheckpoint.save``; it was refused as "not a non-negative integer". Floats, bools and negatives
    stay refused."""
    import numpy as np

    ckpt = ckpt_for(0)[0]
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=1, keep_last=5)
    assert rotation.maybe_save(ckpt, np.int64(3)).name == "step-000000000003"
    assert rotation.save(ckpt, step=torch.tensor(4)).name == "step-000000000004"
    for bad in (-1, 2.0, True, np.float64(5.0)):
        with pytest.raises(ValueError, match="non-negative integer"):
            rotation.maybe_save(ckpt, bad)
    assert [e.step for e in rotation.entries()] == [3, 4]


def test_an_entry_whose_manifest_records_another_step_is_not_resumed_as_its_name_says(tmp_path: Path) -> None:
    """``step-000000000100`` renamed ``step-000000000900`` (no byte changed) resumed with ``ResumeInfo.step == 900``
    while it holds step 100: a job doing ``start = info.step + 1`` skipped 800 steps. An entry is committed only
    when its manifest records the step of its name (or none); others are listed with the reason, not resumed."""
    ckpt = ckpt_for(0)[0]
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    rotation.save(ckpt, step=50)
    path = rotation.save(ckpt, step=100)
    path.rename(tmp_path / "step-000000000900")
    assert [e.step for e in rotation.entries()] == [50]
    (bad,) = [e for e in rotation.entries(include_uncommitted=True) if not e.committed]
    assert bad.step == 900 and "records step 100" in bad.error
    info = rotation.resume(ckpt_for(1)[0])
    assert info is not None and info.step == 50 and info.result.step == 50
    rotation.save(ckpt, step=60)  # pruning never deletes it (not an entry of this rotation)
    assert (tmp_path / "step-000000000900").is_dir()
    (tmp_path / "alone").mkdir()
    (tmp_path / "step-000000000900").rename(tmp_path / "alone" / "step-000000000900")
    with pytest.warns(tdcp.TorchrlDcpWarning, match="no usable checkpoint.*step-000000000900.*records step 100"):
        assert tdcp.resume(ckpt_for(2)[0], tmp_path / "alone") is None  # starts fresh, but never silently


def test_an_entry_that_lost_its_manifest_is_warned_about_at_resume_and_named_at_its_save(tmp_path: Path) -> None:
    """``step-30`` lost its ``manifest.json`` (a partial copy): resume took step 20 without a word, and the save of
    step 30 failed hours later with "choose another path", which a rotation's user cannot do."""
    policy = torch.nn.Linear(4, 2)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=10, keep_last=3)
    for step in (10, 20, 30):
        rotation.maybe_save(ckpt, step)
    (tmp_path / "step-000000000030" / "manifest.json").unlink()
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=10, keep_last=3)
    with pytest.warns(tdcp.TorchrlDcpWarning, match=r"step-000000000030 \(CheckpointFormatError.*no manifest.json"):
        info = rotation.resume(ckpt)
    assert info.step == 20
    with pytest.raises(tdcp.CheckpointError, match="it holds no manifest.json.*move it elsewhere, then save again"):
        rotation.maybe_save(ckpt, 30)
    assert sorted(p.name for p in (tmp_path / "step-000000000030").iterdir())  # its files kept


def test_a_link_named_like_a_newer_entry_is_warned_about_at_resume_and_named_at_its_save(tmp_path: Path) -> None:
    """``step-9`` a link to a checkpoint elsewhere: resume took step 3 without a word, ``ls`` showed nothing, and the
    save of step 9 said "exists and is not a torchrl_dcp checkpoint" (it is a link to one). Never written through."""
    policy = torch.nn.Linear(4, 2)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    elsewhere = ckpt.save(tmp_path / "backup")
    rotation = tdcp.CheckpointRotation(tmp_path / "run", every_steps=3, keep_last=3)
    rotation.maybe_save(ckpt, 3)
    (tmp_path / "run" / "step-000000000009").symlink_to(elsewhere)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", every_steps=3, keep_last=3)
    with pytest.warns(tdcp.TorchrlDcpWarning, match=r"step-000000000009 \(a symbolic link\)"):
        assert rotation.resume(ckpt).step == 3
    rotation.maybe_save(ckpt, 6)
    with pytest.raises(tdcp.CheckpointError, match="is a symbolic link: a save never writes through a link"):
        rotation.maybe_save(ckpt, 9)
    assert (tmp_path / "run" / "step-000000000009").is_symlink() and tdcp.verify(elsewhere)


def test_a_directory_save_keeps_an_archive_of_its_name_recording_another_step(tmp_path: Path) -> None:
    """The save of step 7 as a directory removed ``step-...7.zip``, an archive of ours recording step 3 (renamed by
    hand), which the listing calls "renamed, not this rotation's entry" and pruning leaves alone."""
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.zeros(2)})
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    three = rotation.save(ckpt, step=3)
    renamed = tmp_path / "step-000000000007.zip"
    tdcp.to_archive(three, renamed)
    rotation.save(ckpt, step=7)
    assert renamed.is_file() and tdcp.read_manifest(renamed)["step"] == 3
    assert (tmp_path / "step-000000000007").is_dir()


def test_a_resume_names_what_newer_steps_a_save_will_refuse_to_replace(tmp_path: Path) -> None:
    """Entries newer than the step resumed that a save of their step refuses to replace are warned about at the
    resume: a directory of the user's, a link, and a plain file named like a step directory (that one was not:
    the save of its step failed later, "is a file, not a checkpoint directory")."""
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.zeros(2)})
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    rotation.save(ckpt, step=1)
    (tmp_path / "step-000000000002").mkdir()
    (tmp_path / "step-000000000002" / "notes.txt").write_text("mine")
    (tmp_path / "step-000000000003").symlink_to(tmp_path / "step-000000000002")
    (tmp_path / "step-000000000004").write_text("mine too")
    with pytest.warns(tdcp.TorchrlDcpWarning, match="holds entries newer than step 1") as caught:
        assert tdcp.CheckpointRotation(tmp_path, keep_last=5).resume(ckpt).step == 1
    said = " ".join(str(w.message) for w in caught)
    assert "step-000000000002" in said and "a symbolic link" in said and "a file, not a checkpoint directory" in said
    # nothing to resume (probe c2): the link was said nowhere, and the job failed at that step's save
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "step-000000000003").symlink_to(tmp_path / "step-000000000002")
    with pytest.warns(tdcp.TorchrlDcpWarning, match="holds entries that are not checkpoints") as caught:
        assert tdcp.CheckpointRotation(fresh, keep_last=5).resume(ckpt) is None
    assert "step-000000000003 (a symbolic link)" in " ".join(str(w.message) for w in caught)
