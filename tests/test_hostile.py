"""Damaged, foreign and hostile checkpoints: a CheckpointError naming the file, nothing run, nothing changed.

Every damage case is applied to a real checkpoint of a module, an optimizer with
state, a plain dict and a TensorDict; loading it must raise a ``CheckpointError``
whose message names the file (or member) and the problem, leave every live object
bit-for-bit unchanged, and ``verify`` must report the same damage without loading.

Format 5: loads build DCP's metadata from the manifest's storage entries and never read
``.metadata`` (only its size is checked); ``verify`` reads it. Damage or a planted pickle
in ``.metadata`` alone is therefore refused by ``verify`` naming it, never run, and a load
restores exactly the saved state; a forger who also moves the manifest's entries is
refused by the load as before.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.format.manifest import seal
from torchrl_dcp.verification import verify

DATA = "__0_shared.distcp"  # every state here is replicated (format 6: the shared data file)


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------- objects and snapshots
def make_objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    stats = {"episodes": seed, "name": f"run-{seed}", "table": torch.arange(6.0) + seed}
    td = TensorDict({"obs": torch.randn(5, 3), "nested": {"r": torch.randn(5)}}, batch_size=[5])
    return {"model": model, "optim": optim, "stats": stats, "td": td}


def checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    return tdcp.DistributedCheckpoint(**objs)


def snapshot(objs: dict[str, Any]) -> Any:
    """A deep copy of everything a load could change."""

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [copy(x) for x in v]
        return v

    return {
        "model": copy(objs["model"].state_dict()),
        "optim": copy(objs["optim"].state_dict()),
        "stats": copy(objs["stats"]),
        "td": copy(objs["td"].to_dict()),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def saved(tmp_path: Path) -> Path:
    return checkpoint(make_objects(1)).save(tmp_path / "ckpt", step=5, metadata={"run": "a"})


def refuse_unchanged(path: Path, match: str | None = None) -> tdcp.CheckpointError:
    """Load into fresh objects: must raise a CheckpointError and change nothing."""
    objs = make_objects(2)
    before = snapshot(objs)
    with pytest.raises(tdcp.CheckpointError) as info:
        checkpoint(objs).load(path)
    assert same(snapshot(objs), before), f"a failed load changed the objects ({info.value})"
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def loads_exactly(path: Path) -> None:
    """Load into fresh objects: exactly the saved state (``make_objects(1)``), whatever ``.metadata`` holds."""
    objs = make_objects(2)
    checkpoint(objs).load(path)
    assert same(snapshot(objs), snapshot(make_objects(1))), "the load did not restore exactly the saved state"


def reseal(path: Path, name: str) -> None:
    """Record ``name``'s current size and checksum in the manifest (a consistent forgery)."""
    forging.reseal(path, name)


def edit_manifest(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(seal(m)))


def flip(p: Path, at: float = 0.5) -> None:
    data = bytearray(p.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    p.write_bytes(bytes(data))


def test_round_trip_is_exact(tmp_path: Path) -> None:
    """The control: the same objects load back exactly (so the refusals below are about the damage)."""
    path = saved(tmp_path)
    objs = make_objects(2)
    checkpoint(objs).load(path)
    assert same(snapshot(objs), snapshot(make_objects(1)))
    assert verify(path)["tensors"] > 0


# ---------------------------------------------------------------------- damaged directories
def _set(field: str, value: Any) -> Callable[[Path], None]:
    return lambda p: edit_manifest(p, lambda m: m.__setitem__(field, value))


def _component(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda p: edit_manifest(p, lambda m: fn(m["components"]))


DAMAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # name: (damage, file named in the message, problem named in the message)
    "truncated data file": (lambda p: (p / DATA).write_bytes((p / DATA).read_bytes()[:-100]), DATA, "truncated"),
    "data file grown": (lambda p: (p / DATA).write_bytes((p / DATA).read_bytes() + b"\0"), DATA, "size"),
    "flipped byte in data": (lambda p: flip(p / DATA), DATA, "checksum"),
    "flipped byte in tensor blob header": (lambda p: flip(p / DATA, 0.01), DATA, "checksum"),
    "flipped byte in .metadata": (lambda p: flip(p / ".metadata"), ".metadata", "checksum"),
    "missing data file": (lambda p: (p / DATA).unlink(), DATA, "missing"),
    "missing .metadata": (lambda p: (p / ".metadata").unlink(), ".metadata", "missing"),
    "extra file": (lambda p: (p / "notes.txt").write_text("hi"), "notes.txt", "not listed"),
    "extra directory": (lambda p: (p / "sub").mkdir(), "sub", "not listed"),
    "manifest not JSON": (
        lambda p: (p / "manifest.json").write_text("{'format': 1"),
        "manifest.json",
        "not valid JSON",
    ),
    "manifest truncated": (
        lambda p: (p / "manifest.json").write_bytes((p / "manifest.json").read_bytes()[:50]),
        "manifest.json",
        "not valid JSON",
    ),
    "manifest NaN": (lambda p: (p / "manifest.json").write_text('{"format": NaN}'), "manifest.json", "not valid JSON"),
    "manifest a list": (lambda p: (p / "manifest.json").write_text("[1, 2]"), "manifest.json", "not a JSON object"),
    "manifest binary": (lambda p: (p / "manifest.json").write_bytes(b"\xff\xfe\x00\x01"), "manifest.json", "JSON"),
    "world_size a string": (_set("world_size", "2"), "manifest.json", "world_size"),
    "world_size zero": (_set("world_size", 0), "manifest.json", "world_size"),
    "step a float": (_set("step", 1.5), "manifest.json", "step"),
    "files a list": (_set("files", []), "manifest.json", "files"),
    "components null": (_set("components", None), "manifest.json", "components"),
    "file size negative": (
        lambda p: edit_manifest(p, lambda m: m["files"][DATA].__setitem__("size", -1)),
        "manifest.json",
        DATA,
    ),
    "file listed with a path": (
        lambda p: edit_manifest(p, lambda m: m["files"].__setitem__("../outside", {"size": 1, "checksum": "crc32:0"})),
        "manifest.json",
        "not a plain file name",
    ),
    "file listed with a lone surrogate": (  # os.open raised a bare UnicodeEncodeError naming nothing
        lambda p: edit_manifest(
            p, lambda m: m["files"].__setitem__("\ud800.distcp", {"size": 1, "checksum": "crc32:0"})
        ),
        "manifest.json",
        "not a plain file name",
    ),
    "file listed with a newline": (
        lambda p: edit_manifest(p, lambda m: m["files"].__setitem__("x\n.distcp", {"size": 1, "checksum": "crc32:0"})),
        "manifest.json",
        "not a plain file name",
    ),
    "mapping item not a pair": (  # a 2-key dict unpacked as its keys: stats = {"a": "b"}, values lost silently
        _component(lambda c: c["stats"].__setitem__("state", {"t": "dict", "items": [{"a": 1, "b": 2}]})),
        "component 'stats'",
        "[key, value] pair",
    ),
    "placement unknown": (
        _component(lambda c: c["model"].__setitem__("placement", "everywhere")),
        "manifest.json",
        "placement",
    ),
    "adapter_version a string": (
        _component(lambda c: c["model"].__setitem__("adapter_version", "1")),
        "manifest.json",
        "adapter_version",
    ),
    "inventory shape negative": (
        _component(lambda c: next(iter(c["model"]["inventory"].values())).__setitem__("shape", [-1])),
        "manifest.json",
        "inventory",
    ),
    "newer format version": (_set("format_version", 999), "manifest.json", "format version 999"),
    "format_version a string": (_set("format_version", "2"), "manifest.json", "format_version"),
    "foreign format": (_set("format", "orbax"), "manifest.json", "format"),
    "manifest removed": (lambda p: (p / "manifest.json").unlink(), "ckpt", "no manifest.json"),
    "manifest a directory": (
        lambda p: ((p / "manifest.json").unlink(), (p / "manifest.json").mkdir()),
        "ckpt",
        "no manifest.json",
    ),
}


# damage that only ``verify`` sees: loads never read ``.metadata``'s bytes (format 5), they restore the saved state
VERIFY_ONLY = {"flipped byte in .metadata"}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_refused_naming_file_and_problem_objects_unchanged(tmp_path: Path, case: str) -> None:
    damage, file, problem = DAMAGE[case]
    path = saved(tmp_path)
    damage(path)
    if case in VERIFY_ONLY:
        loads_exactly(path)
    else:
        err = refuse_unchanged(path)
        text = str(err)
        assert file in text and problem in text, text
    with pytest.raises(tdcp.CheckpointError) as info:
        verify(path)
    assert file in str(info.value) and problem in str(info.value), str(info.value)


def test_tensor_shape_in_skeleton_disagrees_with_data(tmp_path: Path) -> None:
    """A manifest (consistently resealed) that claims other tensor shapes than the data: refused, unchanged."""
    path = saved(tmp_path)

    def grow(components: dict[str, Any]) -> None:
        state = json.dumps(components["stats"]["state"]).replace("[6]", "[7]")
        components["stats"]["state"] = json.loads(state)
        from torchrl_dcp.format.migrations import component_inventory

        components["stats"]["inventory"] = component_inventory("stats", components["stats"])

    edit_manifest(path, lambda m: grow(m["components"]))
    refuse_unchanged(path)
    with pytest.raises(tdcp.CheckpointError, match="stats"):
        verify(path)


@pytest.mark.parametrize("kind", ["empty", "foreign", "dcp_only", "file", "absent"])
def test_not_a_checkpoint(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "x"
    if kind == "empty":
        target.mkdir()
    elif kind == "foreign":
        target.mkdir()
        (target / "model.pt").write_bytes(b"\x80\x04K\x01.")
        (target / "README").write_text("not ours")
    elif kind == "dcp_only":  # a plain DCP checkpoint: its pickled .metadata is never read without a manifest
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(target), no_dist=True)
    elif kind == "file":
        target.write_bytes(b"plain text, not a checkpoint")
    err = refuse_unchanged(target)
    assert str(target) in str(err)
    expected = tdcp.CheckpointNotFoundError if kind == "absent" else tdcp.CheckpointError
    assert isinstance(err, expected)
    with pytest.raises(tdcp.CheckpointError):
        verify(target)


# ---------------------------------------------------------------------- symlinks
@pytest.mark.parametrize("which", [DATA, ".metadata", "manifest.json"])
def test_symlink_pointing_outside_is_refused(tmp_path: Path, which: str) -> None:
    """A listed file replaced by a symlink to an identical copy outside the checkpoint: refused anyway."""
    path = saved(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes((path / which).read_bytes())
    (path / which).unlink()
    (path / which).symlink_to(outside)
    err = refuse_unchanged(path)
    assert which in str(err) or (which == "manifest.json" and "manifest" in str(err)), str(err)
    with pytest.raises(tdcp.CheckpointError):
        verify(path)


def test_extra_symlink_and_symlinked_checkpoint_directory(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (path / "escape").symlink_to("/etc")
    refuse_unchanged(path, "escape")
    (path / "escape").unlink()
    link = tmp_path / "link"
    link.symlink_to(path)  # a link *to* a checkpoint is how users point at one: it loads
    objs = make_objects(2)
    checkpoint(objs).load(link)
    assert same(snapshot(objs), snapshot(make_objects(1)))


def test_save_never_writes_through_a_symlinked_destination(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    link = tmp_path / "ckpt"
    link.symlink_to(victim)
    with pytest.raises(tdcp.CheckpointError, match="refusing to replace"):
        checkpoint(make_objects(1)).save(link)
    assert (victim / "keep.txt").read_text() == "precious" and link.is_symlink()


@pytest.mark.parametrize("planted", ["notes.txt", "sub/x", "link", "__0_0.distcp.bak"])
@pytest.mark.parametrize("where", ["directory", "memory"])
def test_a_checkpoint_holding_entries_no_save_writes_is_not_replaced(tmp_path: Path, planted: str, where: str) -> None:
    """Saving over a committed checkpoint that holds something no save writes there (a user's notes, a folder, a
    link): refused on every backend alike, naming it, the checkpoint and the entry kept (it was deleted with the
    checkpoint on a local disk, refused on an object store)."""
    import uuid

    import fsspec

    path: Any = tmp_path / "c" if where == "directory" else f"memory://tdcp-hostile/{uuid.uuid4().hex}/c"
    checkpoint(make_objects(1)).save(path)
    name = planted.split("/")[0]
    if where == "directory":
        if planted == "link":
            (path / planted).symlink_to(tmp_path)
        else:
            (path / planted).parent.mkdir(exist_ok=True)
            (path / planted).write_text("mine")
    else:
        if planted == "link":
            pytest.skip("an object store has no links")
        fsspec.filesystem("memory").pipe_file(f"{path.removeprefix('memory://')}/{planted}", b"mine")
    with pytest.raises(
        tdcp.CheckpointError,
        match=rf"(holds entries a checkpoint never holds|holds objects a checkpoint never holds).*{name}",
    ):
        checkpoint(make_objects(2)).save(path)
    if where == "directory":
        assert (path / planted).is_symlink() if planted == "link" else (path / planted).read_text() == "mine"
        (path / planted).unlink()
        if "/" in planted:
            (path / name).rmdir()
    else:
        fsspec.filesystem("memory").rm(f"{path.removeprefix('memory://')}/{planted}")
    objs = make_objects(2)  # the checkpoint, as it was saved (a load refuses unlisted entries: they are gone)
    checkpoint(objs).load(path)
    assert same(snapshot(objs), snapshot(make_objects(1)))


@pytest.mark.parametrize("appears", ["a file in the old checkpoint", "a directory where there was none"])
def test_what_appears_at_the_path_while_a_save_runs_is_never_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, appears: str
) -> None:
    """A save checked the destination when it started; a user's file put into the old checkpoint meanwhile, or a
    directory of theirs made where there was none, was swapped out at the commit and deleted. What is there is
    checked again once it is out of the way: put back, and the save refused (nothing committed)."""
    from torchrl_dcp.storage import directory

    path = tmp_path / "c"
    if appears == "a file in the old checkpoint":
        checkpoint(make_objects(1)).save(path)
    real = directory.publish

    def late(staging: Path, destination: Path, **kwargs: Any) -> None:
        if appears == "a file in the old checkpoint":
            (destination / "eval.txt").write_text("mine")
        else:
            destination.mkdir()
            (destination / "data.csv").write_text("mine")
        real(staging, destination, **kwargs)

    monkeypatch.setattr(directory, "publish", late)
    with pytest.raises(tdcp.CheckpointError, match="changed while the save or conversion ran.*nothing was committed"):
        checkpoint(make_objects(2)).save(path)
    monkeypatch.setattr(directory, "publish", real)
    kept = path / ("eval.txt" if appears == "a file in the old checkpoint" else "data.csv")
    assert kept.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []
    if appears == "a file in the old checkpoint":
        kept.unlink()
        objs = make_objects(2)
        checkpoint(objs).load(path)  # the old checkpoint, as it was
        assert same(snapshot(objs), snapshot(make_objects(1)))


def test_an_archive_replacing_a_directory_keeps_a_file_put_into_it_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``to_archive(src, dst, overwrite=True)`` over a checkpoint directory: a user's file put into ``dst`` while the
    archive was written is put back with it, and the conversion refused."""
    from torchrl_dcp.storage import archive

    src, dst = checkpoint(make_objects(1)).save(tmp_path / "src"), checkpoint(make_objects(2)).save(tmp_path / "dst")
    real = archive.publish

    def late(staging: Path, destination: Path, **kwargs: Any) -> None:
        (destination / "eval.txt").write_text("mine")
        real(staging, destination, **kwargs)

    monkeypatch.setattr(archive, "publish", late)
    with pytest.raises(tdcp.CheckpointError, match="changed while the save or conversion ran"):
        tdcp.to_archive(src, dst, overwrite=True)
    assert (dst / "eval.txt").read_text() == "mine" and (dst / "manifest.json").is_file()


def test_removal_deletes_only_what_the_library_writes(tmp_path: Path) -> None:
    """Every removal (staging, trash, leftovers of killed saves and prunes, old checkpoints) goes through
    ``remove_tree``: it unlinks the files a save writes and the directories left empty, never a user's file, in
    whatever directory it sits (a file made in a checkpoint while it is pruned was deleted with it)."""
    from torchrl_dcp.storage.commit import remove_tree

    path = checkpoint(make_objects(1)).save(tmp_path / "c")
    (path / f".manifest.json.tmp-{'a' * 32}").write_text("a killed write's temporary file")
    (path / f".metadata.tmp-{'b' * 32}").write_text("our writer's, for .metadata")
    (path / ".metadata.tmp").write_text("DCP's")
    (path / "notes.txt").write_text("mine")
    (path / "videos").mkdir()
    (path / "videos" / "ep.mp4").write_text("mine too")
    (path / "empty").mkdir()
    (path / "eval_video").symlink_to("videos/ep.mp4")  # a user's links are theirs too (a save refuses them as foreign)
    (path / "__0_9.distcp").symlink_to("videos/ep.mp4")  # one planted under a name of ours: itself removed
    for folder in ("manifest-3.json", "__0_5.distcp"):  # a user's directory named like our files: kept whole
        (path / folder).mkdir()
        (path / folder / "manifest.json").write_text("theirs")
    kept = remove_tree(path)
    assert sorted(kept) == [  # (a save never makes a subdirectory)
        "__0_5.distcp/",
        "empty/",
        "eval_video",
        "manifest-3.json/",
        "notes.txt",
        "videos/",
    ]
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*")) == [
        "__0_5.distcp",
        "__0_5.distcp/manifest.json",
        "empty",
        "eval_video",
        "manifest-3.json",
        "manifest-3.json/manifest.json",
        "notes.txt",
        "videos",
        "videos/ep.mp4",
    ]
    assert (path / "eval_video").is_symlink() and (path / "videos" / "ep.mp4").read_text() == "mine too"
    assert remove_tree(tmp_path / "gone") == []


def test_a_killed_prunes_trash_keeps_the_users_files_when_swept(tmp_path: Path) -> None:
    """A prune killed after renaming an entry holding a user's file to its trash name: the next save sweeps the
    leftover and keeps the file (the whole trash directory was removed)."""
    from torchrl_dcp.storage.commit import trash_path

    run = tmp_path / "run"
    rotation = tdcp.rotation.CheckpointRotation(run, keep_last=1)
    first = rotation.save(checkpoint(make_objects(1)), step=1)
    (first / "eval.txt").write_text("mine")
    trash = trash_path(first)
    first.rename(trash)  # (what the killed prune left)
    rotation.save(checkpoint(make_objects(2)), step=2)
    assert (trash / "eval.txt").read_text() == "mine" and not (trash / "manifest.json").exists()


def test_to_directory_replaces_an_archive_with_overwrite(tmp_path: Path) -> None:
    """``to_directory(src, dst, overwrite=True)`` where ``dst`` is a checkpoint archive: replaced (archive.md)."""
    src = checkpoint(make_objects(1)).save(tmp_path / "c")
    archive_path = tdcp.to_archive(src, tmp_path / "b.zip")
    out = tdcp.to_directory(tdcp.to_archive(src, tmp_path / "a.zip"), archive_path, overwrite=True)
    assert out.is_dir() and (out / "manifest.json").is_file()


def test_an_archive_to_a_free_path_never_replaces_a_file_made_there_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``to_archive`` to a free path: a user's file (or directory) made there while the archive was written was
    overwritten (deleted); it is now kept and the conversion refused."""
    from torchrl_dcp.storage import archive

    src = checkpoint(make_objects(1)).save(tmp_path / "src")
    real = archive.publish

    def late(staging: Path, destination: Path, **kwargs: Any) -> None:
        destination.write_text("mine")
        real(staging, destination, **kwargs)

    monkeypatch.setattr(archive, "publish", late)
    with pytest.raises(tdcp.CheckpointError, match="changed while the save or conversion ran"):
        tdcp.to_archive(src, tmp_path / "out.zip")
    assert (tmp_path / "out.zip").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if "tdcp-tmp" in p.name] == []


def test_pruning_keeps_what_a_user_put_into_an_old_checkpoint(tmp_path: Path) -> None:
    """A rotation pruning a step whose directory holds a user's files (put there after its save) removes the
    checkpoint's own files and keeps theirs (the directory stays, no longer a checkpoint), as an object store's
    pruning does; it removed the whole directory."""
    run = tmp_path / "run"
    rotation = tdcp.rotation.CheckpointRotation(run, keep_last=1)
    first = rotation.save(checkpoint(make_objects(1)), step=1)
    (first / "eval.txt").write_text("mine")
    (first / "videos").mkdir()
    (first / "videos" / "ep.mp4").write_text("mine too")
    rotation.save(checkpoint(make_objects(2)), step=2)
    assert sorted(p.name for p in first.iterdir()) == ["eval.txt", "videos"]
    assert (first / "videos" / "ep.mp4").read_text() == "mine too"
    assert [e.step for e in rotation.entries()] == [2]


# ---------------------------------------------------------------------- planted pickles
def test_pickle_in_metadata_never_runs(tmp_path: Path) -> None:
    """A resealed ``.metadata`` that is a payload: ``verify`` refuses to unpickle it, naming it; a load never reads
    it (its tensors are placed by the manifest) and restores exactly the saved state; nothing runs."""
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(path, ".metadata")
    loads_exactly(path)
    with pytest.raises(tdcp.UnsafeCheckpointError) as info:
        verify(path)
    assert ".metadata" in str(info.value) and "refused" in str(info.value), str(info.value)
    assert not marker.exists()


def test_pickle_nested_inside_valid_metadata_never_runs(tmp_path: Path) -> None:
    """The payload hidden inside a genuine Metadata object (as a planner_data value)."""
    from torchrl_dcp.storage.filesystem import safe_load_metadata

    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    metadata = safe_load_metadata(path / ".metadata")
    metadata.planner_data = {"x": Payload(marker)}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path, ".metadata")
    loads_exactly(path)  # (loads never read .metadata)
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"\.metadata"):
        verify(path)
    assert not marker.exists()


def _build_on(target: bytes, state: bytes) -> bytes:
    """Protocol-2 opcodes that push ``target`` (opcodes), then ``state`` (opcodes), and ``BUILD`` it: no class of the
    payload's own, only allowed globals."""
    return target + state + b"b"


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw  # BINUNICODE


# BUILD onto what the allow-list admits: an allowed class itself (slot state: setattr on the class), an allowed
# function (dict state: its __dict__), a process-wide enum member an allowed callable returns (its __dict__)
_PATCHES = {
    "class": _build_on(b"cpathlib\nPosixPath\n", b"N}" + _text("tdcp_probe") + b"K\x01s\x86"),
    "function": _build_on(b"ctorch.serialization\n_get_layout\n", b"}" + _text("tdcp_probe") + b"K\x01s"),
    "enum member": _build_on(
        b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R",
        b"}" + _text("tdcp_probe") + b"K\x01s",
    ),
    # NEWOBJ of an enum: its __new__ returns the shared member, which BUILD then took for an object the file made
    "enum member by NEWOBJ": _build_on(
        b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85\x81",
        b"}" + _text("tdcp_probe") + b"K\x01s",
    ),
}


@pytest.mark.parametrize("target", sorted(_PATCHES))
def test_metadata_cannot_patch_the_classes_and_objects_the_allow_list_admits(tmp_path: Path, target: str) -> None:
    """``find_class`` alone let a planted ``.metadata`` ``BUILD`` onto an allowed class, function or shared enum
    member: ``verify`` refused the file afterwards, but the process was already patched (``PosixPath.__fspath__``
    redirected every later write of the user's). ``BUILD`` now applies only to objects the metadata created."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.serialization import _get_layout

    patched = {
        "class": pathlib.PosixPath,
        "function": _get_layout,
        "enum member": _MEM_FORMAT_ENCODING(0),
        "enum member by NEWOBJ": _MEM_FORMAT_ENCODING(0),
    }[target]
    path = saved(tmp_path)
    (path / ".metadata").write_bytes(b"\x80\x02" + _PATCHES[target] + b"0N.")
    reseal(path, ".metadata")
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"\.metadata.*(did not create|with NEWOBJ)") as info:
        verify(path)
    assert "tdcp_probe" not in vars(patched), str(info.value)


def test_pickle_in_data_file_never_runs(tmp_path: Path) -> None:
    """A data file replaced by a pickle (checksums resealed): read only as tensor bytes, never unpickled."""
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / DATA).write_bytes(pickle.dumps(Payload(marker)))
    refuse_unchanged(path, DATA)  # checksum
    reseal(path, DATA)
    refuse_unchanged(path)
    with pytest.raises(tdcp.CheckpointError):
        verify(path)  # verify never opens the blob as a pickle either
    assert not marker.exists()


def test_pickle_as_tensor_blob_payload_never_runs(tmp_path: Path) -> None:
    """A torch.save blob whose data.pkl holds a payload, at a tensor's offset: weights_only refuses it."""
    import io

    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": Payload(marker)}, buf)
    blob = buf.getvalue()
    data = bytearray((path / DATA).read_bytes())
    data[: len(blob)] = blob  # over the first tensor's blob (the metadata still points at offset 0)
    (path / DATA).write_bytes(bytes(data[: max(len(blob), len(data))]))
    reseal(path, DATA)
    refuse_unchanged(path)
    assert not marker.exists()


def test_pickle_in_manifest_or_extra_file_never_runs(tmp_path: Path) -> None:
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / "extra.pkl").write_bytes(pickle.dumps(Payload(marker)))
    reseal(path, "extra.pkl")  # listed in the manifest: a name no save writes, refused (never opened as pickle)
    objs = make_objects(2)
    with pytest.raises(tdcp.CheckpointFormatError, match="file name 'extra.pkl' is not one a save writes"):
        checkpoint(objs).load(path)
    with pytest.raises(tdcp.CheckpointFormatError, match="'extra.pkl' is not one a save writes"):
        verify(path)
    (path / "manifest.json").write_bytes(pickle.dumps(Payload(marker)))
    refuse_unchanged(path, "not valid JSON")
    assert not marker.exists()


@pytest.mark.parametrize("mirrored", [False, True], ids=["metadata only", "manifest entries too"])
def test_metadata_naming_files_outside_or_unlisted(tmp_path: Path, mirrored: bool) -> None:
    """Records naming a file outside the checkpoint, or one it does not list. In ``.metadata`` only: ``verify``
    refuses naming it and the problem, a load (which never reads it) restores exactly the saved state. Moved in the
    manifest's storage entries too (a complete forger): the load and ``verify`` refuse naming the file."""
    from torchrl_dcp.storage.filesystem import safe_load_metadata

    for target, problem in (
        ("../../etc/passwd", "outside the checkpoint"),
        ("/etc/passwd", "outside"),
        ("other.distcp", "does not list"),
    ):
        path = tmp_path / target.replace("/", "_")
        path = checkpoint(make_objects(1)).save(path)
        metadata = safe_load_metadata(path / ".metadata")
        for info in metadata.storage_data.values():
            info.relative_path = target
        if mirrored:
            assert forging.write_metadata(path, metadata)
            refuse_unchanged(path, f"names {target!r}, which is not in 'files'")
            with pytest.raises(tdcp.CheckpointError, match="which is not in 'files'") as info:
                verify(path)
            assert repr(target) in str(info.value), str(info.value)
        else:
            (path / ".metadata").write_bytes(pickle.dumps(metadata))
            reseal(path, ".metadata")
            loads_exactly(path)
            with pytest.raises(tdcp.CheckpointError, match=problem) as info:
                verify(path)
            assert ".metadata" in str(info.value), str(info.value)


# ---------------------------------------------------------------------- archives
def archive(tmp_path: Path) -> Path:
    return tdcp.to_archive(saved(tmp_path), tmp_path / "ckpt.zip")


def rewrite_zip(src: Path, dst: Path, rename: Callable[[str], str]) -> None:
    """Copy ``src`` member by member (STORED) with renamed members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(rename(info.filename), zin.read(info.filename))


def test_archive_round_trip(tmp_path: Path) -> None:
    path = archive(tmp_path)
    objs = make_objects(2)
    checkpoint(objs).load(path)
    assert same(snapshot(objs), snapshot(make_objects(1)))
    verify(path)


ARCHIVE_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated central directory": (lambda p: p.write_bytes(p.read_bytes()[:-30]), "central directory"),
    "end record garbled": (lambda p: flip(p, 0.9999), "central directory"),
    "central directory offset wrong": (
        lambda p: _patch_end(p, lambda cd_size, cd_off: (cd_size, cd_off + 7)),
        "central directory",
    ),
    "trailing bytes": (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "end record"),
    "flipped byte in a member": (lambda p: _flip_member(p, DATA), "damaged"),
    "empty file": (lambda p: p.write_bytes(b""), "ZIP"),
}


def _flip_member(p: Path, name: str) -> None:
    """Flip a bit in the middle of member ``name``'s data (a member a load reads: loads never read ``.metadata``)."""
    from torchrl_dcp.storage.archive import read_index

    member = read_index(p)[name]
    data = bytearray(p.read_bytes())
    data[member.data_offset + member.size // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _patch_end(p: Path, fn: Callable[[int, int], tuple[int, int]]) -> None:
    import struct

    data = bytearray(p.read_bytes())
    at = len(data) - 22
    cd_size, cd_off = struct.unpack_from("<II", data, at + 12)
    struct.pack_into("<II", data, at + 12, *fn(cd_size, cd_off))
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("case", sorted(ARCHIVE_DAMAGE))
def test_damaged_archive_is_refused(tmp_path: Path, case: str) -> None:
    damage, problem = ARCHIVE_DAMAGE[case]
    path = archive(tmp_path)
    damage(path)
    err = refuse_unchanged(path)
    assert "ckpt.zip" in str(err) and problem in str(err), str(err)
    with pytest.raises(tdcp.CheckpointError, match=problem):
        verify(path)


def test_damaged_metadata_member_is_refused_by_verify_and_never_read_by_a_load(tmp_path: Path) -> None:
    """A flipped byte in the archive's ``.metadata``: ``verify`` refuses naming the member; a load reads the
    manifest's storage entries instead and restores exactly the saved state."""
    path = archive(tmp_path)
    _flip_member(path, ".metadata")
    loads_exactly(path)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"ckpt\.zip::\.metadata: checksum.*damaged"):
        verify(path)


@pytest.mark.parametrize(
    "name", ["../evil.distcp", "/abs/evil.distcp", "sub/../../evil", "..\\evil", "sub/file", "__0_0\n.distcp"]
)
def test_archive_member_escaping_is_refused(tmp_path: Path, name: str) -> None:
    src = archive(tmp_path)
    bad = tmp_path / "bad.zip"
    rewrite_zip(src, bad, lambda n: name if n == DATA else n)
    err = refuse_unchanged(bad)
    assert "bad.zip" in str(err), str(err)
    assert "\x00" not in str(err) and "\n" not in str(err), "a NUL or a newline of the name reached the message"
    with pytest.raises(tdcp.CheckpointError):
        verify(bad)
    with pytest.raises(tdcp.CheckpointError):  # converting back never writes outside its target either
        tdcp.to_directory(bad, tmp_path / "out")
    assert not (tmp_path / "evil.distcp").exists() and not Path("/abs/evil.distcp").exists()


@pytest.mark.parametrize("mode", [0o120777, 0o040755, 0o010644], ids=["symlink", "directory", "fifo"])
@pytest.mark.parametrize("payload", ["genuine bytes", "a link target"])
def test_archive_member_of_another_file_type_is_refused(tmp_path: Path, mode: int, payload: str) -> None:
    """A member recorded as a link (or a directory, a FIFO): ``unzip`` makes one. Marked so over the member's
    genuine bytes, every checksum still held and the archive verified and loaded (the mode was never read)."""
    src = archive(tmp_path)
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == DATA:
                link = zipfile.ZipInfo(DATA)
                link.create_system = 3  # (Unix: the high 16 bits of the external attributes are its mode)
                link.external_attr = (mode << 16) | 0x20
                zout.writestr(link, data if payload == "genuine bytes" else b"/etc/passwd")
            else:
                zout.writestr(info.filename, data)
    err = refuse_unchanged(bad)
    if payload == "genuine bytes":
        assert "not a regular file" in str(err) and f"bad.zip::{DATA}" in str(err), str(err)
    with pytest.raises(tdcp.CheckpointError):
        verify(bad)
    with pytest.raises(tdcp.CheckpointError):
        tdcp.to_directory(bad, tmp_path / "out")
    assert not (tmp_path / "out" / DATA).is_symlink()


def test_pickle_in_archive_metadata_never_runs(tmp_path: Path) -> None:
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(path, ".metadata")
    bad = tdcp.to_archive(path, tmp_path / "bad.zip")
    loads_exactly(bad)  # (loads never read .metadata)
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"bad\.zip::\.metadata"):
        verify(bad)
    assert not marker.exists()


@pytest.mark.parametrize("call", ["load", "inspect", "verify"])
def test_an_archive_swapped_for_a_fifo_is_refused_not_waited_on(tmp_path: Path, call: str) -> None:
    """The path was an archive when it was looked at, and is a FIFO when it is opened: refused at once."""
    import os
    import threading

    from torchrl_dcp.cli import main as cli
    from torchrl_dcp.storage.archive import ArchiveContainer, ArchiveLocation

    zipped = tdcp.to_archive(saved(tmp_path), tmp_path / "c.zip")
    location = ArchiveLocation(zipped)  # what the dispatch decided while it was a file
    zipped.unlink()
    os.mkfifo(zipped)
    outcome: list[BaseException | int] = []

    def run() -> None:
        try:
            if call == "load":
                checkpoint(make_objects(2)).load(zipped)  # dispatched again: not a file, so not an archive
                ArchiveContainer(zipped).manifest()
            elif call == "inspect":
                location.manifest()
            else:
                outcome.append(cli(["verify", str(zipped)]))
                location.open_source().check(True)
        except tdcp.CheckpointError as err:
            outcome.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert outcome and isinstance(outcome[-1], tdcp.CheckpointError), outcome
