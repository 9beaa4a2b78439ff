"""Checkpoints at fsspec URLs: every entry point × backend (``memory://``, and s3fs against a local moto server)."""

from __future__ import annotations

import json
import pickle
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp.cli import main as cli
from torchrl_dcp.format.layout import identity_trailer, shard_name
from torchrl_dcp.storage.objectstore import list_objects
from torchrl_dcp.storage.objectstore_save import PENDING, marker_for
from torchrl_dcp.storage.objectstore_tools import download_checkpoint
from torchrl_dcp.storage.urls import StorePath, copy_object, resolve_path

BACKENDS = ["memory", "s3"]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """``(fresh prefix URL, storage_options)`` on each backend."""
    if request.param == "memory":
        return f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(), s3.storage_options


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    policy = torch.nn.Linear(64, 512)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(4, 64)).sum().backward()
    optim.step()
    big = {"x": torch.randn(3_000_000), "i": torch.arange(7)}  # > one 5 MiB part: a multipart upload on S3
    return {"policy": policy, "optim": optim, "big": big, "stats": {"episodes": seed}}


def _ckpt(objs: dict[str, Any], options: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(
        policy=objs["policy"], optim=objs["optim"], big=objs["big"], storage_options=options
    )
    ckpt.register("stats", objs["stats"], placement="per_rank")
    return ckpt


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(x, y) for x, y in zip(a["policy"].state_dict().values(), b["policy"].state_dict().values()))
        and all(torch.equal(a["big"][k], b["big"][k]) for k in a["big"])
        and a["optim"].state_dict()["state"][0]["exp_avg"].equal(b["optim"].state_dict()["state"][0]["exp_avg"])
    )


def _store_fs(url: str, options: dict[str, Any]) -> Any:
    return resolve_path(url, options).fs


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDCP_STORE_PART_SIZE", str(5 << 20))


# ---------------------------------------------------------------------- save, load, verify
def test_save_load_verify_round_trip(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    saved = _objects(1)
    path = _ckpt(saved, options).save(f"{url}/step-1", step=1, metadata={"reward": 2.5})
    assert isinstance(path, StorePath) and str(path) == f"{url}/step-1"
    fresh = _objects(2)
    result = _ckpt(fresh, options).load(f"{url}/step-1")
    assert result.loaded == {"policy", "optim", "big", "stats"} and result.step == 1
    assert result.values["stats"] == {"episodes": 1} and _same(saved, fresh)
    summary = tdcp.verify(f"{url}/step-1", storage_options=options)
    assert summary["files"] == 3 and summary["tensors"] > 4  # .metadata, the data, rank 0's manifest shard
    names = sorted(n.rsplit("/", 1)[-1] for n in _store_fs(url, options).ls(path.key, detail=False))
    assert names == [".metadata", "__0_shared.distcp", shard_name(0), "manifest.json"]  # (stats is per_rank: a shard)
    assert not _store_fs(url, options).exists(marker_for(path).key)  # the marker went with the commit


def test_same_format_as_a_local_save(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, options = store
    objs = _objects(3)
    remote = _ckpt(objs, options).save(f"{url}/c", step=3)
    local = download_checkpoint(remote, tmp_path / "copy")  # byte for byte, checksums compared
    assert tdcp.verify(local)["files"] == 3  # .metadata, the data, rank 0's manifest shard
    assert sorted(p.name for p in local.iterdir()) == [".metadata", "__0_shared.distcp", shard_name(0), "manifest.json"]
    target = {"replicated/big/x": torch.zeros(3_000_000)}
    dcp.load(target, checkpoint_id=str(local), no_dist=True)  # a plain DCP load reads the same layout
    assert torch.equal(target["replicated/big/x"], objs["big"]["x"])
    assert _ckpt(_objects(4), {}).load(local).loaded == {"policy", "optim", "big", "stats"}


def test_async_save_to_a_url(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    objs = _objects(5)
    handle = _ckpt(objs, options).async_save(f"{url}/a", step=5)
    assert str(handle.wait()) == f"{url}/a"
    fresh = _objects(6)
    assert _ckpt(fresh, options).load(f"{url}/a").step == 5 and _same(objs, fresh)


def test_overwrite_replaces_and_foreign_objects_are_refused(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    ckpt = _ckpt(_objects(7), options)
    ckpt.save(f"{url}/c", step=1)
    ckpt.save(f"{url}/c", step=2)
    assert tdcp.read_manifest(resolve_path(f"{url}/c", options))["step"] == 2
    assert _ckpt(_objects(8), options).load(f"{url}/c").step == 2
    fs = _store_fs(url, options)
    fs.pipe_file(resolve_path(f"{url}/foreign/data.bin", options).key, b"not ours")
    with pytest.raises(tdcp.CheckpointError, match="no valid manifest.json: not a torchrl_dcp checkpoint"):
        ckpt.save(f"{url}/foreign", step=3)
    assert fs.cat_file(resolve_path(f"{url}/foreign/data.bin", options).key) == b"not ours"


def test_a_users_objects_named_like_ours_in_a_checkpoint_are_never_replaced(store: tuple[str, dict[str, Any]]) -> None:
    """A user's ``__7_0.distcp`` or ``manifest-7.json`` put into a committed checkpoint's prefix (not listed by its
    manifest) was deleted by the next save there and by ``to_directory(overwrite=True)``, where a local directory
    refuses both: only the objects its manifest lists are replaced."""
    url, options = store
    ckpt = _ckpt(_objects(7), options)
    target = resolve_path(f"{url}/c", options)
    ckpt.save(target, step=1)
    local = tdcp.to_archive(target, StorePath(f"{url}/c.zip", storage_options=options))
    fs = _store_fs(url, options)
    for name in ("__7_0.distcp", "manifest-7.json"):
        fs.pipe_file((target / name).key, b"mine")
        with pytest.raises(tdcp.CheckpointError, match=rf"never holds \(\['{name}'\]\)"):
            ckpt.save(target, step=2)
        with pytest.raises(tdcp.CheckpointError, match=rf"never holds \(\['{name}'\]\)"):
            tdcp.to_directory(local, target, overwrite=True)
        assert fs.cat_file((target / name).key) == b"mine" and tdcp.read_manifest(target)["step"] == 1
        fs.rm_file((target / name).key)
    ckpt.save(target, step=2)  # (the checkpoint alone: replaced)
    assert tdcp.read_manifest(target)["step"] == 2


def test_overwrite_never_replaces_a_users_zip_whose_first_member_has_our_name(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``to_archive`` and ``export_torchrl`` with ``overwrite=True`` replaced any ZIP object whose first member is
    named ``manifest.json`` (or ``components/...``), read from its first 64 bytes; a local path reads its manifest.
    The object's ``manifest.json`` must now be ours (or torchrl's, for an export)."""
    import io
    import zipfile

    url, options = store
    src = _ckpt(_objects(8), options).save(tmp_path / "c", step=1)
    fs = _store_fs(url, options)
    for first, kind in (("manifest.json", "archive"), ("components/readme.txt", "export")):
        body = io.BytesIO()
        with zipfile.ZipFile(body, "w") as z:
            z.writestr(first, b'{"extension": "mine"}')
            if first != "manifest.json":
                z.writestr("manifest.json", b'{"format": "mine"}')
        dst = resolve_path(f"{url}/user-{kind}.zip", options)
        fs.pipe_file(dst.key, body.getvalue())
        with pytest.raises(tdcp.CheckpointError, match="refusing to replace it|is not a torchrl.checkpoint"):
            if kind == "archive":
                tdcp.to_archive(src, dst, overwrite=True)
            else:
                tdcp.export_torchrl(src, dst, ["policy"], overwrite=True)
        assert fs.cat_file(dst.key) == body.getvalue()
    ours = resolve_path(f"{url}/ours.zip", options)  # (an archive of ours is still replaced)
    tdcp.to_archive(src, ours)
    tdcp.to_archive(src, ours, overwrite=True)
    exported = resolve_path(f"{url}/exported.zip", options)
    tdcp.export_torchrl(src, exported, ["policy"])
    tdcp.export_torchrl(src, exported, ["policy"], overwrite=True)


def test_overwrite_never_replaces_a_users_zip_a_local_path_would_keep(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Probe r3: a user's ZIP holding a checkpoint's files (deflated) and a note of theirs, or their file with a
    torchrl archive appended, was replaced by ``overwrite=True`` in a store (read with zipfile alone), where a local
    path refuses both: the object is read as a local archive is now (one central directory to every reader; ours
    STORED, holding only files a save writes)."""
    import io
    import os
    import zipfile

    from torchrl.checkpoint import Checkpoint

    url, options = store
    src = _ckpt(_objects(8), options).save(tmp_path / "c", step=1)
    fs = _store_fs(url, options)
    bundle = io.BytesIO()
    with zipfile.ZipFile(bundle, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(os.listdir(src)):
            z.write(src / name, name)
        z.writestr("my_notes.txt", "results I care about")
    theirs = Checkpoint(policy=torch.nn.Linear(2, 2)).save(tmp_path / "t.torchrl", format="archive")
    for kind, body in (("archive", bundle.getvalue()), ("export", b"my notes\n" + theirs.read_bytes())):
        dst = resolve_path(f"{url}/user-{kind}.zip", options)
        fs.pipe_file(dst.key, body)
        with pytest.raises(tdcp.CheckpointError, match="refusing to replace it|is not a torchrl.checkpoint"):
            if kind == "archive":
                tdcp.to_archive(src, dst, overwrite=True)
            else:
                tdcp.export_torchrl(src, dst, ["policy"], overwrite=True)
        assert fs.cat_file(dst.key) == body


# ---------------------------------------------------------------------- a prefix without a manifest; leftovers
def test_prefix_without_manifest_is_absent_and_swept(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    ckpt = _ckpt(_objects(9), options)
    ckpt.save(f"{url}/step-000000000001", step=1)
    dead = resolve_path(f"{url}/step-000000000002", options)
    fs = dead.fs
    sid = "d" * 32  # what a save killed after uploading its data leaves: its marker, a data object of that save
    fs.pipe_file(marker_for(dead).key, json.dumps({"save_id": sid, "started": 0.0}).encode())
    fs.pipe_file((dead / "__0_shared.distcp").key, b"partial" + identity_trailer(sid, 0))
    with pytest.raises(tdcp.CheckpointNotFoundError, match="has not committed"):
        _ckpt(_objects(10), options).load(dead)
    rotation = tdcp.CheckpointRotation(url, storage_options=options)
    assert [e.step for e in rotation.entries()] == [1]
    assert [e.committed for e in rotation.entries(include_uncommitted=True)] == [True, False]
    rotation.save(ckpt, step=3)  # the next save sweeps the dead one
    assert not fs.exists((dead / "__0_shared.distcp").key) and not fs.exists(marker_for(dead).key)
    assert not [n for n in fs.ls(resolve_path(url, options).key, detail=False) if n.endswith(PENDING)]


@pytest.mark.parametrize(
    "planted", ["parent", "unrelated prefix", "foreign object", "other save", "other save's chunk file", "no save id"]
)
def test_sweeps_delete_only_what_a_killed_save_wrote(store: tuple[str, dict[str, Any]], planted: str) -> None:
    """A marker planted by someone else never makes a save delete committed checkpoints or the user's data."""
    url, options = store
    rotation = tdcp.CheckpointRotation(url, keep_last=5, storage_options=options)
    ckpt = _ckpt(_objects(12), options)
    rotation.save(ckpt, step=1)
    root = resolve_path(url, options)
    fs, sid = root.fs, "e" * 32
    marker = {"save_id": sid, "started": 0.0}
    kept: dict[str, bytes] = {}
    if planted == "parent":  # names no entry: the parent prefix itself
        fs.pipe_file((root / PENDING).key, json.dumps(marker).encode())
    else:
        data = root / "datasets"
        fs.pipe_file(marker_for(data).key, json.dumps(marker if planted != "no save id" else {}).encode())
        files = {
            "unrelated prefix": {"train/part-0.csv": b"a,b\n1,2\n"},
            "foreign object": {"__0_shared.distcp": b"x" * 10 + identity_trailer(sid, 0), "notes.txt": b"mine"},
            "other save": {"__0_shared.distcp": b"x" * 10 + identity_trailer("f" * 32, 0)},
            # a chunk file: only the saves the marker names as kept from its base (none here) may have written it
            "other save's chunk file": {"__0_1.distcp": b"x" * 10 + identity_trailer("f" * 32, 0)},
            "no save id": {"__0_shared.distcp": b"x" * 10 + identity_trailer(sid, 0)},
        }[planted]
        for name, body in files.items():
            fs.pipe_file((data / name).key, body)
            kept[(data / name).key] = body
    rotation.save(ckpt, step=2)  # sweeps the parent prefix first
    assert [e.step for e in rotation.entries()] == [1, 2]
    assert _ckpt(_objects(13), options).load(f"{url}/step-000000000001").step == 1
    for key, body in kept.items():
        assert fs.cat_file(key) == body, f"{key} was deleted or changed"


def test_missing_prefix_is_not_found(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    with pytest.raises(tdcp.CheckpointNotFoundError, match="nothing under this prefix"):
        _ckpt(_objects(11), options).load(f"{url}/nothing")


def test_a_bucket_that_does_not_exist_is_said_never_taken_for_an_empty_prefix(s3: Any) -> None:
    """A typo in the bucket's name: a resume returned None (start fresh, silently) and a load said "nothing under
    this prefix"; the job learnt it only at its first save."""
    options = s3.storage_options
    url = "s3://no-such-bucket-tdcp/run"
    ckpt = _ckpt(_objects(11), options)
    for action in (
        lambda: tdcp.CheckpointRotation(url, storage_options=options).resume(ckpt),
        lambda: tdcp.CheckpointRotation(url, storage_options=options).latest(),
        lambda: ckpt.load(f"{url}/step-1"),
        lambda: tdcp.verify(f"{url}/step-1", storage_options=options),
    ):
        with pytest.raises(tdcp.CheckpointError, match=r"its bucket does not exist \('no-such-bucket-tdcp'") as err:
            action()
        assert not isinstance(err.value, tdcp.CheckpointNotFoundError)


def test_a_missing_shard_object_is_said_as_the_other_backends_say_it(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    _ckpt(_objects(12), options).save(f"{url}/c")
    gone = resolve_path(f"{url}/c/{shard_name(0)}", options)
    gone.fs.rm_file(gone.key)
    for action in (
        lambda: _ckpt(_objects(13), options).load(f"{url}/c"),
        lambda: tdcp.verify(f"{url}/c", storage_options=options),
    ):
        with pytest.raises(
            tdcp.CheckpointIntegrityError, match="manifest-0.json: object listed in the manifest is missing"
        ):
            action()


# ---------------------------------------------------------------------- damaged and hostile objects
def _damage(url: str, options: dict[str, Any], name: str, how: str) -> None:
    obj = resolve_path(f"{url}/c/{name}", options)
    data = bytearray(obj.fs.cat_file(obj.key))
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    obj.fs.pipe_file(obj.key, bytes(data))


@pytest.mark.parametrize(
    ("name", "how", "match"),
    [
        ("__0_shared.distcp", "flip", "checksum is crc32:"),
        ("__0_shared.distcp", "truncate", "truncated or altered"),
        (".metadata", "flip", "checksum is crc32:"),
        (shard_name(0), "flip", "checksum is crc32:"),
    ],
)
def test_damaged_objects_are_refused(store: tuple[str, dict[str, Any]], name: str, how: str, match: str) -> None:
    """A damaged object: ``verify`` refuses naming it; a load refuses naming it with nothing restored, except for
    ``.metadata``, which loads never read (format 5: the manifest places the tensors), so that one loads exactly."""
    url, options = store
    saved = _objects(12)
    _ckpt(saved, options).save(f"{url}/c")
    _damage(url, options, name, how)
    fresh = _objects(13)
    before = fresh["big"]["x"].clone()
    if name == ".metadata":
        _ckpt(fresh, options).load(f"{url}/c")
        assert _same(saved, fresh) and fresh["stats"] == {"episodes": 12}
    else:
        with pytest.raises(tdcp.CheckpointError, match=match) as err:
            _ckpt(fresh, options).load(f"{url}/c")
        assert name in str(err.value) and torch.equal(fresh["big"]["x"], before)  # names the object; nothing restored
    with pytest.raises(tdcp.CheckpointError, match=match) as err:
        tdcp.verify(f"{url}/c", storage_options=options)
    assert name in str(err.value)


class _Boom:
    def __reduce__(self) -> Any:
        return (exec, ("import pathlib; pathlib.Path('/tmp/tdcp-pwned-objstore').touch()",))


def test_hostile_metadata_is_never_unpickled(store: tuple[str, dict[str, Any]]) -> None:
    """A payload as ``.metadata``, resealed in the root manifest: ``verify`` refuses to unpickle it; a load never reads
    it (format 5: the manifest places the tensors) and restores exactly the saved state; nothing runs."""
    url, options = store
    saved = _objects(14)
    _ckpt(saved, options).save(f"{url}/c")
    root = resolve_path(f"{url}/c", options)
    payload = pickle.dumps(_Boom())
    root.fs.pipe_file((root / ".metadata").key, payload)
    manifest = json.loads(root.fs.cat_file((root / "manifest.json").key))  # a forger also fixes the manifest
    manifest["files"][".metadata"] = {"size": len(payload), "checksum": tdcp_crc(payload)}
    manifest.pop("manifest_checksum", None)
    from torchrl_dcp.format.manifest import dumps, seal

    root.fs.pipe_file((root / "manifest.json").key, dumps(seal(manifest)))
    Path("/tmp/tdcp-pwned-objstore").unlink(missing_ok=True)
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"\.metadata.*refused to unpickle builtins\.exec"):
        tdcp.verify(root)
    fresh = _objects(15)
    _ckpt(fresh, options).load(root)
    assert _same(saved, fresh) and fresh["stats"] == {"episodes": 14}
    assert not Path("/tmp/tdcp-pwned-objstore").exists()


def tdcp_crc(data: bytes) -> str:
    from torchrl_dcp.format.checksums import crc32, format_crc

    return format_crc(crc32(data))


# ---------------------------------------------------------------------- rotation, conversion, CLI
def test_rotation_keeps_last_and_resumes(store: tuple[str, dict[str, Any]]) -> None:
    url, options = store
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=2, storage_options=options)
    objs = _objects(16)
    ckpt = _ckpt(objs, options)
    for step in (10, 20, 30):
        rotation.save(ckpt, step=step)
    assert [e.step for e in rotation.entries()] == [20, 30] and str(rotation.latest()).endswith("step-000000000030")
    fresh = _objects(17)
    info = tdcp.CheckpointRotation(f"{url}/run", storage_options=options).resume(_ckpt(fresh, options))
    assert info is not None and info.step == 30 and isinstance(info.path, StorePath) and _same(objs, fresh)
    again = _objects(19)
    info = tdcp.resume(_ckpt(again, options), f"{url}/run")  # the checkpoint's storage options list and load
    assert info is not None and info.step == 30 and _same(objs, again)


def test_glob_characters_in_keys_never_reach_other_objects(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """``*``, ``?`` and ``[`` are legal in keys, and fsspec's ``rm``/``copy`` expand them: pruning a rotation of
    ``run*`` deleted ``run-A``'s objects (its checkpoint then refused as damaged), and an export replacing
    ``export*`` deleted ``export-other``'s. Every deletion of store objects goes through ``delete_objects``."""
    url, options = store
    objs = _objects(20)
    other = _ckpt(objs, options).save(f"{url}/run-A/step-000000000001", step=1)
    rotation = tdcp.CheckpointRotation(f"{url}/run*", keep_last=1, storage_options=options)
    ckpt = _ckpt(objs, options)
    for step in (1, 2, 3):
        rotation.save(ckpt, step=step)
    assert [e.step for e in rotation.entries()] == [3]
    tdcp.verify(other)  # another run's checkpoint, untouched
    fs = _store_fs(url, options)
    precious = resolve_path(f"{url}/export-other/precious.bin", options)
    fs.pipe_file(precious.key, b"mine")
    for _ in range(2):  # the second replaces the first (overwrite=True)
        tdcp.export_torchrl(other, resolve_path(f"{url}/export*", options), ["policy"], overwrite=True)
    assert fs.cat_file(precious.key) == b"mine"


def test_export_overwrite_on_a_store_keeps_a_users_objects(store: tuple[str, dict[str, Any]]) -> None:
    """A directory export replaced on a store deleted every object under its prefix: a user's notes put there too.
    Only the files torchrl's manifest lists are replaced; anything else is refused, nothing deleted."""
    url, options = store
    src = _ckpt(_objects(21), options).save(f"{url}/c", step=1)
    dst = resolve_path(f"{url}/export", options)
    tdcp.export_torchrl(src, dst, ["policy"], format="directory")
    fs = _store_fs(url, options)
    notes = resolve_path(f"{url}/export/videos/eval.mp4", options)
    fs.pipe_file(notes.key, b"mine")
    with pytest.raises(tdcp.CheckpointError, match=r"did not write \(\['videos/eval.mp4'\]\)"):
        tdcp.export_torchrl(src, dst, ["policy"], format="directory", overwrite=True)
    assert fs.cat_file(notes.key) == b"mine"
    fs.rm_file(notes.key)
    tdcp.export_torchrl(src, dst, ["policy"], format="directory", overwrite=True)
    # a manifest listing a name outside its prefix: only what is under the prefix is replaced
    sibling = resolve_path(f"{url}/sibling/x", options)
    fs.pipe_file(sibling.key, b"theirs")
    manifest = resolve_path(f"{url}/export/manifest.json", options)
    forged = json.loads(fs.cat_file(manifest.key))
    forged["components"]["evil"] = {"path": "..", "files": ["sibling/x"]}
    fs.pipe_file(manifest.key, json.dumps(forged).encode())
    tdcp.export_torchrl(src, dst, ["policy"], format="directory", overwrite=True)
    assert fs.cat_file(sibling.key) == b"theirs"


def test_an_empty_manifest_object_is_a_damaged_entry_a_resume_falls_back_from(
    store: tuple[str, dict[str, Any]],
) -> None:
    """A 0-byte ``manifest.json``: S3 answers the bounded GET's range with 416, which was taken for a failed read
    (not a judgement on the entry), so resume raised instead of falling back as it does on every other backend."""
    url, options = store
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=3, storage_options=options)
    for step in (1, 2):
        rotation.save(_ckpt(_objects(step), options), step=step)
    fs = _store_fs(url, options)
    fs.pipe_file(resolve_path(f"{url}/run/step-000000000002/manifest.json", options).key, b"")
    objs = _objects(0)
    with pytest.warns(tdcp.TorchrlDcpWarning, match="step-000000000002 is damaged"):
        info = rotation.resume(_ckpt(objs, options))
    assert info is not None and info.step == 1


def test_a_users_objects_with_a_manifest_of_theirs_are_never_replaced(store: tuple[str, dict[str, Any]]) -> None:
    """A prefix holding a user's DCP objects and a manifest of theirs (another tool's JSON, or one reading as a
    damaged one of ours) was replaced by a save as a damaged checkpoint: its data objects carry no save identity."""
    url, options = store
    fs = _store_fs(url, options)
    for manifest in (b'{"tool": "mine"}', b'{"format": "torchrl_dcp", "x'):
        where = resolve_path(f"{url}/user", options)
        fs.pipe_file((where / ".metadata").key, b"meta")
        fs.pipe_file((where / "__0_0.distcp").key, b"x" * 100)
        fs.pipe_file((where / "manifest.json").key, manifest)
        with pytest.raises(tdcp.CheckpointError, match="refusing to overwrite"):
            _ckpt(_objects(1), options).save(f"{url}/user", step=1)
        assert fs.cat_file((where / "__0_0.distcp").key) == b"x" * 100


def test_a_killed_saves_newer_prefix_is_no_damaged_entry(store: tuple[str, dict[str, Any]]) -> None:
    """A killed save's prefix (its data, no manifest) newer than the committed step was warned about as damaged,
    and ``fallback=False`` raised: objectstores.md says it is absent."""
    url, options = store
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=3, storage_options=options)
    for step in (1, 2):
        rotation.save(_ckpt(_objects(step), options), step=step)
    fs = _store_fs(url, options)
    killed = resolve_path(f"{url}/run/step-000000000002", options)
    save_id = json.loads(fs.cat_file((killed / "manifest.json").key))["save_id"]
    fs.rm_file((killed / "manifest.json").key)  # what a save killed before its commit leaves: data and its marker
    fs.pipe_file(marker_for(killed).key, json.dumps({"save_id": save_id, "started": 0.0}).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.TorchrlDcpWarning)
        info = rotation.resume(_ckpt(_objects(0), options), fallback=False)
    assert info is not None and info.step == 1


def test_a_save_or_conversion_to_a_key_that_is_a_users_object_is_refused(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A store has no directories: a save or ``to_directory`` to ``run/user.txt``, an object of the user's, wrote the
    checkpoint beside it under ``run/user.txt/`` on S3 (said "uploading failed (FileExistsError) ... check the
    endpoint" on memory://), and the refusal without ``overwrite`` said to pass it."""
    url, options = store
    fs = _store_fs(url, options)
    key = resolve_path(f"{url}/run/user.txt", options).key
    fs.pipe_file(key, b"user data")
    dst = StorePath(f"{url}/run/user.txt", storage_options=options)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), storage_options=options)
    archive = tdcp.to_archive(ckpt.save(tmp_path / "ckpt"), tmp_path / "ckpt.zip")
    refusal = r"is an object \(a file\), not a prefix"
    with pytest.raises(tdcp.CheckpointError, match=refusal):
        ckpt.save(dst)
    for overwrite in (False, True):
        with pytest.raises(tdcp.CheckpointError, match=refusal):
            tdcp.to_directory(archive, dst, overwrite=overwrite)
    assert fs.cat_file(key) == b"user data"
    assert [k for k in fs.find(key.rpartition("/")[0]) if k.startswith(f"{key}/")] == []


def _fail_once_deleting(monkeypatch: pytest.MonkeyPatch, part: str) -> list[str]:
    """The memory store's next deletion of a key containing ``part`` raises ``EIO`` (once); returns what failed."""
    from fsspec.implementations.memory import MemoryFileSystem

    failed: list[str] = []
    rm, rm_file = MemoryFileSystem.rm, MemoryFileSystem.rm_file

    def check(keys: Any) -> None:
        for key in [keys] if isinstance(keys, str) else keys:
            if part in key and not failed:
                failed.append(key)
                raise OSError(5, "injected I/O error")

    def failing_rm(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        check(path)
        return rm(self, path, *args, **kwargs)

    def failing_rm_file(self: Any, path: Any) -> Any:
        check(path)
        return rm_file(self, path)

    monkeypatch.setattr(MemoryFileSystem, "rm", failing_rm)
    monkeypatch.setattr(MemoryFileSystem, "rm_file", failing_rm_file)
    return failed


def test_a_marker_left_by_a_failed_delete_after_the_commit_is_no_failed_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest was PUT (the commit), then deleting the save's marker failed: the save raised "committing the
    checkpoint failed" although the checkpoint is committed and loads. It is logged; the next sweep removes it."""
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=3)
    rotation.save(_ckpt(_objects(1), {}), step=1)
    failed = _fail_once_deleting(monkeypatch, PENDING)
    rotation.save(_ckpt(_objects(2), {}), step=2)
    assert failed and rotation.latest() is not None and rotation.latest().name == "step-000000000002"
    rotation.save(_ckpt(_objects(3), {}), step=3)  # swept: only the marker of the committed checkpoint goes
    assert not any(PENDING in k for k in _store_fs(url, {}).find(url))
    assert [e.step for e in rotation.entries()] == [1, 2, 3]


def _info_fails_for(monkeypatch: pytest.MonkeyPatch, part: str) -> list[str]:
    """The memory store's ``info`` of a key containing ``part`` raises (a 503, a dropped connection), every time;
    returns the keys it failed for. fsspec's ``exists`` and ``isfile`` answer ``False`` then."""
    from fsspec.implementations.memory import MemoryFileSystem

    failed: list[str] = []
    info = MemoryFileSystem.info

    def failing_info(self: Any, path: Any, **kwargs: Any) -> Any:
        if part in str(path):
            failed.append(str(path))
            raise OSError(16, "injected: service unavailable")
        return info(self, path, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "info", failing_info)
    return failed


def test_a_store_that_does_not_answer_is_never_taken_for_an_absent_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that failed was read as "no such object": the next save's sweep took a committed checkpoint (its
    marker left by a failed delete) for a killed save and deleted it, and a save inside a committed checkpoint was
    let through (it no longer loaded). Both now raise, naming the object, and change nothing."""
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=5)
    rotation.save(_ckpt(_objects(1), {}), step=1)
    _fail_once_deleting(monkeypatch, PENDING)
    rotation.save(_ckpt(_objects(2), {}), step=2)  # committed, its marker left
    with monkeypatch.context() as m:
        failed = _info_fails_for(m, "step-000000000002/manifest.json")
        with pytest.raises(tdcp.CheckpointError, match="step-000000000002/manifest.json: asking the store"):
            rotation.save(_ckpt(_objects(3), {}), step=3)
        assert failed
    with monkeypatch.context() as m:
        _info_fails_for(m, "step-000000000001/manifest.json")
        with pytest.raises(tdcp.CheckpointError, match="step-000000000001/manifest.json: asking the store"):
            _ckpt(_objects(4), {}).save(f"{url}/run/step-000000000001/inner")
    for step in (1, 2):
        fresh = _objects(9)
        _ckpt(fresh, {}).load(f"{url}/run/step-{step:012d}")
        assert fresh["stats"] == {"episodes": step}


def test_a_bucket_the_store_does_not_answer_about_is_no_missing_bucket(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket check asked fsspec's ``exists``, which answers ``False`` to a dropped connection: a store that went
    away was reported as a missing bucket ("create the bucket")."""
    options = s3.storage_options
    prefix = f"empty-{uuid.uuid4().hex[:8]}"
    fs = resolve_path(f"s3://{s3.bucket}/{prefix}", options).fs  # (fsspec caches it: the instance every call uses)
    info, ls = fs.info, fs.ls

    def failing(path: Any, **kwargs: Any) -> Any:
        if str(path).strip("/") == s3.bucket:
            raise ConnectionError("injected: connection closed")
        return info(path, **kwargs)

    def missing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if prefix in str(path):  # (as a prefix that holds nothing is answered, whatever s3fs has cached)
            raise FileNotFoundError(path)
        return ls(path, *args, **kwargs)

    monkeypatch.setattr(fs, "info", failing)
    monkeypatch.setattr(fs, "ls", missing)
    with pytest.raises(tdcp.CheckpointError, match=r"asking whether its bucket exists\) failed") as err:
        tdcp.CheckpointRotation(f"s3://{s3.bucket}/{prefix}", storage_options=options).latest()
    assert "does not exist" not in str(err.value)


def test_a_rotations_failure_after_the_commit_says_the_save_is_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=1)
    rotation.save(_ckpt(_objects(1), {}), step=1)

    def failing_prune(*args: Any, **kwargs: Any) -> Any:
        raise tdcp.CheckpointError("injected: listing the prefix failed", path=f"{url}/run")

    monkeypatch.setattr(tdcp.CheckpointRotation, "prune", failing_prune)
    with pytest.raises(tdcp.CheckpointError, match="step 2 was committed at .*step-000000000002, then rotating"):
        rotation.save(_ckpt(_objects(2), {}), step=2)
    assert rotation.latest().name == "step-000000000002"


def test_ls_shows_a_killed_save_in_a_store_as_a_leftover_as_for_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}/run"
    rotation = tdcp.CheckpointRotation(url)
    rotation.save(_ckpt(_objects(1), {}), step=1)
    dead = resolve_path(f"{url}/step-000000000002", {})
    sid = "d" * 32  # a save killed after uploading its data: its marker, a data object of that save
    dead.fs.pipe_file(marker_for(dead).key, json.dumps({"save_id": sid, "started": 0.0}).encode())
    dead.fs.pipe_file((dead / "__0_shared.distcp").key, b"partial" + identity_trailer(sid, 0))
    assert cli(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "1 entries" in out and "NOT COMMITTED" not in out, out
    assert "step-000000000002" in out and "left by a killed save or conversion to step-000000000002" in out, out


def test_a_prefix_a_save_has_not_committed_is_no_checkpoint_as_for_a_directory(tmp_path: Path) -> None:
    """A killed save's objects under its prefix (its pending marker beside it) are what a directory's staging is:
    no checkpoint (CheckpointNotFoundError, saying so), where a prefix of foreign objects is not one of ours."""
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    dead = resolve_path(f"{url}/killed", {})
    sid = "e" * 32
    dead.fs.pipe_file(marker_for(dead).key, json.dumps({"save_id": sid, "started": 0.0}).encode())
    dead.fs.pipe_file((dead / "__0_shared.distcp").key, b"partial" + identity_trailer(sid, 0))
    for attempt in (
        lambda: tdcp.verify(str(dead)),
        lambda: _ckpt(_objects(0), {}).load(str(dead)),
        lambda: tdcp.read_manifest(str(dead)),
    ):
        with pytest.raises(tdcp.CheckpointNotFoundError, match="has not committed"):
            attempt()
    foreign = resolve_path(f"{url}/foreign", {})
    foreign.fs.pipe_file((foreign / "notes.txt").key, b"mine")
    with pytest.raises(tdcp.CheckpointFormatError, match="no manifest.json: not a torchrl_dcp checkpoint"):
        tdcp.verify(str(foreign))
    foreign.fs.pipe_file((foreign / ".metadata").key, b"DCP's")  # what a plain dcp.save leaves: said so
    with pytest.raises(tdcp.CheckpointFormatError, match="plain torch.distributed.checkpoint.save"):
        tdcp.verify(str(foreign))


def test_a_failed_retirement_of_a_replaced_checkpoint_is_swept_by_the_next_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save over a checkpoint failed while deleting the old one's objects (its manifest already gone): the old
    save's objects and the new save's marker were left, which no sweep could prove (another save's identity), and
    every later save to that path was refused. The marker names the replaced save too."""
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    _ckpt(_objects(1), {}).save(f"{url}/b", step=1)
    failed = _fail_once_deleting(monkeypatch, "__0_shared")
    with pytest.raises(tdcp.CheckpointError):
        _ckpt(_objects(2), {}).save(f"{url}/b", step=2)
    assert failed
    _ckpt(_objects(3), {}).save(f"{url}/b", step=3)  # the retry sweeps what the failed one left, then saves
    objs = _objects(0)
    assert _ckpt(objs, {}).load(f"{url}/b").step == 3


def test_convert_and_export_through_urls(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, options = store
    objs = _objects(18)
    remote = _ckpt(objs, options).save(f"{url}/c", step=4)
    archive = tdcp.to_archive(remote, tmp_path / "c.zip")  # URL -> local archive
    assert tdcp.verify(archive)["files"] == 3  # .metadata, the data, rank 0's manifest shard
    back = tdcp.to_directory(archive, resolve_path(f"{url}/back", options))  # local archive -> URL
    fresh = _objects(19)
    assert _ckpt(fresh, options).load(back).step == 4 and _same(objs, fresh)
    up = tdcp.to_archive(remote, resolve_path(f"{url}/c.zip", options))  # URL -> archive object
    assert up.is_file()
    out = tdcp.export_torchrl(remote, tmp_path / "policy.torchrl", ["policy"])
    from torchrl.checkpoint import Checkpoint

    policy = torch.nn.Linear(64, 512)
    Checkpoint(policy=policy).load(out)
    assert torch.equal(policy.weight, objs["policy"].weight)


def test_cli_on_memory_urls(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    rotation = tdcp.CheckpointRotation(url)
    rotation.save(_ckpt(_objects(20), {}), step=1)
    entry = f"{url}/step-000000000001"
    assert cli(["inspect", entry, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["container"] == "object store"
    assert cli(["verify", entry]) == 0 and "OK memory://" in capsys.readouterr().out
    assert cli(["ls", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latest"] == "step-000000000001"
    assert cli(["convert", entry, str(tmp_path / "e.zip")]) == 0
    capsys.readouterr()
    assert cli(["diff", entry, str(tmp_path / "e.zip"), "--json"]) == 0
    fs = fsspec.filesystem("memory")
    fs.pipe_file(resolve_path(f"{entry}/__0_shared.distcp").key, b"x")
    assert cli(["verify", entry]) == 1 and "__0_shared.distcp" in capsys.readouterr().err


# ---------------------------------------------------------------------- paths
def test_paths_and_urls(tmp_path: Path) -> None:
    assert resolve_path(f"file://{tmp_path}/c") == tmp_path / "c"  # file:// is the local fast path
    local = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(f"file://{tmp_path}/c")
    assert isinstance(local, Path) and (tmp_path / "c" / "manifest.json").is_file()
    for bad, match in [("s3://", "needs a bucket"), ("memory://b/../x", "'..'"), ("nosuchproto://b/x", "no fsspec")]:
        with pytest.raises(tdcp.CheckpointError, match=match):
            tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(bad)
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/tdcp-tests/copy/a", b"abc")
    copy_object(fs, "/tdcp-tests/copy/a", "/tdcp-tests/copy/b")
    assert fs.cat_file("/tdcp-tests/copy/b") == b"abc"
    with pytest.raises(tdcp.CheckpointError, match="does not exist"):
        copy_object(fs, "/tdcp-tests/copy/missing", "/tdcp-tests/copy/c")


def test_a_memory_url_with_three_slashes_saves_loads_and_rotates() -> None:
    """Probe m2: ``memory:///run/ck`` (fsspec's absolute spelling) loaded but a save was refused ("a checkpoint URL
    needs a bucket and a key", naming ``memory://``): the check that a save is not inside another checkpoint walked
    up past the top prefix. The top prefix is its own parent, in either spelling."""
    root = f"memory:///tdcp-{uuid.uuid4().hex}"
    assert StorePath(root).parent == StorePath(root) and StorePath(root + "/run").parent == StorePath(root)
    objs = _objects(0)
    ckpt = _ckpt(objs, {})
    ckpt.save(f"{root}/run/ck", step=1)
    fresh = _objects(1)
    assert _ckpt(fresh, {}).load(f"{root}/run/ck").step == 1 and _same(objs, fresh)
    rotation = tdcp.CheckpointRotation(f"{root}/rot", keep_last=1)
    rotation.save(ckpt, step=1)
    rotation.save(ckpt, step=2)
    assert [e.step for e in rotation.entries()] == [2]


def test_file_urls_follow_rfc_8089(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in (f"file://{tmp_path}/c", f"file://localhost{tmp_path}/c", f"FILE://LocalHost{tmp_path}/c"):
        assert resolve_path(url) == tmp_path / "c", url
    path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(f"file://localhost{tmp_path}/c", step=3)
    assert path == tmp_path / "c"
    assert tdcp.DistributedCheckpoint(w={"x": torch.zeros(1)}).load(f"file://localhost{tmp_path}/c").step == 3
    for bad, match in [
        (f"file://server{tmp_path}/c", "not host 'server'"),  # another machine's path: never ./server/...
        ("file://c", "not host 'c'"),
        ("file://", "needs a path"),
        ("file:///", "needs a path"),
    ]:
        with pytest.raises(tdcp.CheckpointError, match=match):
            resolve_path(bad)
        with pytest.raises(tdcp.CheckpointError, match=match):
            tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ---------------------------------------------------------------------- loads: chunk files, requests, identity
@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk files of 1 MiB for tensors of 2 MiB or more (``big/x``, 12 MiB: 12 chunk files)."""
    import torchrl_dcp.chunking as chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 2 << 20)


def _record_reads(monkeypatch: pytest.MonkeyPatch, fs: Any) -> list[str]:
    """Names of the objects read through ``fs.cat_file`` (one entry per request)."""
    reads: list[str] = []
    orig = fs.cat_file

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(path.rsplit("/", 1)[-1])
        return orig(path, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", recording)
    return reads


@pytest.mark.parametrize("verify", [True, False])
def test_chunked_tensors_load_with_one_read_per_object(
    store: tuple[str, dict[str, Any]], small_chunks: None, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    url, options = store
    saved = _objects(21)
    path = _ckpt(saved, options).save(f"{url}/c")
    data = sorted(n for n in tdcp.read_manifest(path)["files"] if n.endswith(".distcp"))
    assert len(data) >= 12 and "__0_12.distcp" in data  # big/x was cut into chunk files
    reads = _record_reads(monkeypatch, path.fs)
    fresh = _objects(22)
    fresh["big"].clear()  # registered empty: big/x is read into a fresh tensor (a dict's own would be read in place)
    assert _ckpt(fresh, options).load(path, verify=verify).loaded == {"policy", "optim", "big", "stats"}
    assert _same(saved, fresh)
    chunks = {n: reads.count(n) for n in data if n != "__0_shared.distcp"}  # big/x: read into a fresh tensor
    # each chunk object in one GET (record and trailer; verified from those bytes); unverified: the trailers first
    assert set(chunks.values()) == ({1} if verify else {2})


def test_damaged_chunk_object_is_refused(store: tuple[str, dict[str, Any]], small_chunks: None) -> None:
    url, options = store
    _ckpt(_objects(23), options).save(f"{url}/c")
    _damage(url, options, "__0_5.distcp", "flip")
    fresh = _objects(24)
    before = fresh["big"]["x"].clone()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="checksum is crc32:") as err:
        _ckpt(fresh, options).load(f"{url}/c")
    assert "__0_5.distcp" in str(err.value) and torch.equal(fresh["big"]["x"], before)
    _damage(url, options, "__0_5.distcp", "truncate")
    with pytest.raises(tdcp.CheckpointIntegrityError, match="truncated or altered"):
        _ckpt(fresh, options).load(f"{url}/c", verify=False)
    assert torch.equal(fresh["big"]["x"], before)


@pytest.mark.parametrize("verify", [True, False])
def test_chunk_object_from_another_save_is_refused(
    store: tuple[str, dict[str, Any]], small_chunks: None, verify: bool
) -> None:
    from torchrl_dcp.format.manifest import dumps, seal

    url, options = store
    _ckpt(_objects(25), options).save(f"{url}/a")
    b = _ckpt(_objects(26), options).save(f"{url}/b")
    fs = b.fs
    other = fs.cat_file(resolve_path(f"{url}/a/__0_3.distcp", options).key)
    fs.pipe_file((b / "__0_3.distcp").key, other)  # copied in with a matching manifest entry
    manifest = json.loads(fs.cat_file((b / "manifest.json").key))
    manifest["files"]["__0_3.distcp"] = {"size": len(other), "checksum": tdcp_crc(other)}
    manifest.pop("manifest_checksum", None)
    fs.pipe_file((b / "manifest.json").key, dumps(seal(manifest)))
    fresh = _objects(27)
    before = fresh["big"]["x"].clone()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="identity of save") as err:
        _ckpt(fresh, options).load(b, verify=verify)
    assert "__0_3.distcp" in str(err.value) and torch.equal(fresh["big"]["x"], before)


def test_record_larger_than_a_range(store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDCP_STORE_RANGE_SIZE", str(1 << 20))  # x (12 MiB, one record): 12 ranged GETs
    url, options = store
    x = torch.randn(3_000_000)
    path = tdcp.DistributedCheckpoint(big={"x": x}, storage_options=options).save(f"{url}/c")
    reads = _record_reads(monkeypatch, path.fs)
    fresh: dict[str, Any] = {"x": torch.zeros(1)}
    tdcp.DistributedCheckpoint(big=fresh, storage_options=options).load(path)
    # 12 ranges, one for the trailer, one for the record's tail (its central directory, checked before its data)
    assert torch.equal(fresh["x"], x) and reads.count("__0_shared.distcp") == 14
    _damage(url, options, "__0_shared.distcp", "flip")
    fresh = {"x": torch.zeros(1)}
    with pytest.raises(tdcp.CheckpointIntegrityError, match="checksum is crc32:.*nothing was restored"):
        tdcp.DistributedCheckpoint(big=fresh, storage_options=options).load(path)
    assert torch.equal(fresh["x"], torch.zeros(1))


def test_cut_tiles_the_range_without_splitting_a_record() -> None:
    import random

    from torchrl_dcp.storage.objectstore_read import cut

    rng = random.Random(0)
    for _ in range(500):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(0, 8))]
        gaps = [rng.randint(0, 50) for _ in lengths]
        records, pos = [], 0
        for gap, n in zip(gaps, lengths):
            records.append((pos + gap, n))
            pos += gap + n
        hi, limit = pos + rng.randint(0, 80), rng.randint(8, 120)
        spans, big = cut(records, 0, hi, limit)
        pieces = sorted([(s, e) for s, e, _ in spans] + [(records[k][0], sum(records[k])) for k in big])
        assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]] and (not pieces or pieces[-1][1] == hi)
        assert all(e - s <= limit for s, e, _ in spans) and all(records[k][1] > limit for k in big)
        placed = sorted([k for _, _, idx in spans for k in idx] + big)
        assert placed == list(range(len(records)))  # every record whole in exactly one span (or on its own)
        for s, e, idx in spans:
            assert all(s <= records[k][0] and sum(records[k]) <= e for k in idx)


def test_a_manifest_that_cannot_be_read_now_is_not_skipped_as_damaged(store: tuple[str, dict[str, Any]]) -> None:
    """A store's 503 or a reset connection on the newest entry's manifest made it "uncommitted": resume silently
    took the previous step (``fallback=False`` too), or started fresh, and the restarted job replaced the newest
    checkpoint. A read that fails is raised; only an absent or damaged manifest leaves an entry out."""
    from unittest import mock

    url, options = store
    objs = _objects(21)
    rotation = tdcp.CheckpointRotation(f"{url}/run", storage_options=options)
    ckpt = _ckpt(objs, options)
    rotation.save(ckpt, step=5)
    rotation.save(ckpt, step=10)
    fs = _store_fs(url, options)  # (fsspec caches file systems: the one the rotation reads through)
    real = fs.cat_file

    def flaky(path: str, *args: Any, **kwargs: Any) -> Any:
        if "step-000000000010/manifest.json" in str(path):
            raise ConnectionError("connection reset by peer")
        return real(path, *args, **kwargs)

    with mock.patch.object(fs, "cat_file", flaky):  # (s3fs binds its sync methods to the instance)
        with pytest.raises(tdcp.CheckpointError, match="connection reset"):
            rotation.resume(_ckpt(_objects(22), options), fallback=False)
        with pytest.raises(tdcp.CheckpointError, match="connection reset"):
            rotation.latest()
        listed = rotation.entries(include_uncommitted=True)  # a listing for display shows it
        assert [(e.step, e.committed) for e in listed] == [(5, True), (10, False)]
    assert [e.step for e in rotation.entries()] == [5, 10]


def test_a_stray_object_named_dot_dot_under_a_rotation_is_not_an_entry(store: tuple[str, dict[str, Any]]) -> None:
    """A foreign object ``run/..`` (a legal S3 key) made every listing, save and resume of the rotation raise "a
    checkpoint URL needs ... without '..' parts" (a URL the user never passed); it is no child of the prefix."""
    url, options = store
    fs = _store_fs(url, options)
    fs.pipe_file(resolve_path(f"{url}/run", options).key + "/..", b"stray")
    if ".." not in fs.ls(resolve_path(f"{url}/run", options).key, detail=False)[0]:
        pytest.skip("this store normalises the key away")
    rotation = tdcp.CheckpointRotation(f"{url}/run", storage_options=options)
    ckpt = _ckpt(_objects(23), options)
    rotation.save(ckpt, step=1)
    assert [e.step for e in rotation.entries()] == [1]
    assert rotation.resume(_ckpt(_objects(24), options)).step == 1


def test_a_store_that_ignores_ranged_reads_is_named_as_such(store: tuple[str, dict[str, Any]]) -> None:
    """A store (or proxy) that answers a ranged GET with the whole object was reported as "object ended -1201293
    bytes early ...: truncated": damage that is not there."""
    from unittest import mock

    url, options = store
    objs = _objects(25)
    path = _ckpt(objs, options).save(f"{url}/c")
    fs = _store_fs(url, options)
    real = fs.cat_file

    def whole(key: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        return real(key, **kwargs)  # the Range ignored

    with mock.patch.object(fs, "cat_file", whole), pytest.raises(tdcp.CheckpointError, match="ignores ranged reads"):
        _ckpt(_objects(26), options).load(path)


def test_store_destinations_are_checked_as_local_ones(store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """A save, rotation or conversion under a committed checkpoint's prefix wrote an object its manifest does not
    list (the checkpoint then refused as altered), and ``overwrite=True`` to a store replaced a user's object or a
    checkpoint's prefix: local destinations refused both. Nothing is written; what was there stays."""
    url, options = store
    objs = _objects(21)
    ckpt = _ckpt(objs, options)
    inside = ckpt.save(f"{url}/run/step-1", step=1)
    archive = tdcp.to_archive(inside, tmp_path / "a.zip")
    fs = _store_fs(url, options)
    listing = sorted(fs.find(resolve_path(f"{url}/run", options).key))
    attempts = {
        "save": lambda: ckpt.save(f"{url}/run/step-1/inner"),
        "rotation": lambda: tdcp.CheckpointRotation(f"{url}/run/step-1", storage_options=options).save(ckpt, step=2),
        "to_archive": lambda: tdcp.to_archive(inside, resolve_path(f"{url}/run/step-1/a.zip", options)),
        "to_directory": lambda: tdcp.to_directory(archive, resolve_path(f"{url}/run/step-1/u", options)),
        "archive over a checkpoint prefix": lambda: tdcp.to_archive(
            inside, resolve_path(f"{url}/run/step-1", options), overwrite=True
        ),
    }
    for what, attempt in attempts.items():
        with pytest.raises(tdcp.CheckpointError, match="inside the checkpoint|is a prefix holding objects|source"):
            attempt()
        assert sorted(fs.find(resolve_path(f"{url}/run", options).key)) == listing, what
    tdcp.verify(inside)
    notes = resolve_path(f"{url}/notes.zip", options)
    fs.pipe_file(notes.key, b"a user's notes")
    with pytest.raises(tdcp.CheckpointError, match="not an archive of a checkpoint"):
        tdcp.to_archive(inside, notes, overwrite=True)
    assert fs.cat_file(notes.key) == b"a user's notes"
    theirs = resolve_path(f"{url}/ours.zip", options)
    for _ in range(2):  # an archive of ours is replaced
        tdcp.to_archive(inside, theirs, overwrite=True)


def test_a_bucket_or_a_missing_bucket_is_refused_saying_so(s3: Any) -> None:
    """A bucket root as the checkpoint (the save's marker went inside the destination: "appeared under the prefix
    while the save ran") and a bucket that does not exist ("deleted meanwhile?", an integrity error) each say what
    is wrong; nothing is written."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), storage_options=s3.storage_options)
    with pytest.raises(tdcp.CheckpointError, match="is a bucket, not a checkpoint prefix"):
        ckpt.save(f"s3://{s3.bucket}")
    with pytest.raises(tdcp.CheckpointError, match="is a bucket, not a checkpoint prefix"):
        ckpt.save("memory://tdcp-bucket-root")
    with pytest.raises(tdcp.CheckpointError, match="its bucket does not exist") as err:
        ckpt.save(f"s3://{s3.bucket}-missing/run/c")
    assert not isinstance(err.value, tdcp.CheckpointIntegrityError)


def test_a_conversion_to_a_bucket_root_is_refused_as_a_save_is(tmp_path: Path) -> None:
    """Probe m7: ``to_directory(zip, "memory:///bk")`` and ``to_archive(d, "memory:///bk.zip")`` wrote at a bucket's
    root, which ``ckpt.save`` refuses: a conversion's destination follows the save's rule."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2))
    ckpt.save(tmp_path / "c")
    tdcp.to_archive(tmp_path / "c", tmp_path / "c.zip")
    root = f"tdcp-root-{uuid.uuid4().hex}"
    for convert, where in (
        (lambda to: tdcp.to_directory(tmp_path / "c.zip", to), f"memory:///{root}"),
        (lambda to: tdcp.to_directory(tmp_path / "c.zip", to, overwrite=True), f"memory://{root}"),
        (lambda to: tdcp.to_archive(tmp_path / "c", to), f"memory:///{root}.zip"),
    ):
        with pytest.raises(tdcp.CheckpointError, match="is a bucket, not a checkpoint prefix or an archive"):
            convert(where)
    assert not fsspec.filesystem("memory").exists(f"/{root}")


def test_a_key_the_store_does_not_take_is_not_called_a_missing_bucket(s3: Any) -> None:
    """A key holding a newline answers 'not found' on the S3 server the tests run: the refusal said the bucket did
    not exist ("create it"), of a bucket that had just taken a save. It now says the bucket exists and what to
    change; a save beside it works."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), storage_options=s3.storage_options)
    ckpt.save(f"s3://{s3.bucket}/run/ok")
    try:
        ckpt.save(f"s3://{s3.bucket}/run\nx/step-1")
    except tdcp.CheckpointError as err:
        assert "bucket does not exist" not in str(err), str(err)
        assert "plainer key" in str(err) or "not found" not in str(err), str(err)
    assert ckpt.load(f"s3://{s3.bucket}/run/ok").loaded == {"policy"}


def test_a_users_object_uploaded_after_this_process_listed_its_prefix_is_never_overwritten(
    s3: Any, tmp_path: Path
) -> None:
    """The destination checks asked s3fs, whose listing of ``exports/`` this process had cached before another process
    uploaded ``exports/report.zip``: ``to_archive`` without ``overwrite`` replaced the user's object, no word."""
    import fsspec

    url, options = s3.url(), s3.storage_options
    fs = _store_fs(url, options)
    src = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2)).save(tmp_path / "ckpt")
    tdcp.to_archive(src, StorePath(f"{url}/exports/first.zip", storage_options=options))
    prefix = resolve_path(f"{url}/exports", options).key
    fs.ls(prefix)  # (this process's listing of the prefix, cached)
    other = fsspec.filesystem("s3", skip_instance_cache=True, **options)  # another process's upload
    other.pipe_file(f"{prefix}/report.zip", b"the user's report")
    report = StorePath(f"{url}/exports/report.zip", storage_options=options)
    for overwrite in (False, True):  # (never told to pass overwrite=True, which would be refused)
        with pytest.raises(tdcp.CheckpointError, match="is not an archive of a checkpoint"):
            tdcp.to_archive(src, report, overwrite=overwrite)
    assert other.cat_file(f"{prefix}/report.zip") == b"the user's report"


@pytest.mark.parametrize("planted", ["__0_shared.distcp/x", "../x", "./x", "/x"])
def test_odd_keys_planted_under_an_entry_are_named_and_never_hide_its_objects(
    store: tuple[str, dict[str, Any]], planted: str
) -> None:
    """``step-N/__0_shared.distcp/x`` made the listing keep the prefix under the object's name: loads said the object
    "is missing" and a prune left it behind. ``step-N/../x`` (a legal S3 key) made every load, verify and resume
    blame the user's URL ("a checkpoint URL needs ... without '.' or '..' parts"). ``step-N//x`` (an empty segment)
    was dropped from the listing as the prefix itself: load and verify accepted the entry."""
    url, options = store
    if (planted.startswith("__") or planted == "/x") and url.startswith("memory://"):
        pytest.skip("memory:// holds no object and prefix of one name, nor an empty segment")
    fs = _store_fs(url, options)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), storage_options=options)
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=1, storage_options=options)
    path = rotation.save(ckpt, step=1)
    entry = resolve_path(str(path), options).key
    fs.pipe_file(f"{entry}/{planted}", b"planted")
    fs.invalidate_cache()
    shown = "/" if planted == "/x" else planted.rpartition("/")[0] + ("/" if planted.startswith("__") else "")
    for call in (lambda: ckpt.load(path), lambda: tdcp.verify(path, storage_options=options)):
        with pytest.raises(tdcp.CheckpointIntegrityError, match="not listed in the manifest") as err:
            call()
        assert str(err.value).startswith(f"{path}/{shown}:")
    with pytest.raises(tdcp.CheckpointError, match=f"holds '{re.escape(shown)}', a file no save writes"):
        rotation.resume(ckpt)
    if planted.startswith("__"):  # a prune removes the entry's objects, never the user's
        rotation.save(ckpt, step=2)
        assert fs.find(entry) == [f"{entry}/{planted}"]


def test_a_conversion_of_a_store_names_the_objects_not_its_local_copies(tmp_path: Path) -> None:
    """A damaged archive object converted to a directory was named by its local copy, already removed
    (``/tmp/tdcp-convert-.../run.zip::member``); a prefix holding a user's objects was told to pass
    ``overwrite=True``, which was then refused."""
    import fsspec

    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(8, 8), no_dist=True)
    archive = tdcp.to_archive(ckpt.save(tmp_path / "c"), tmp_path / "run.zip")
    damaged = bytearray(archive.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{url}/run.zip", bytes(damaged))
    with pytest.raises(tdcp.CheckpointIntegrityError) as err:
        tdcp.to_directory(f"{url}/run.zip", tmp_path / "out")
    assert str(err.value.path).startswith(f"{url}/run.zip::") and "tdcp-convert-" not in str(err.value)
    fs.pipe(f"{url}/user/notes.txt", b"mine")
    for overwrite in (False, True):
        with pytest.raises(tdcp.CheckpointError, match="not a torchrl_dcp checkpoint; refusing") as err:
            tdcp.to_directory(archive, f"{url}/user", overwrite=overwrite)
        assert "pass overwrite=True" not in str(err.value)
    assert fs.cat(f"{url}/user/notes.txt") == b"mine"


def test_a_torchrl_checkpoint_export_in_a_store_is_told_to_be_read_from_a_local_path(tmp_path: Path) -> None:
    """Our own ``export_torchrl`` writes to a store, where our tools read no torchrl.checkpoint checkpoint: the
    directory export was "manifest format is 'torchrl.checkpoint', expected 'torchrl_dcp'" (no next step), the
    archive was told to use ``to_directory``, which refused it as "in a sub-directory"."""
    src = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), no_dist=True).save(tmp_path / "c")
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}"
    tdcp.export_torchrl(src, f"{url}/e_dir", format="directory")
    tdcp.export_torchrl(src, f"{url}/e.torchrl")
    with pytest.raises(tdcp.CheckpointFormatError, match="torchrl.checkpoint checkpoint's manifest.*local path"):
        tdcp.verify(f"{url}/e_dir")
    with pytest.raises(tdcp.CheckpointFormatError, match="torchrl.checkpoint archive is read from a local path"):
        tdcp.verify(f"{url}/e.torchrl")
    with pytest.raises(tdcp.CheckpointFormatError, match="a torchrl.checkpoint archive\\? read it from a local path"):
        tdcp.to_directory(f"{url}/e.torchrl", tmp_path / "out")


def test_an_object_at_an_entrys_own_key_never_hides_the_entry(store: tuple[str, dict[str, Any]]) -> None:
    """An object uploaded at ``run/step-2`` (no trailing slash) beside the committed ``run/step-2/``: the listing held
    the prefix as ``step-2/`` and the object as a foreign ``step-2``, so ``entries()`` and ``resume()`` passed over the
    committed step 2 and resumed step 1, silently (a direct load of the path loads step 2). memory:// lists such a key
    as the object alone: its objects were missing to the load, and a prune never removed them."""
    url, options = store
    rotation = tdcp.CheckpointRotation(url, keep_last=3, storage_options=options)
    for step in (1, 2):
        rotation.save(
            tdcp.DistributedCheckpoint(w={"x": torch.full((4,), float(step))}, storage_options=options), step=step
        )
    entry = resolve_path(f"{url}/step-000000000002", options)
    entry.fs.pipe_file(entry.key, b"my notes")
    assert [e.step for e in rotation.entries()] == [1, 2]
    target = {"x": torch.zeros(4)}
    info = tdcp.CheckpointRotation(url, storage_options=options).resume(
        tdcp.DistributedCheckpoint(w=target, storage_options=options)
    )
    assert info.step == 2 and target["x"].tolist() == [2.0] * 4
    assert entry.fs.cat_file(entry.key) == b"my notes"
    one = tdcp.CheckpointRotation(url, keep_last=1, storage_options=options)
    one.save(tdcp.DistributedCheckpoint(w={"x": torch.zeros(4)}, storage_options=options), step=3)
    assert [e.step for e in one.entries()] == [3]
    assert not list_objects(entry) and entry.fs.cat_file(entry.key) == b"my notes"  # pruned; the user's object kept


def test_a_store_failing_to_answer_for_a_marker_never_fails_a_resume(
    store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer killed save's prefix, and its marker's GET failing with a dropped connection (botocore's own error,
    which s3fs lets out): the resume, whose state was restored, raised it bare from its check of newer entries."""
    url, options = store
    rotation = tdcp.CheckpointRotation(url, keep_last=5, storage_options=options)
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(4.0)}, storage_options=options)
    for step in (1, 2):
        rotation.save(ckpt, step=step)
    fs = _store_fs(url, options)
    killed = resolve_path(f"{url}/step-000000000002", options)
    save_id = json.loads(fs.cat_file((killed / "manifest.json").key))["save_id"]
    fs.rm_file((killed / "manifest.json").key)  # a save killed before its commit
    fs.pipe_file(marker_for(killed).key, json.dumps({"save_id": save_id, "started": 0.0}).encode())

    class EndpointConnectionError(Exception):  # (what botocore raises for a dropped connection)
        pass

    real = killed.fs.cat_file

    def dropped(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(marker_for(killed).name):
            raise EndpointConnectionError("Could not connect to the endpoint URL")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(killed.fs, "cat_file", dropped)  # (fsspec keeps one file system per store and options)
    assert tdcp.CheckpointRotation(url, storage_options=options).resume(ckpt).step == 1


def test_a_users_object_the_store_reads_as_a_version_is_no_entry(s3: Any) -> None:
    """``run/results?versionId=1.csv`` (a legal S3 key, beside the entries where users keep their files): every
    listing, resume and save of the rotation raised "the store reads this URL as object ... choose a prefix without
    it", naming a URL the user never passed. A marker named like it is left alone by the sweep."""
    from fsspec.asyn import sync

    url, options = s3.url(), s3.storage_options
    rotation = tdcp.CheckpointRotation(url, keep_last=5, storage_options=options)
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(4.0)}, storage_options=options)
    rotation.save(ckpt, step=1)
    root = resolve_path(url, options)
    bucket, prefix, _ = root.fs.split_path(root.key)
    planted = [f"{prefix}/results?versionId=1.csv", f"{prefix}/.x?versionId=1.tdcp-pending"]
    for key in planted:  # (put_object: s3fs's own writes cut the key at '?versionId=')
        sync(root.fs.loop, root.fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=b"a,b\n")
    assert [e.step for e in rotation.entries()] == [1]
    assert rotation.resume(ckpt).step == 1
    rotation.save(ckpt, step=2)
    assert [e.step for e in rotation.entries()] == [1, 2]
    for key in planted:
        assert sync(root.fs.loop, root.fs._call_s3, "get_object", Bucket=bucket, Key=key)["ContentLength"] == 4


def test_a_resume_warns_of_a_store_entry_its_next_save_refuses(store: tuple[str, dict[str, Any]]) -> None:
    """A user's object in ``step-3/`` (or what a killed prune left) beside steps 1 and 2: a directory's resume warned
    that the save of step 3 would be refused; a store's said nothing, and the job failed at that save."""
    url, options = store
    rotation = tdcp.CheckpointRotation(url, keep_last=5, storage_options=options)
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(4.0)}, storage_options=options)
    for step in (1, 2):
        rotation.save(ckpt, step=step)
    blocked = resolve_path(f"{url}/step-000000000003/notes.txt", options)
    blocked.fs.pipe_file(blocked.key, b"mine")
    with pytest.warns(tdcp.TorchrlDcpWarning, match=r"step-000000000003 \(holds 1 object\(s\) but no valid"):
        assert tdcp.CheckpointRotation(url, storage_options=options).resume(ckpt).step == 2
    with pytest.raises(tdcp.CheckpointError, match="refusing to overwrite it"):
        rotation.save(ckpt, step=3)
