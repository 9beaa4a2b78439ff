"""A shared directory is hostile ground: planted links, FIFOs and hard links, killed conversions, long names, full
disks, forged numpy dtypes and deep nesting. Each case ends in a ``CheckpointError`` naming the path (or in a save
that works), and nothing outside the checkpoint is ever written, truncated or removed.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.errors import CheckpointFormatError, EncodingError
from torchrl_dcp.format.codec import MAX_DEPTH, decode, encode
from torchrl_dcp.format.manifest import seal
from torchrl_dcp.storage import commit
from torchrl_dcp.storage.commit import DestinationLock, fsync_path, sweep_stale_locks, write_file_durably

PRECIOUS = b"precious bytes outside the checkpoint"


def ckpt(seed: int = 0) -> tdcp.DistributedCheckpoint:
    torch.manual_seed(seed)
    return tdcp.DistributedCheckpoint(model=torch.nn.Linear(4, 2), stats={"seed": seed})


def victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    target = outside / "victim.txt"
    target.write_bytes(PRECIOUS)
    return target


# ---------------------------------------------------------------------- planted lock files
def _plant(kind: str, at: Path, target: Path) -> None:
    if kind == "symlink to a file":
        at.symlink_to(target)
    elif kind == "dangling symlink":
        at.symlink_to(target.parent / "created-through-the-link")
    elif kind == "symlink to a directory":
        at.symlink_to(target.parent)
    elif kind == "hard link":
        os.link(target, at)
    elif kind == "fifo":
        os.mkfifo(at)
    elif kind == "directory":
        at.mkdir()
    else:
        raise ValueError(kind)


PLANTED = ["symlink to a file", "dangling symlink", "symlink to a directory", "hard link", "fifo", "directory"]


def _outside_unchanged(target: Path) -> None:
    assert target.read_bytes() == PRECIOUS
    assert not (target.parent / "created-through-the-link").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["victim.txt"]


@pytest.mark.parametrize("kind", PLANTED)
def test_planted_lock_file_of_the_destination_is_never_written_through(tmp_path: Path, kind: str) -> None:
    target = victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".ckpt.tdcp-lock"
    _plant(kind, lock, target)
    with pytest.raises(tdcp.CheckpointError) as info:
        ckpt().save(run / "ckpt")
    assert ".ckpt.tdcp-lock" in str(info.value) and "remove" in str(info.value), str(info.value)
    _outside_unchanged(target)
    assert not (run / "ckpt").exists() and os.path.lexists(lock)  # nothing published; the planted entry left
    assert [p.name for p in run.iterdir()] == [".ckpt.tdcp-lock"]  # no staging directory left either


@pytest.mark.parametrize("kind", PLANTED)
def test_sweep_of_stale_locks_leaves_planted_entries_alone(tmp_path: Path, kind: str) -> None:
    target = victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    planted = run / ".other.tdcp-lock"
    _plant(kind, planted, target)
    path = ckpt().save(run / "ckpt")  # the sweep after the save meets the planted entry
    assert tdcp.verify(path)["files"] >= 1
    _outside_unchanged(target)
    assert os.path.lexists(planted)
    sweep_stale_locks(run)  # and again, directly
    _outside_unchanged(target)


def test_sweep_removes_stale_regular_locks_and_never_reaches_outside_its_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".old.tdcp-lock").write_text("pid 1 on a dead host")  # left by a killed save
    (run / ".tdcp-lock").write_text("a bare name")  # once mapped to the lock of ``run`` itself, in its parent
    parent_lock = tmp_path / ".run.tdcp-lock"
    parent_lock.write_text("the lock of a save to tmp/run, in the parent")
    ckpt().save(run / "ckpt")
    assert not (run / ".old.tdcp-lock").exists()
    assert parent_lock.read_text() == "the lock of a save to tmp/run, in the parent"


def test_a_held_lock_is_not_swept_and_blocks_a_second_save(tmp_path: Path) -> None:
    with DestinationLock(tmp_path / "ckpt"):
        sweep_stale_locks(tmp_path)
        assert (tmp_path / ".ckpt.tdcp-lock").is_file()
        with pytest.raises(tdcp.CheckpointError, match="in progress"):
            DestinationLock(tmp_path / "ckpt", wait=0.0).acquire()
    assert not (tmp_path / ".ckpt.tdcp-lock").exists()


# ---------------------------------------------------------------------- removals, temporary files, fsync
@pytest.mark.parametrize("tag", [f".tdcp-{kind}-{'dead' * 8}" for kind in ("staging", "trash", "tmp")])
@pytest.mark.parametrize("kind", ["symlink to a directory", "symlink to a file", "fifo"])
def test_leftovers_are_removed_without_following_links(tmp_path: Path, tag: str, kind: str) -> None:
    target = victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    leftover = run / f".ckpt{tag}"
    _plant(kind, leftover, target)
    ckpt().save(run / "ckpt")
    _outside_unchanged(target)
    assert not os.path.lexists(leftover)


def test_a_users_files_named_like_a_saves_leftovers_or_lock_are_kept(tmp_path: Path) -> None:
    """Any name starting like a save's temporary file (``.step-1.zip.tdcp-tmp-mine``) was swept as a killed
    conversion's, and a lock file's name was truncated and rewritten, then deleted, whatever it held: a user's
    notes were lost. Leftovers are only names a save makes (the tag and a 32-digit hex token); a file at the lock's
    name holding anything but a holder is refused, named, and left as it is."""
    notes = b"my own notes, not a checkpoint\n"
    planted = [".step-000000000001.zip.tdcp-tmp-mine", ".step-000000000001.tdcp-staging-mine", ".c.tdcp-trash-x"]
    for name in planted:
        (tmp_path / name).write_bytes(notes)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        rotation.save(ckpt(), step=step)
    tdcp.to_archive(tmp_path / "step-000000000003", tmp_path / "c.zip")
    assert all((tmp_path / name).read_bytes() == notes for name in planted)
    lock = tmp_path / ".step-000000000004.tdcp-lock"
    lock.write_bytes(notes)
    with pytest.raises(tdcp.CheckpointError, match=r"tdcp-lock is named like this path's lock file but holds"):
        rotation.save(ckpt(), step=4)
    rotation.save(ckpt(), step=5)  # (sweeps the lock files killed saves left: never this one)
    assert lock.read_bytes() == notes


def test_remove_tree_unlinks_a_link_and_never_its_target(tmp_path: Path) -> None:
    target = victim(tmp_path)
    for kind in ("symlink to a directory", "symlink to a file", "fifo"):
        at = tmp_path / f"x-{kind.replace(' ', '-')}"
        _plant(kind, at, target)
        commit.remove_tree(at)
        assert not os.path.lexists(at)
    inner = tmp_path / "tree"
    inner.mkdir()
    (inner / "__0_0.distcp").symlink_to(target.parent)  # planted under a name of ours: the link itself goes
    commit.remove_tree(inner)
    assert not inner.exists()
    inner.mkdir()
    (inner / "link").symlink_to(target.parent)  # a user's link (no name of ours): kept, as their files are
    assert commit.remove_tree(inner) == ["link"] and (inner / "link").is_symlink()
    _outside_unchanged(target)


@pytest.mark.parametrize("size", [4 << 10, 64 << 20])  # a data file; a chunk file (its own writer)
def test_a_save_failing_to_write_names_the_file_at_its_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A write failing with ``EFBIG`` named the staging directory (removed by the time the error is read), never
    the data file; an object store's named the object. It names the file as the checkpoint would hold it."""
    from torchrl_dcp.storage import chunk_writer, writer

    def full(fd: int, data: Any, offset: int) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(writer, "pwrite_all", full)
    monkeypatch.setattr(chunk_writer, "pwrite_all", full)
    state = {"w": torch.zeros(size // 4)}
    with pytest.raises(tdcp.CheckpointError) as info:
        tdcp.DistributedCheckpoint(buffer=state).save(tmp_path / "ck")
    assert str(info.value.path).startswith(str(tmp_path / "ck" / "__0_")), info.value.path
    assert str(info.value.path).endswith(".distcp") and "File too large" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (the staging removed)


def test_removal_keeps_a_users_subdirectory_whole_whatever_its_files_are_named(tmp_path: Path) -> None:
    """A prune removed library-named files at any depth: a user's ``eval/manifest.json`` put into an old entry was
    deleted (its ``notes.txt`` kept). A save never writes into a subdirectory: a user's one is kept whole."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2))
    old = rotation.save(ckpt, step=1)
    (old / "eval").mkdir()
    for name in ("manifest.json", "__0_0.distcp", ".metadata", "notes.txt"):
        (old / "eval" / name).write_text("mine")
    rotation.save(ckpt, step=2)
    assert sorted(p.name for p in (old / "eval").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "manifest.json",
        "notes.txt",
    ]
    assert [e.step for e in rotation.entries()] == [2]


def test_a_deep_tree_in_a_leftover_is_kept_and_every_save_commits(tmp_path: Path) -> None:
    """A leftover staging directory holding a tree 1,100 levels deep made the removal recurse past Python's limit:
    every save committed, pruned, then raised ``RecursionError`` as a failed rotation."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2))
    rotation.save(ckpt, step=1)
    leftover = f".step-000000000000{commit.STAGING_TAG}{'0123' * 8}"
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir(leftover, dir_fd=fd)
    cur = os.open(leftover, os.O_RDONLY, dir_fd=fd)
    for _ in range(1100):
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    os.close(fd)
    for step in (2, 3):
        rotation.save(ckpt, step=step)
    assert [e.step for e in rotation.entries()] == [3]
    assert (tmp_path / leftover / "d").is_dir()  # (a user's tree: kept, logged)
    subprocess.run(["rm", "-rf", str(tmp_path / leftover)], check=True)  # (pytest's removal recurses: too deep)


def test_temporary_file_of_a_durable_write_is_never_opened_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = victim(tmp_path)
    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(commit.uuid, "uuid4", lambda: fixed)
    dest = tmp_path / "manifest.json"
    (tmp_path / f".manifest.json.tmp-{fixed.hex}").symlink_to(target)  # a predicted temporary name
    with pytest.raises(OSError):
        write_file_durably(dest, b"{}")
    _outside_unchanged(target)
    assert not dest.exists()


def test_fsync_path_refuses_links_and_fifos_but_follows_a_users_linked_directory(tmp_path: Path) -> None:
    target = victim(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for bad in (link, fifo):
        with pytest.raises(tdcp.CheckpointError, match=bad.name):
            fsync_path(bad)
    fsync_path(target)
    linked_dir = tmp_path / "ckpts"
    linked_dir.symlink_to(target.parent)
    fsync_path(linked_dir, follow=True)
    with pytest.raises(tdcp.CheckpointError):
        fsync_path(linked_dir)


def test_saves_and_rotation_into_a_linked_directory_still_work(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    link = tmp_path / "ckpts"
    link.symlink_to(real)  # how clusters point a run at its scratch space
    rotation = tdcp.CheckpointRotation(link, keep_last=1)
    for step in (1, 2):
        path = rotation.save(ckpt(step), step=step)
        assert path.exists()
    assert sorted(p.name for p in real.iterdir()) == ["step-000000000002"]
    tdcp.to_archive(path, link / "c.zip")
    assert (real / "c.zip").is_file()


# ---------------------------------------------------------------------- conversions
_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import torchrl_dcp as tdcp
    def die(done, total):
        os.kill(os.getpid(), signal.SIGKILL)
    convert = tdcp.to_archive if sys.argv[1] == "archive" else tdcp.to_directory
    convert(sys.argv[2], sys.argv[3], progress=die)
    """
)


def _big(tmp_path: Path) -> Path:
    return tdcp.DistributedCheckpoint(w={"x": torch.randn(3 << 20)}).save(tmp_path / "c")  # 12 MiB


@pytest.mark.parametrize("direction", ["archive", "directory"])
def test_a_killed_conversion_leaves_nothing_the_next_one_does_not_remove(tmp_path: Path, direction: str) -> None:
    src = _big(tmp_path)
    if direction == "directory":
        src = tdcp.to_archive(src, tmp_path / "c.zip")
    dst = tmp_path / ("out.zip" if direction == "archive" else "out")
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, direction, str(src), str(dst)], capture_output=True, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.tdcp-")]
    partial = [p for p in leftovers if not p.name.endswith(".tdcp-lock")]
    assert partial and not dst.exists()  # a temporary file or staging directory of the killed run
    out = tdcp.to_archive(src, dst) if direction == "archive" else tdcp.to_directory(src, dst)
    assert tdcp.verify(out)["files"] >= 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.tdcp-")]


def test_leftovers_of_a_running_conversion_are_left_to_it(tmp_path: Path) -> None:
    src = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}).save(tmp_path / "c")
    live = tmp_path / f".c.zip.tdcp-tmp-{'1ace' * 8}"
    live.write_bytes(b"being written")
    with DestinationLock(tmp_path / "c.zip"), pytest.raises(tdcp.CheckpointError, match="in progress"):
        tdcp.to_archive(src, tmp_path / "c.zip")
    assert live.read_bytes() == b"being written"


@pytest.mark.parametrize("direction", ["archive", "directory"])
@pytest.mark.parametrize("length", [230, 300])  # the temporary name is too long / the name itself is too long
def test_a_too_long_name_is_a_checkpoint_error(tmp_path: Path, direction: str, length: int) -> None:
    src = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}).save(tmp_path / "c")
    if direction == "directory":
        src = tdcp.to_archive(src, tmp_path / "c.zip")
    dst = tmp_path / ("n" * length + (".zip" if direction == "archive" else ""))
    with pytest.raises(tdcp.CheckpointError) as info:
        tdcp.to_archive(src, dst) if direction == "archive" else tdcp.to_directory(src, dst)
    text = str(info.value)
    assert "too long" in text and "shorter name" in text and "n" * 200 in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c", "c.zip"][: 1 + (direction == "directory")])


@pytest.mark.parametrize("direction", ["archive", "directory"])
@pytest.mark.parametrize(
    "code, hint",
    [(errno.ENOSPC, "full"), (errno.EDQUOT, "quota"), (errno.EIO, "EIO"), (errno.EROFS, "read-only")],
)
def test_file_system_errors_while_converting_are_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direction: str, code: int, hint: str
) -> None:
    from torchrl_dcp import convert
    from torchrl_dcp.storage import copying

    src = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}).save(tmp_path / "c")
    archive = tdcp.to_archive(src, tmp_path / "c.zip")
    before = sorted(p.name for p in tmp_path.iterdir())
    dst = tmp_path / ("old.zip" if direction == "archive" else "old")
    old = tdcp.to_archive(src, dst) if direction == "archive" else tdcp.to_directory(archive, dst)
    old_names = sorted(p.name for p in tmp_path.iterdir())

    original = copying.copy_ranges

    def fail(ranges: Any, *args: Any, **kwargs: Any) -> Any:
        if any(r.dst is not None for r in ranges):  # a write, not a checksum pass
            raise OSError(code, os.strerror(code))
        return original(ranges, *args, **kwargs)

    monkeypatch.setattr(copying, "copy_ranges", fail)
    monkeypatch.setattr(convert, "copy_ranges", fail)
    with pytest.raises(tdcp.CheckpointError) as info:
        if direction == "archive":
            tdcp.to_archive(src, dst, overwrite=True)
        else:
            tdcp.to_directory(archive, dst, overwrite=True)
    text = str(info.value)
    assert str(dst) in text and hint in text and "nothing was published" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == old_names and len(old_names) == len(before) + 1
    monkeypatch.undo()
    assert tdcp.verify(old)["files"] >= 1  # the checkpoint that was there is unchanged


def test_conversion_refuses_a_linked_destination_and_fifo_sources(tmp_path: Path) -> None:
    src = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}).save(tmp_path / "c")
    other = tdcp.to_archive(src, tmp_path / "other.zip")
    link = tmp_path / "link.zip"
    link.symlink_to(other)
    with pytest.raises(tdcp.CheckpointError, match="symbolic link"):
        tdcp.to_archive(src, link, overwrite=True)
    assert link.is_symlink() and tdcp.verify(other)
    fifo = tmp_path / "fifo.zip"
    os.mkfifo(fifo)
    with pytest.raises(tdcp.CheckpointError, match="fifo.zip"):
        tdcp.to_directory(fifo, tmp_path / "out")
    data = src / "__0_shared.distcp"
    data.rename(tmp_path / "moved")
    os.mkfifo(data)  # a listed data file replaced by a FIFO: refused, never waited on
    with pytest.raises(tdcp.CheckpointError, match="__0_shared.distcp"):
        tdcp.to_archive(src, tmp_path / "new.zip")


# ---------------------------------------------------------------------- codec bounds
BAD_NP_DTYPES = [
    "<U20000000",
    "U5",
    "V1000000000",
    "O",
    "M8[ns]",
    "(1000,1000)f8",
    "S1000",
    "no-such",
    3,
    None,
    "f" * 40,
]


def _ndarray(np_dtype: Any) -> dict[str, Any]:
    skeleton, _ = encode({"a": np.arange(4, dtype=np.uint8)})
    node = skeleton["items"][0][1]
    node["np_dtype"] = np_dtype
    return skeleton


@pytest.mark.parametrize("np_dtype", BAD_NP_DTYPES)
@pytest.mark.parametrize("kind", ["ndarray", "np"])
def test_non_numeric_numpy_dtypes_are_refused_without_allocating(np_dtype: Any, kind: str) -> None:
    tensors = {"a": torch.arange(4, dtype=torch.uint8)}
    if kind == "ndarray":
        skeleton = _ndarray(np_dtype)
    else:
        skeleton = {"t": "dict", "items": [["a", {"t": "np", "dtype": np_dtype, "v": 5}]]}
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match="numpy dtype|malformed"):
            decode(skeleton, tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_numpy_dtype_wider_than_its_tensor_is_refused() -> None:
    skeleton = _ndarray("<c16")  # 16 bytes per element over a uint8 tensor: a 16x allocation
    with pytest.raises(CheckpointFormatError, match="does not match"):
        decode(skeleton, {"a": torch.arange(4, dtype=torch.uint8)})
    back = decode(_ndarray("|u1"), {"a": torch.arange(4, dtype=torch.uint8)})
    assert back["a"].dtype == np.uint8


def test_a_forged_numpy_dtype_in_a_real_checkpoint_is_refused(tmp_path: Path) -> None:
    obs = {"arr": np.arange(6, dtype=np.float32)}
    path = tdcp.DistributedCheckpoint(obs=obs).save(tmp_path / "c")
    m = json.loads((path / "manifest.json").read_text())
    text = json.dumps(m).replace('"np_dtype": "<f4"', '"np_dtype": "<U20000000"')
    assert text != json.dumps(m)
    (path / "manifest.json").write_text(json.dumps(seal(json.loads(text))))  # a consistent forgery
    target = {"arr": np.zeros(6, dtype=np.float32)}
    with pytest.raises(tdcp.CheckpointError, match="numpy dtype"):
        tdcp.DistributedCheckpoint(obs=target).load(path)
    assert not target["arr"].any()


_WRAP: dict[str, Callable[[Any], Any]] = {
    "dict": lambda n: {"t": "dict", "items": [["k", n]]},
    "odict": lambda n: {"t": "odict", "items": [["k", n]]},
    "list": lambda n: {"t": "list", "items": [n]},
    "tuple": lambda n: {"t": "tuple", "items": [n]},
    "frozenset": lambda n: {"t": "frozenset", "items": [n]},
    "complex": lambda n: {"t": "complex", "v": [n, 0.0]},
    "slice": lambda n: {"t": "slice", "v": [n, None, None]},
    "np": lambda n: {"t": "np", "dtype": "<f8", "v": n},
}


@pytest.mark.parametrize("container", sorted(_WRAP))
def test_nesting_deeper_than_the_limit_is_a_format_error(container: str) -> None:
    node: Any = 1
    for _ in range(MAX_DEPTH):
        node = _WRAP[container](node)
    if container == "np":  # (an np node's value is a Python number: a scalar inside one is refused, for that)
        with pytest.raises(CheckpointFormatError, match="numpy scalar of dtype '<f8' holds float64"):
            decode(node, {})
    else:
        decode(node, {})  # exactly at the limit: fine
    with pytest.raises(CheckpointFormatError, match=f"more than {MAX_DEPTH} levels"):
        decode(_WRAP[container](node), {})


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_saving_state_deeper_than_the_limit_fails_at_save_time(kind: str) -> None:
    def nest(depth: int) -> Any:
        value: Any = torch.ones(1)
        for _ in range(depth):
            value = {"d": value} if kind == "dict" else [value] if kind == "list" else (value,)
        return value

    skeleton, tensors = encode(nest(MAX_DEPTH))
    assert len(tensors) == 1 and decode(json.loads(json.dumps(skeleton)), tensors) is not None
    with pytest.raises(EncodingError, match="levels deep"):
        encode(nest(MAX_DEPTH + 1))
    with pytest.raises(EncodingError, match="levels deep"):
        encode(nest(5000))  # far past Python's recursion limit: still one clear error


def test_big_endian_arrays_round_trip() -> None:
    value = {"be": np.arange(3, dtype=">f4"), "le": np.arange(3, dtype="<i8")}
    skeleton, tensors = encode(value)
    back = decode(json.loads(json.dumps(skeleton)), tensors)
    assert back["be"].dtype == np.dtype(">f4") and back["be"].tolist() == [0.0, 1.0, 2.0]
    assert back["le"].dtype == np.dtype("<i8") and back["le"].tolist() == [0, 1, 2]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
def test_a_lock_file_that_cannot_be_created_is_an_error_not_a_spin(tmp_path: Path) -> None:
    """Under /proc a created file vanishes at once (ENOENT): save, rotation and conversions say so and stop."""
    import subprocess
    import sys

    src = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tmp_path / "c")
    code = f"""
import torch, torchrl_dcp as tdcp
for name, call in [
    ("save", lambda: tdcp.DistributedCheckpoint(w={{"x": torch.ones(1)}}).save("/proc/self/tdcp-ckpt")),
    ("rotation", lambda: tdcp.CheckpointRotation("/proc/self").save(tdcp.DistributedCheckpoint(w={{"x": torch.ones(1)}}), step=1)),
    ("to_archive", lambda: tdcp.to_archive({str(src)!r}, "/proc/self/tdcp.zip")),
]:
    try:
        call()
        print(name, "no error")
    except tdcp.CheckpointError as err:
        print(name, "refused:", "cannot be created" in str(err) or str(err))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["save", "rotation", "to_archive"], out.stdout
    assert all(line.endswith("refused: True") for line in lines), out.stdout


def test_a_path_through_a_users_file_is_said_so_and_the_file_kept(tmp_path: Path) -> None:
    """A checkpoint path through a regular file: the save said "something already exists at this path (left by
    another process?): remove it and retry" (the user's file); the conversions the same. The hint says which file is
    in the way, or that it may be one, and never to remove it."""
    import torch

    (tmp_path / "notes").write_text("a user's notes")
    source = tdcp.DistributedCheckpoint(d={"x": torch.ones(2)}, no_dist=True).save(tmp_path / "src")
    archive = tdcp.to_archive(source, tmp_path / "a.zip")
    for action, hint in (
        (lambda: tdcp.DistributedCheckpoint(d={"x": torch.ones(2)}).save(tmp_path / "notes" / "c"), "a file where"),
        (
            lambda: tdcp.DistributedCheckpoint(d={"x": torch.ones(2)}).save(tmp_path / "notes" / "a" / "c"),
            f"{tmp_path / 'notes'} is a file where a directory is needed",
        ),  # fmt: skip
        (lambda: tdcp.to_archive(source, tmp_path / "notes" / "a.zip"), "a file where"),
        (lambda: tdcp.to_directory(archive, tmp_path / "notes" / "d"), "a file where"),
        (lambda: tdcp.export_torchrl(source, tmp_path / "notes" / "t"), "a file where"),
    ):
        with pytest.raises(tdcp.CheckpointError, match=hint) as err:
            action()
        assert "remove it" not in str(err.value) and "; ;" not in str(err.value)
    assert (tmp_path / "notes").read_text() == "a user's notes"


def test_a_refused_listing_leaves_no_directory_iterator_open(tmp_path: Path) -> None:
    """The listing check stops at the first unlisted file: the directory iterator it read was left to the garbage
    collector (a ``ResourceWarning`` under ``-X dev``, one descriptor held meanwhile)."""
    import gc
    import warnings

    ckpt = tdcp.DistributedCheckpoint(d={"x": torch.ones(2)}, no_dist=True)
    path = ckpt.save(tmp_path / "c")
    for name in ("aaa_extra", "zzz_extra"):
        (path / name).write_text("x")
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(tdcp.CheckpointIntegrityError, match="not listed in the manifest"):
            ckpt.load(path)
        gc.collect()
    assert not [w for w in heard if issubclass(w.category, ResourceWarning)], [str(w.message) for w in heard]


def test_removing_an_exports_listed_files_never_goes_through_a_link(tmp_path: Path) -> None:
    """An old export is deleted by the names its manifest lists: a directory of it swapped for a link to a user's
    directory must not make those names delete the user's files (each step through a directory descriptor)."""
    from torchrl_dcp.storage.commit import remove_listed

    theirs = tmp_path / "theirs" / "0000-policy"
    theirs.mkdir(parents=True)
    (theirs / "state.pt").write_bytes(b"theirs")
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text("{}")
    (export / "components").symlink_to(tmp_path / "theirs")
    kept = remove_listed(export, {"manifest.json", "components/0000-policy/state.pt"})
    assert kept == ["components"] and (theirs / "state.pt").read_bytes() == b"theirs"  # the link itself, kept
    assert sorted(p.name for p in export.iterdir()) == ["components"]


def test_a_save_over_an_archive_says_it_is_one_and_what_to_do(tmp_path: Path) -> None:
    """A save refused at an archive ``to_archive`` wrote said "exists and is not a torchrl_dcp checkpoint"."""
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, a={"x": torch.ones(2)})
    archive = tdcp.to_archive(ckpt.save(tmp_path / "c"), tmp_path / "c.zip")
    with pytest.raises(tdcp.CheckpointError, match="is a checkpoint archive .*never replaces an archive.*to_directory"):
        ckpt.save(archive)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(tdcp.CheckpointError, match="is a file, not a checkpoint directory"):
        ckpt.save(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    tdcp.verify(archive)


def test_a_save_or_conversion_to_the_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save(".")`` swapped the process's working directory out and removed it: ``os.getcwd()`` failed after it,
    and ``load(".")`` raised a bare ``FileNotFoundError``."""
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, a={"x": torch.ones(2)})
    archive = tdcp.to_archive(ckpt.save(tmp_path / "c"), tmp_path / "c.zip")
    (tmp_path / "run" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run" / "sub")
    for attempt in (lambda: ckpt.save("."), lambda: tdcp.to_directory(archive, "."), lambda: ckpt.save("..")):
        with pytest.raises(tdcp.CheckpointError, match="working directory of this process"):
            attempt()
    assert os.getcwd() == str(tmp_path / "run" / "sub") and not os.listdir(".")
    ckpt.save("ckpt")  # a path inside it: saved
    tdcp.verify(tmp_path / "run" / "sub" / "ckpt")
