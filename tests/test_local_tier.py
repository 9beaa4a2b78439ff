"""The node-local tier in one process: schedule, retention, resume order between tiers, what it refuses.

Replicas and peers need several ranks on several nodes: ``tests_distributed/test_recovery.py``.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.local_nodes import NodeLayout


def _job(seed: int = 0) -> tuple[tdcp.DistributedCheckpoint, torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer)
    ckpt.register("rng", tdcp.RNGState())
    ckpt.register("counter", {"steps": 0}, placement="per_rank")
    return ckpt, model, optimizer


def _step(model: torch.nn.Linear, optimizer: torch.optim.Adam, ckpt: tdcp.DistributedCheckpoint) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ckpt.components["counter"]["steps"] += 1


def _rotation(tmp_path: Path, every: int = 2, shared_every: int = 10, **kw: object) -> tdcp.CheckpointRotation:
    local = tdcp.LocalTier(tmp_path / "local", every_steps=every, **kw)  # type: ignore[arg-type]
    return tdcp.CheckpointRotation(tmp_path / "shared", every_steps=shared_every, keep_last=2, local=local)


def _train(ckpt, model, optimizer, rotation, start: int, stop: int) -> None:  # type: ignore[no-untyped-def]
    for step in range(start + 1, stop + 1):
        _step(model, optimizer, ckpt)
        rotation.maybe_save(ckpt, step)


def test_layout_sends_each_replica_to_another_node_and_spreads_them() -> None:
    two = NodeLayout(("a", "a", "b", "b"))
    assert [two.targets(r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert [two.sources(r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert [two.leader(r) for r in range(4)] == [True, False, True, False]
    three = NodeLayout(("a", "a", "b", "c", "c", "c"))
    assert three.targets(5, 2) == [0, 2]  # third of node c: to node a (modulo its 2 ranks), then node b
    assert all(three.nodes[t] != three.nodes[r] for r in range(6) for t in three.targets(r, 5))
    assert len(three.targets(0, 5)) == 2  # capped at the other nodes
    assert NodeLayout(("a", "a")).targets(0, 1) == []


@pytest.mark.parametrize(
    "kwargs", [{"every_steps": 0}, {"every_steps": True}, {"every_steps": 2, "keep_last": 0},
               {"every_steps": 2, "replicas": -1}, {"every_steps": 2.5}],
)  # fmt: skip
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="LocalTier"):
        tdcp.LocalTier(tmp_path, **kwargs)


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_a_local_tier_overlapping_the_rotation_directory_is_refused_when_built(tmp_path: Path, where: str) -> None:
    """Both tiers name entries step-N: sharing a directory failed the first shared save with "exists and is not a
    torchrl_dcp checkpoint", pointing at nothing, and resume warned about entries without a manifest."""
    shared = tmp_path / "run"
    local = {"same": shared, "inside": shared / "local", "around": tmp_path}[where]
    with pytest.raises(ValueError, match="overlap"):
        tdcp.CheckpointRotation(shared, local=tdcp.LocalTier(local, every_steps=2))
    tdcp.CheckpointRotation(shared, local=tdcp.LocalTier(tmp_path / "node", every_steps=2))  # apart: fine


def test_an_object_store_url_is_not_a_local_tier() -> None:
    with pytest.raises(ValueError, match="node's own storage"):
        tdcp.LocalTier("s3://bucket/run", every_steps=2)
    with pytest.raises(TypeError, match="LocalTier"):
        tdcp.CheckpointRotation("/tmp/x", local="/dev/shm/x")


def test_local_saves_follow_their_schedule_and_keep_last(tmp_path: Path) -> None:
    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=3, keep_last=2)
    _train(ckpt, model, optimizer, rotation, 0, 16)
    assert rotation.local.steps() == [12, 15]
    assert [e.step for e in rotation.entries()] == [10]
    part = tmp_path / "local" / "step-000000000015" / "rank-00000"
    manifest = tdcp.read_manifest(part)
    assert manifest["world_size"] == 1 and manifest["step"] == 15
    assert sorted(manifest["components"]) == ["counter", "model", "optimizer", "rng"]


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_a_node_never_holds_more_than_keep_last_steps_the_one_written_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_last: int
) -> None:
    """recovery.md, Sizing: a node holds ``keep_last`` steps, the one being written included (``keep_last=2`` keeps
    one while the next is written). Steps were pruned only after the next one committed: a tier sized by the doc
    ran out of room at its third save. A failed save's leftovers go before the next one too."""
    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=1, shared_every=100, keep_last=keep_last)
    tier = rotation.local
    seen: list[list[int]] = []
    original = tdcp.DistributedCheckpoint.save

    def recording_save(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if tmp_path / "local" in Path(path).parents:
            seen.append(tier.steps_on_disk())
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(tdcp.DistributedCheckpoint, "save", recording_save)
    (tmp_path / "local" / "step-000000000002").mkdir(parents=True)  # a failed save's leftover (no record)
    _train(ckpt, model, optimizer, rotation, 0, 6)
    assert all(len(steps) <= keep_last for steps in seen), seen
    assert [len(steps) for steps in seen][-1] == keep_last
    assert tier.steps() == list(range(7 - keep_last, 7))


def test_a_failed_local_save_warns_and_the_shared_save_due_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local save that fails (here a full tier) no longer stops the job: a ``LocalTierWarning`` says why, and the
    shared save due at that step is made."""
    import errno

    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=1, shared_every=2)
    original = tdcp.DistributedCheckpoint.save

    def full(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if tmp_path / "local" in Path(path).parents and kwargs.get("step") == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(tdcp.DistributedCheckpoint, "save", full)
    with pytest.warns(tdcp.LocalTierWarning, match="step 2 was not saved to the local tier .*file system is full"):
        _train(ckpt, model, optimizer, rotation, 0, 3)
    assert [e.step for e in rotation.entries()] == [2]
    assert rotation.local.steps() == [1, 3]


def test_resume_from_the_local_tier_continues_bit_exactly(tmp_path: Path) -> None:
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 12, shared 10
    torch.randn(3)  # the interrupted run's RNG moves on: a resume must not keep that
    ckpt2, model2, optimizer2 = _job(seed=1)
    rotation2 = _rotation(tmp_path)
    info = rotation2.resume(ckpt2)
    assert (info.step, info.tier) == (12, "local")
    assert info.path == tmp_path / "local" / "step-000000000012" / "rank-00000"
    assert "tier='local'" in repr(info)
    _train(ckpt2, model2, optimizer2, rotation2, 12, 20)

    ckpt3, model3, optimizer3 = _job()
    _train(ckpt3, model3, optimizer3, _rotation(tmp_path / "ref"), 0, 20)
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), model3.state_dict().values()))
    assert ckpt2.components["counter"] == ckpt3.components["counter"] == {"steps": 20}
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())


def test_a_newer_shared_step_wins_and_newer_local_steps_are_dropped_after_it(tmp_path: Path) -> None:
    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=4)
    _train(ckpt, model, optimizer, rotation, 0, 11)  # local 4, 8; shared 10
    info = _rotation(tmp_path, every=4).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "shared")
    assert rotation.local.steps() == [4, 8]  # older than the step restored: kept

    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path / "b", every=4)
    _train(ckpt, model, optimizer, rotation, 0, 13)  # local 8, 12; shared 10
    for entry in (tmp_path / "b" / "local").iterdir():
        (entry / "rank-00000.commit.json").unlink()  # the tier holds parts but no committed step
    info = _rotation(tmp_path / "b", every=4).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "shared")
    assert rotation.local.steps_on_disk() == [8]  # step 12 came after the step restored: dropped


def test_the_tiers_are_ordered_by_commit_not_by_step(tmp_path: Path) -> None:
    """A shared entry committed after the local tier's newest step, at a lower step (a roll-back saved by hand), is
    the newest: compared by step, the local step 12 was resumed over it. Each local step's records name the newest
    shared commit the job knew of when it saved the step."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 10, 12 (after shared 10's commit); shared 10
    records = [json.loads(r.read_text()) for r in sorted((tmp_path / "local").glob("step-*/rank-00000.commit.json"))]
    assert [(r["step"], r["shared_sequence"]) for r in records] == [(10, 1), (12, 1)]  # (10: made with the shared)
    assert _rotation(tmp_path).resume(_job(1)[0]).tier == "local"
    for step in (8, 12):  # a roll-back saved after local step 12, below it or at it (probe m5: the local copy won)
        rolled, _, _ = _job(seed=3)
        rolled.components["counter"]["steps"] = step
        tdcp.CheckpointRotation(tmp_path / "shared", keep_last=3).save(rolled, step=step)
        ckpt2 = _job(1)[0]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            info = _rotation(tmp_path).resume(ckpt2)
        assert (info.step, info.tier) == (step, "shared")
        assert ("steps [10, 12] were removed" in " ".join(str(w.message) for w in said)) == (step == 8)
        assert ckpt2.components["counter"] == {"steps": step}
        _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # (the local steps again, after the roll-back)


@pytest.mark.parametrize("value", ["1", -2, 1.5, True, None, 5])
def test_a_record_naming_no_valid_shared_commit_is_damaged(tmp_path: Path, value: object) -> None:
    """A record whose ``shared_sequence`` is no commit counter, or not the one its part's manifest names (probe m5:
    edited from 1 to 5, a stale step was resumed over the shared tier's newer commits), is damaged."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 10, 12; shared 10
    record = tmp_path / "local" / "step-000000000012" / "rank-00000.commit.json"
    forged = json.loads(record.read_text())
    forged["shared_sequence"] = value
    record.write_text(json.dumps(forged))
    ckpt2 = _job(1)[0]
    says = "its manifest names shared commit 1, its commit record 5" if value == 5 else "its commit record is not"
    with pytest.warns(tdcp.LocalTierWarning, match=f"step 12 rank 0's part: {says}"):
        info = _rotation(tmp_path).resume(ckpt2)
    assert (info.step, info.tier) == (10, "local")  # (the same step as the shared entry's: its local copy)


def test_a_job_restarted_through_a_link_to_its_shared_directory_resumes_its_local_tier(tmp_path: Path) -> None:
    """Probe l1: a part's record named the shared directory as spelled, so a restart through a link to it (or back)
    took the tier for another job's: it resumed the older shared step and dropped the newer local one."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 12, shared 10
    (tmp_path / "link").symlink_to(tmp_path / "shared")
    through = tdcp.CheckpointRotation(
        tmp_path / "link", every_steps=10, keep_last=2, local=tdcp.LocalTier(tmp_path / "local", every_steps=2)
    )
    info = through.resume(_job(1)[0])
    assert (info.step, info.tier) == (12, "local")
    assert 12 in through.local.steps_on_disk()


def test_a_rotation_through_a_link_to_nothing_says_to_create_its_target(tmp_path: Path) -> None:
    """Probe l1: a rotation whose directory is a link to a directory not made yet failed its first save with
    "something already exists at this path ... choose another path": the link's target is named, and what to do."""
    (tmp_path / "link").symlink_to(tmp_path / "not-yet")
    ckpt, model, optimizer = _job()
    with pytest.raises(tdcp.CheckpointError, match="is a link to .*not-yet, which does not exist: create that"):
        tdcp.CheckpointRotation(tmp_path / "link").save(ckpt, step=1)
    (tmp_path / "not-yet").mkdir()
    tdcp.CheckpointRotation(tmp_path / "link").save(ckpt, step=1)


def test_a_tier_of_another_job_is_ignored_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)
    other = tdcp.CheckpointRotation(tmp_path / "other-run", local=tdcp.LocalTier(tmp_path / "local", every_steps=2))
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"):
        assert other.resume(_job(1)[0]) is None
    assert "another job" in caplog.text


def test_a_forged_or_damaged_part_falls_back_to_the_previous_local_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)
    part = tmp_path / "local" / "step-000000000012" / "rank-00000"
    data = max((p for p in part.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # the manifest's checksum no longer matches
    with caplog.at_level(logging.WARNING, logger="torchrl_dcp"):
        info = _rotation(tmp_path).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "local")  # the local step before it (the shared tier's newest: not older)
    assert "could not be restored" in caplog.text

    _train(ckpt, model, optimizer, _rotation(tmp_path / "b"), 0, 13)
    record = tmp_path / "b" / "local" / "step-000000000012" / "rank-00000.commit.json"
    forged = json.loads(record.read_text())
    forged["manifest_sha256"] = "0" * 64  # names another manifest than the part's
    record.write_text(json.dumps(forged))
    info = _rotation(tmp_path / "b").resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "local")  # step 12 is not committed any more: the local step before it


def test_a_record_resealed_over_another_steps_part_is_not_that_step(tmp_path: Path) -> None:
    """Step 12's part replaced by step 10's honest part, its record's ``manifest_sha256`` resealed: resume reported
    step 12 and restored step 10's state. The part's manifest (its step, the rank its save recorded) must say what
    the record says."""
    import shutil

    from torchrl_dcp.local_records import manifest_digest

    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 10, 12
    local = tmp_path / "local"
    part = local / "step-000000000012" / "rank-00000"
    shutil.rmtree(part)
    shutil.copytree(local / "step-000000000010" / "rank-00000", part)
    record = local / "step-000000000012" / "rank-00000.commit.json"
    forged = json.loads(record.read_text())
    forged["manifest_sha256"] = manifest_digest(part)
    record.write_text(json.dumps(forged))
    ckpt2 = _job(1)[0]
    with pytest.warns(tdcp.TorchrlDcpWarning, match="holds step 10 of rank 0, its commit record step 12"):
        info = _rotation(tmp_path).resume(ckpt2)
    assert (info.step, info.tier) == (10, "local")
    assert ckpt2.components["counter"] == {"steps": 10}


def test_a_newer_step_that_cannot_be_removed_leaves_the_step_restored_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only tier holding a killed save's newer step: its removal failed (EROFS), so the complete step 12 was
    given up, the shared step loaded, and then the same removal raised after the objects had changed; every later
    resume did the same. The removal is a clean-up: warned about, the step restored kept."""
    import errno

    from torchrl_dcp.local_tier import LocalTier

    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)  # local 10, 12; shared 10
    (tmp_path / "local" / "step-000000000014" / "rank-00000").mkdir(parents=True)  # a killed save's, no record

    def read_only(self: LocalTier, step: int) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(LocalTier, "_remove_step", read_only)
    ckpt2 = _job(1)[0]
    with pytest.warns(tdcp.LocalTierWarning, match="step 14, newer than the step 12 .*could not be removed"):
        info = _rotation(tmp_path).resume(ckpt2)
    assert (info.step, info.tier) == (12, "local") and ckpt2.components["counter"] == {"steps": 12}


def test_a_part_whose_directory_is_gone_is_said_whole_with_what_is_resumed_instead(tmp_path: Path) -> None:
    """The warning cut the part's error at 200 characters, mid-sentence, dropping its advice ("... disappeared or
    )"), and did not say what is resumed instead."""
    import shutil

    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 13)
    shutil.rmtree(tmp_path / "local" / "step-000000000012" / "rank-00000")
    with pytest.warns(tdcp.LocalTierWarning) as caught:
        info = _rotation(tmp_path).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "local")
    (said,) = [str(w.message) for w in caught if "parts found damaged do not count" in str(w.message)]
    assert "step 12 rank 0's part: its manifest cannot be read" in said
    assert "does not exist (another process may have removed it))" in said and "older local step" in said


def test_a_link_planted_as_a_step_directory_is_neither_a_step_nor_written_through(tmp_path: Path) -> None:
    ckpt, model, optimizer = _job()
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "step-000000000002").symlink_to(victim)
    rotation = _rotation(tmp_path)
    with pytest.warns(tdcp.LocalTierWarning, match="not a directory"):
        _train(ckpt, model, optimizer, rotation, 0, 2)
    assert list(victim.iterdir()) == []
    assert rotation.local.steps_on_disk() == []


def test_a_link_in_place_of_the_tier_directory_is_refused_and_nothing_is_written_through_it(tmp_path: Path) -> None:
    """recovery.md: the tier's directory must be a real directory. A link planted there was followed: steps were
    saved into (and resumed from, and pruned in) the directory it points to."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step-000000000009").mkdir()  # what a prune through the link would have deleted
    (tmp_path / "tier").symlink_to(elsewhere)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
    rotation = tdcp.CheckpointRotation(
        tmp_path / "shared", every_steps=100, local=tdcp.LocalTier(tmp_path / "tier", every_steps=1)
    )
    with pytest.warns(tdcp.LocalTierWarning, match="link or a file was put in its place"):
        rotation.maybe_save(ckpt, 1)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["step-000000000009"]
    assert rotation.local.steps() == [] and rotation.resume(ckpt) is None


@pytest.mark.parametrize("inside", ["", "a9/t"])
def test_a_tier_inside_a_checkpoint_is_refused_before_anything_is_made_there(tmp_path: Path, inside: str) -> None:
    """A tier placed in a committed checkpoint was refused only after its step directory was made there: the
    checkpoint then held an entry its manifest does not list, and no longer verified."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
    committed = ckpt.save(tmp_path / "ckpt")
    before = sorted(p.name for p in committed.iterdir())
    rotation = tdcp.CheckpointRotation(
        tmp_path / "shared", every_steps=100, local=tdcp.LocalTier(committed / inside, every_steps=1)
    )
    with pytest.warns(tdcp.LocalTierWarning, match="is inside the checkpoint"):
        rotation.maybe_save(ckpt, 1)
    assert sorted(p.name for p in committed.iterdir()) == before
    tdcp.verify(committed)


def test_a_users_rank_directory_of_plain_dcp_files_is_never_pruned(tmp_path: Path) -> None:
    """recovery.md: a ``rank-<R>`` directory of the user's (no checkpoint in it) under a step name stays. One holding
    a plain ``dcp.save`` checkpoint was taken for a damaged part of ours and deleted by the prune."""
    import torch.distributed.checkpoint as dcp

    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=1, keep_last=1)
    user = tmp_path / "local" / "step-000000000001" / "rank-00000"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(user), no_dist=True)
    names = sorted(p.name for p in user.iterdir())
    _train(ckpt, model, optimizer, rotation, 1, 3)
    assert sorted(p.name for p in user.iterdir()) == names


def test_steps_of_more_than_12_digits_are_listed_resumed_and_pruned(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, policy=model)
    local = tdcp.LocalTier(tmp_path / "local", every_steps=1, keep_last=1)
    rotation = tdcp.CheckpointRotation(tmp_path / "shared", every_steps=10**15, keep_last=1, local=local)
    big = 10**12
    for step in range(big - 1, big + 2):
        torch.nn.init.constant_(model.weight, float(step % 100))
        rotation.maybe_save(ckpt, step)
    rotation.close()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [f"step-{big + 1}"]
    fresh = torch.nn.Linear(2, 2)
    again = tdcp.CheckpointRotation(
        tmp_path / "shared", every_steps=10**15, keep_last=1, local=tdcp.LocalTier(tmp_path / "local", every_steps=1)
    )
    info = again.resume(tdcp.DistributedCheckpoint(no_dist=True, policy=fresh))
    assert info is not None and info.step == big + 1 and torch.equal(fresh.weight, model.weight)


def test_directories_it_did_not_write_are_never_removed(tmp_path: Path) -> None:
    """A ``step-<N>/rank-<R>`` directory holding the user's files (no manifest: not a part) is left where it is,
    newer or older than the steps saved, as the shared tier leaves a directory that is not a checkpoint; the tier's
    own parts of those steps go, and so does a stale lock of a part (a killed save's: its flock is free)."""
    tier = tmp_path / "tier"
    for step in (8, 1):
        user = tier / f"step-{step:012d}" / "rank-00000"
        user.mkdir(parents=True)
        (user / "notes.txt").write_text("the user's")
    (tier / f"step-{1:012d}" / ".rank-00001.tdcp-lock").write_text("")
    (tier / f"step-{1:012d}" / "rank-00009.commit.json").mkdir()  # a directory named as a record: not one
    ckpt, model, optimizer = _job()
    rotation = tdcp.CheckpointRotation(
        tmp_path / "shared", every_steps=100, local=tdcp.LocalTier(tier, every_steps=2, keep_last=1)
    )
    for step in range(2, 8):  # (a save of step 8 would refuse to replace the user's directory, as the shared tier)
        rotation.maybe_save(ckpt, step)
    rotation.close()
    for step in (8, 1):
        assert (tier / f"step-{step:012d}" / "rank-00000" / "notes.txt").read_text() == "the user's"
    assert not (tier / f"step-{1:012d}" / ".rank-00001.tdcp-lock").exists()
    assert (tier / f"step-{1:012d}" / "rank-00009.commit.json").is_dir()
    assert not (tier / f"step-{2:012d}").exists() and not (tier / f"step-{4:012d}").exists()  # its own: pruned
    assert (tier / f"step-{6:012d}" / "rank-00000" / "manifest.json").exists()


def test_a_pruned_step_leaves_nothing_of_its_own_behind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What killed saves leave in a step directory (a commit record's temporary, a part's lock, DCP's metadata
    temporary in a part) kept the step directory for good; a user's file put into a part kept the part's own files
    too. Pruned now: everything of the tier's removed, the user's file kept and logged."""
    ckpt, model, optimizer = _job()
    rotation = _rotation(tmp_path, every=2, keep_last=1)
    _train(ckpt, model, optimizer, rotation, 0, 2)
    step = tmp_path / "local" / "step-000000000002"
    (step / f".rank-00000.commit.json.tmp-{'a' * 32}").write_text("{")
    (step / ".rank-00000.tdcp-lock").write_text("")
    (step / "rank-00000" / ".metadata.tmp").write_bytes(b"\x80")
    (step / "rank-00000" / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING):
        _train(ckpt, model, optimizer, rotation, 2, 4)
    assert rotation.local.steps() == [4]
    assert sorted(str(p.relative_to(step)) for p in step.rglob("*")) == ["rank-00000", "rank-00000/notes.txt"]
    assert "notes.txt" in caplog.text


def test_a_tier_that_keeps_failing_is_tried_on_its_schedule_only(tmp_path: Path) -> None:
    """After a failed local save, the tier was tried (and warned about) at every following step: ``last_step`` moved
    only when a save succeeded. A try counts: the next comes ``every_steps`` later."""
    import warnings

    ckpt, model, optimizer = _job()
    (tmp_path / "local").write_text("a file where the tier should be")
    rotation = _rotation(tmp_path, every=3, shared_every=100)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        _train(ckpt, model, optimizer, rotation, 0, 7)
    tried = [str(w.message).split(" was not saved")[0] for w in heard if w.category is tdcp.LocalTierWarning]
    assert tried == ["rank 0: step 3", "rank 0: step 6"]


def test_removing_a_tree_under_a_file_finds_nothing(tmp_path: Path) -> None:
    """A file where a parent directory should be (a tier path planted as a file): ``remove_tree`` raised a bare
    ``NotADirectoryError``, which stopped a rank from draining the replicas sent to it (its peers then waited for
    the collective timeout)."""
    from torchrl_dcp.storage.commit import remove_tree

    (tmp_path / "f").write_text("x")
    assert remove_tree(tmp_path / "f" / "staging") == []
    assert (tmp_path / "f").read_text() == "x"


def test_a_damaged_local_step_is_warned_about_before_an_older_step_resumes(tmp_path: Path) -> None:
    """A local step that cannot be restored (one flipped byte) sent the resume to the shared tier with only a log
    record, which the library's null handler hides: the newer local step was lost unseen, where a damaged shared
    entry is warned about."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 12)  # local 12, shared 10
    part = tmp_path / "local" / "step-000000000012" / "rank-00000" / "__0_shared.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    with pytest.warns(tdcp.LocalTierWarning, match=r"step 12 could not be restored: rank 0's part .*__0_shared.distcp"):
        info = _rotation(tmp_path).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "local")  # the local step 10 (not older than the shared tier's 10)

    for step in (10, 12):  # every local step damaged: the shared tier, said
        part = tmp_path / "local" / f"step-{step:012d}" / "rank-00000" / "__0_shared.distcp"
        if part.exists():
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 1
            part.write_bytes(bytes(data))
    with pytest.warns(tdcp.LocalTierWarning, match=r"step 10 could not be restored: .*the shared tier is next"):
        info = _rotation(tmp_path).resume(_job(1)[0])
    assert (info.step, info.tier) == (10, "shared")


def test_a_local_step_refused_but_for_damage_is_kept_when_the_shared_tier_has_nothing(tmp_path: Path) -> None:
    """A component registered since the local saves: the local load is refused (not damage), the shared tier holds
    nothing yet, and the resume started fresh and deleted every local step, the job's only checkpoints."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 5)  # local steps 2 and 4, no shared one (every 10)
    later, _, _ = _job(1)
    later.register("extra", {"seen": 0}, placement="per_rank")
    rotation = _rotation(tmp_path)
    with pytest.warns(tdcp.LocalTierWarning, match="the shared tier is next"):
        with pytest.raises(tdcp.IncompatibleComponentError, match="missing \\['extra'\\]") as err:
            rotation.resume(later)
    assert "the local tier's steps are kept" in str(err.value) and str(tmp_path / "local") in str(err.value)
    assert rotation.local.steps() == [2, 4]
    info = _rotation(tmp_path).resume(_job(1)[0])  # the job as it saved: resumes the local step
    assert (info.step, info.tier) == (4, "local")


def test_fallback_false_raises_on_a_damaged_local_step_and_keeps_the_tier(tmp_path: Path) -> None:
    """``resume(fallback=False)`` raises instead of skipping a damaged entry (docs/api.md): the local tier passed
    over its damaged step to an empty shared tier, started fresh and deleted the damaged part with the others."""
    ckpt, model, optimizer = _job()
    _train(ckpt, model, optimizer, _rotation(tmp_path), 0, 5)
    part = tmp_path / "local" / "step-000000000004" / "rank-00000"
    data = max(part.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    rotation = _rotation(tmp_path)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="step 4 could not be restored from any copy") as err:
        rotation.resume(_job(1)[0], fallback=False)
    assert data.name in str(err.value) and "pass fallback=True" in str(err.value)
    assert rotation.local.steps() == [2, 4]
    with pytest.warns(tdcp.LocalTierWarning, match="step 2 is next"):
        info = _rotation(tmp_path).resume(_job(1)[0])  # the default falls back, saying so
    assert (info.step, info.tier) == (2, "local")


@pytest.mark.parametrize("damaged", ["record", "manifest"])
def test_a_part_whose_json_is_nested_too_deeply_is_passed_over_with_a_warning(tmp_path: Path, damaged: str) -> None:
    """A commit record (under its size limit, nothing resealed) or a part's manifest (its digest resealed in the
    record) of deeply nested JSON: ``json.loads`` raised ``RecursionError``, which failed the whole resume ("listing
    the local tier ... failed"), naming no file; the part is passed over like any damaged one, the older step taken."""
    import hashlib
    import json

    def rotation() -> tdcp.CheckpointRotation:
        local = tdcp.LocalTier(tmp_path / "local", every_steps=1)
        return tdcp.CheckpointRotation(tmp_path / "shared", every_steps=100, keep_last=2, local=local)

    policy = torch.nn.Linear(4, 2)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    saving = rotation()
    for step in (1, 2, 3):
        with torch.no_grad():
            policy.weight.fill_(step)
        saving.maybe_save(ckpt, step)
    saving.close()
    step_dir = tmp_path / "local" / "step-000000000003"
    record = step_dir / "rank-00000.commit.json"
    if damaged == "record":
        record.write_bytes(b"[" * 30_000 + b"]" * 30_000)
    else:
        data = b"[" * 100_000 + b"]" * 100_000
        (step_dir / "rank-00000" / "manifest.json").write_bytes(data)
        body = json.loads(record.read_bytes())
        body["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        record.write_text(json.dumps(body))
    with torch.no_grad():
        policy.weight.zero_()
    with pytest.warns(tdcp.LocalTierWarning):
        info = rotation().resume(ckpt)
    assert (info.step, info.tier) == (2, "local") and torch.all(policy.weight == 2)


def test_a_local_save_is_made_when_the_shared_save_of_its_step_refuses_its_metric(tmp_path: Path) -> None:
    """Probe m7: with the local save made after the shared save chose its counter, a ``keep_best`` metric refused
    at a step both tiers were due left the tier without that step (and off its schedule). The local tier saves
    first, as documented."""
    ckpt, model, optimizer = _job()
    local = tdcp.LocalTier(tmp_path / "local", every_steps=2)
    rotation = tdcp.CheckpointRotation(tmp_path / "shared", every_steps=4, keep_best=("reward", "max"), local=local)
    for step in range(1, 11):
        _step(model, optimizer, ckpt)
        if step == 8:
            with pytest.raises(ValueError, match="keep_best needs a finite number"):
                rotation.maybe_save(ckpt, step, {"loss": 1.0})
        else:
            rotation.maybe_save(ckpt, step, {"reward": float(step)})
    rotation.close()
    assert local.steps() == [8, 10] and [e.step for e in rotation.entries()] == [4, 9]


def test_a_shared_save_that_fails_before_its_counter_never_lets_an_older_local_step_win(tmp_path: Path) -> None:
    """Probe m9: local step 4 named the commit the shared save of step 4 would make; that save raised the previous
    async save's failure before choosing its counter, and the next shared save (step 5) took that very counter:
    a resume took local step 4 over shared step 5, committed after it. The local step's counter is taken then."""

    def rotation() -> tdcp.CheckpointRotation:
        local = tdcp.LocalTier(tmp_path / "local", every_steps=4)
        return tdcp.CheckpointRotation(tmp_path / "shared", every_steps=2, keep_last=3, async_saves=True, local=local)

    ckpt, model, optimizer = _job()
    blocked = tmp_path / "shared" / f"step-{2:012d}"
    blocked.mkdir(parents=True)
    (blocked / "notes.txt").write_text("a user's file: the save of step 2 fails")
    first = rotation()
    for step in range(1, 6):
        _step(model, optimizer, ckpt)
        try:
            first.maybe_save(ckpt, step)
        except tdcp.CheckpointError as err:  # (step 4: step 2's failure, raised at the next save)
            assert step == 4 and "refusing to replace it" in str(err), (step, err)
    first.close()
    assert first.local.steps() == [4] and [e.step for e in first.entries()] == [5]
    ckpt2 = _job(1)[0]
    info = rotation().resume(ckpt2)
    assert (info.step, info.tier) == (5, "shared") and ckpt2.components["counter"] == {"steps": 5}
