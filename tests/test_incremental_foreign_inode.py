"""Incremental saves never hard-link into the new checkpoint an inode someone else controls.

Whoever can write the base checkpoint's directory can replace a chunk file by a hard link to a
file of their own holding the same bytes: the read proves the content, but linking that inode
would let its owner rewrite the new, committed checkpoint from outside it at any time. Such a
file (another owner, writable by group or others, a name outside our checkpoints) is copied into
the new checkpoint instead; the save still commits and loads exactly. Files of a rotation, which
share inodes between its entries, are still linked after a restart.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests.test_incremental import (
    assert_same_checkpoint,
    base_and_buffer,
    chunk_files,
    fill,
    kept_files,
    make_buffer,
    samples,
    small_chunks,  # noqa: F401 - the autouse fixture: chunk files of a few KiB
)
from torchrl_dcp.storage import proven

OTHER_UID = 12345  # no user of this machine: the planted file is "someone else's"


def plant(base: Path, name: str, elsewhere: Path, uid: int | None = None, mode: int | None = None) -> os.stat_result:
    """Replace the base's chunk file ``name`` by a hard link to a file in ``elsewhere`` with the same bytes
    (owned by ``uid``, with ``mode``, when given): the file's owner keeps a name of it outside the checkpoint."""
    elsewhere.mkdir(parents=True, exist_ok=True)
    mine = elsewhere / name
    shutil.copyfile(base / name, mine)
    if mode is not None:
        os.chmod(mine, mode)
    if uid is not None:
        os.chown(mine, uid, uid)
    (base / name).unlink()
    os.link(mine, base / name)
    return os.stat(mine)


def assert_not_linked(inc: Path, planted: os.stat_result, planted_path: Path) -> None:
    """No file of ``inc`` is the planted inode, whose link count the save left alone."""
    inodes = {(st.st_dev, st.st_ino) for st in (os.stat(inc / n) for n in chunk_files(inc))}
    assert (planted.st_dev, planted.st_ino) not in inodes
    assert os.stat(planted_path).st_nlink == planted.st_nlink == 2  # its own name and the base's


def assert_commits_exactly(rb, ckpt: tdcp.DistributedCheckpoint, inc: Path, full: Path) -> None:  # noqa: ANN001
    assert_same_checkpoint(inc, full)
    assert tdcp.verify(inc)["unchecked"] == []
    restored = make_buffer("lazy", inc.parent, "restored")
    tdcp.DistributedCheckpoint(buffer=restored).load(inc)
    assert len(restored) == len(rb)
    for a, b in zip(samples(restored), samples(rb)):
        assert (a == b).all()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown a file to another uid")
@pytest.mark.parametrize("remembered", [True, False], ids=["same_process", "fresh_process"])
def test_a_base_file_owned_by_another_user_is_copied_not_linked(tmp_path: Path, remembered: bool) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path / "shared")
    victim = sorted(chunk_files(base))[0]
    attacker = tmp_path / "attacker"
    planted = plant(base, victim, attacker, uid=OTHER_UID)
    assert planted.st_uid == OTHER_UID
    if not remembered:
        proven.forget_all()  # what a resumed job knows of files it did not write this run
    fill(rb, 3, 777)  # a change elsewhere: the victim's rows are unchanged
    inc = ckpt.save(tmp_path / "private" / "inc", incremental_from=base)
    assert victim in kept_files(inc)  # kept (proven by a read), but as a copy of its own
    assert_not_linked(inc, planted, attacker / victim)
    st = os.stat(inc / victim)
    assert st.st_uid == os.geteuid() and st.st_nlink == 1
    assert_commits_exactly(rb, ckpt, inc, ckpt.save(tmp_path / "full"))
    with open(attacker / victim, "r+b") as f:  # the owner rewrites its file: the new checkpoint is not touched
        f.seek(200)
        f.write(b"\x7f")
    assert tdcp.verify(inc)["unchecked"] == []


@pytest.mark.parametrize("beside", [False, True], ids=["elsewhere", "beside_the_base"])
@pytest.mark.parametrize("remembered", [True, False], ids=["same_process", "fresh_process"])
def test_a_base_file_with_a_name_outside_the_checkpoints_is_copied_not_linked(
    tmp_path: Path, remembered: bool, beside: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``beside_the_base``: the other name is in a directory next to the base that is no checkpoint (``cp -l`` of
    it): every directory there was taken for a sibling checkpoint, and the file was linked."""
    rb, ckpt, base = base_and_buffer(tmp_path / "shared")
    victim = sorted(chunk_files(base))[0]
    attacker = base.parent / "not_a_checkpoint" if beside else tmp_path / "attacker"
    planted = plant(base, victim, attacker)  # same owner: the extra name is what gives it away
    if not remembered:
        proven.forget_all()
    fill(rb, 3, 777)
    with caplog.at_level(logging.WARNING, logger="torchrl_dcp"):
        inc = ckpt.save(tmp_path / "private" / "inc", incremental_from=base)
    assert "not this user's alone" in caplog.text
    assert victim in kept_files(inc)
    assert_not_linked(inc, planted, attacker / victim)
    genuine = sorted(chunk_files(base) & kept_files(inc) - {victim})
    assert genuine and all(os.path.samefile(inc / n, base / n) for n in genuine)  # the others are still linked
    assert_commits_exactly(rb, ckpt, inc, ckpt.save(tmp_path / "full"))
    with open(attacker / victim, "r+b") as f:
        f.seek(200)
        f.write(b"\x7f")
    assert tdcp.verify(inc)["unchecked"] == []


def test_a_base_file_others_may_write_is_copied_not_linked(tmp_path: Path) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    victim = sorted(chunk_files(base))[0]
    os.chmod(base / victim, 0o666)  # a chmod moves ctime: proved by a read, then found writable by others
    fill(rb, 3, 777)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert victim in kept_files(inc)
    assert not os.path.samefile(inc / victim, base / victim)
    assert os.stat(inc / victim).st_mode & 0o022 == 0
    assert_commits_exactly(rb, ckpt, inc, ckpt.save(tmp_path / "full"))


def test_a_rotation_shares_inodes_and_is_still_linked_after_a_restart(tmp_path: Path) -> None:
    """The entries of a rotation link the same unchanged chunk files (link count above one): those names are ours,
    so the first save after a restart links them after reading them, copying nothing."""
    rb = make_buffer("lazy", tmp_path, "live")
    fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=3)
    for step in range(3):
        fill(rb, 2, 1000 * step)
        rotation.save(ckpt, step=step)
    latest = rotation.latest()
    shared = [n for n in chunk_files(latest) if os.stat(latest / n).st_nlink > 1]
    assert shared
    proven.forget_all()  # a restarted job: every kept file is proved by reading
    fill(rb, 2, 5000)
    inc = rotation.save(ckpt, step=3)
    linked = [n for n in shared if n in kept_files(inc) and os.path.samefile(inc / n, latest / n)]
    assert linked and all(os.stat(inc / n).st_nlink > 1 for n in kept_files(inc))
