"""A race harness: another process plants and swaps names in a run directory while a job saves into it.

The attacker (a forked process doing nothing but file-system calls, seeded) loops over what it finds: it plants
links to an outside directory where the library writes (a `.metadata.tmp`, a data file, the next entry's
name), plants extra files, swaps a staging directory for a link, and drops fake pending markers. Meanwhile the job
saves 24 steps with ``CheckpointRotation(keep_last=2)`` (incremental directories, or archives), the even ones while
the attacker holds still amid what it left behind. Whatever interleaving happens:

* every save either commits or raises a ``CheckpointError`` (never another exception, never a hang), and every
  even step commits: leftovers (moved staging directories, links at other entries' names, markers) never break a
  later save;
* nothing outside the run directory changes: the outside directory holds exactly what it held;
* every committed entry verifies and holds exactly the state of its step, or (a file planted just after the
  save's last check of its staging directory, which then lands in the entry) verify and load refuse it and the
  load changes nothing; at least one entry loads (the prune never removes the good ones for a damaged one), and
  ``resume`` finds the newest that loads.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp


def _plant(path: Path) -> None:  # pragma: no cover - in the child
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.write(fd, b"planted")
    os.close(fd)


def _attack(run: str, outside: str, seed: int, stop_file: str) -> None:  # pragma: no cover - in the child
    rng = random.Random(seed)
    run_dir, out = Path(run), Path(outside)
    moves = 0
    Path(stop_file + ".ready").touch()
    calm = Path(stop_file + ".calm")
    while not os.path.exists(stop_file):
        if calm.exists():  # the job saves an even step: the attacker holds still (and says so)
            Path(stop_file + ".calm-ack").touch()
            time.sleep(0.0005)
            continue
        try:
            names = os.listdir(run_dir)
        except OSError:
            continue
        # real staging directories only: the attacker never writes through a link it planted itself
        staging = [run_dir / n for n in names if ".tdcp-staging-" in n and not os.path.islink(run_dir / n)]
        move = rng.randrange(6)
        try:
            if move == 0 and staging:  # a link where the pickle of DCP's metadata used to be staged
                os.symlink(out / "victim", rng.choice(staging) / ".metadata.tmp")
            elif move == 1 and staging:  # an extra data file
                _plant(rng.choice(staging) / "__7_0.distcp")
            elif move == 2 and staging:  # the staging directory swapped for a link to outside
                victim = rng.choice(staging)
                os.rename(victim, str(victim) + ".moved")
                os.symlink(out, victim, target_is_directory=True)
            elif move == 3 and staging:  # a data file swapped for a link
                target = rng.choice(staging)
                data = [p for p in target.iterdir() if p.suffix == ".distcp"]
                if data:
                    os.unlink(data[0])
                    os.symlink(out / "victim", data[0])
            elif move == 4:  # the name of a future entry, as a link to outside
                name = f"step-{rng.randrange(1, 30) | 1:012d}" + rng.choice(["", ".zip"])  # odd steps only
                os.symlink(out if not name.endswith(".zip") else out / "victim", run_dir / name)
            else:  # a pending marker naming the parent, or an unrelated directory
                _plant(run_dir / rng.choice([".tdcp-pending", f".step-{rng.randrange(1, 30):012d}.tdcp-pending"]))
        except OSError:
            moves -= 1
        moves += 1
        time.sleep(rng.random() / 500)
    Path(stop_file + ".moves").write_text(str(moves))


def _tree(root: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p))
        if p.is_file() or p.is_symlink()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("archive", [False, True], ids=["directories", "archives"])
@pytest.mark.parametrize("seed", [0, 1])
def test_saves_racing_an_attacker_commit_or_refuse_and_never_write_outside(
    tmp_path: Path, seed: int, archive: bool
) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (outside / "datasets").mkdir()
    (outside / "datasets" / "keep.txt").write_text("user data")
    before = _tree(outside)
    stop = tmp_path / "stop"
    attacker = multiprocessing.get_context("fork").Process(
        target=_attack, args=(str(run), str(outside), seed, str(stop))
    )
    state = {"w": torch.zeros(2000)}
    rotation = tdcp.CheckpointRotation(run, keep_last=2, archive=archive)
    ckpt = tdcp.DistributedCheckpoint(state=state)
    committed, refused = [], []
    attacker.start()
    while attacker.is_alive() and not Path(str(stop) + ".ready").exists():
        time.sleep(0.001)
    try:
        for step in range(1, 25):
            state["w"].fill_(float(step))
            calm, ack = Path(str(stop) + ".calm"), Path(str(stop) + ".calm-ack")
            if step % 2 == 0:  # even steps are saved while the attacker holds still, amid what it left behind
                calm.touch()
                while attacker.is_alive() and not ack.exists():
                    time.sleep(0.0005)
            try:
                rotation.save(ckpt, step=step)
                committed.append(step)
            except tdcp.CheckpointError as err:
                refused.append((step, str(err)))
            calm.unlink(missing_ok=True)
            ack.unlink(missing_ok=True)
    finally:
        stop.touch()
        attacker.join(10)
        if attacker.is_alive():
            attacker.kill()
    assert int(Path(str(stop) + ".moves").read_text()) > 0, "the attacker never got a move in"
    assert [s for s in range(2, 25, 2) if s not in committed] == [], f"what the attacker left broke a save: {refused}"
    assert _tree(outside) == before, "a save wrote, moved or deleted something outside the run directory"
    entries = rotation.entries()
    assert entries, f"nothing committed; refused: {refused[:3]}"
    good = []
    for entry in entries:  # a file planted into a staging directory just after its last check lands in the entry
        fresh = {"w": torch.full((2000,), -1.0)}
        try:
            tdcp.verify(entry.path)
        except tdcp.CheckpointError:  # then verify and load both refuse it, and the load changes nothing
            with pytest.raises(tdcp.CheckpointError):
                tdcp.DistributedCheckpoint(state=fresh).load(entry.path)
            assert torch.equal(fresh["w"], torch.full((2000,), -1.0))
            continue
        tdcp.DistributedCheckpoint(state=fresh).load(entry.path)
        assert torch.equal(fresh["w"], torch.full((2000,), float(entry.step))), f"step {entry.step} holds other state"
        good.append(entry.step)
    assert good, "no committed entry loads: the prune removed the good ones"
    fresh = {"w": torch.empty(2000)}
    info = tdcp.resume(tdcp.DistributedCheckpoint(state=fresh), run)
    assert info.step == max(good)
    assert torch.equal(fresh["w"], torch.full((2000,), float(info.step)))
