"""Single-file archives: conversion both ways, loads in place, refusals, ZIP64, export, bounded RSS."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.format import rank_table
from torchrl_dcp.storage import reader as reader_module
from torchrl_dcp.storage.archive import ALIGN, ArchiveContainer, read_index
from torchrl_dcp.storage.filesums import file_checksum


def make(tmp_path: Path, n: int = 4) -> tuple[Path, dict]:
    torch.manual_seed(0)
    objs = {
        "policy": torch.nn.Linear(64, 32),
        "big": {f"w{i}": torch.randn(2048) for i in range(n)},
        "stats": {"episodes": 5},
    }
    ckpt = tdcp.DistributedCheckpoint(**objs)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt.save(tmp_path / "ckpt", step=12, metadata={"reward": 3.5}), objs


def fresh() -> tuple[tdcp.DistributedCheckpoint, dict]:
    objs = {"policy": torch.nn.Linear(64, 32), "big": {}, "stats": {}}
    ckpt = tdcp.DistributedCheckpoint(**objs)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt, objs


def test_round_trip_is_byte_identical_aligned_stored_and_deterministic(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        assert zf.testzip() is None  # stock zip tools read it
    assert [i.filename for i in infos][0] == "manifest.json"
    assert sorted(i.filename for i in infos) == sorted(p.name for p in path.iterdir())
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    members = read_index(archive)
    assert all(m.data_offset % ALIGN == 0 for m in members.values())
    back = tdcp.to_directory(archive, tmp_path / "back")
    for f in path.iterdir():
        assert (back / f.name).read_bytes() == f.read_bytes(), f.name
    assert tdcp.to_archive(back, tmp_path / "again.zip").read_bytes() == archive.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.zip", "back", "ckpt", "ckpt.zip"]  # no leftovers
    assert tdcp.verify(archive)["tensors"] == tdcp.verify(path)["tensors"]
    assert tdcp.read_manifest(archive) == tdcp.read_manifest(path)


def test_load_from_archive_in_place_full_and_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, saved = make(tmp_path, n=16)
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    ckpt, objs = fresh()
    result = ckpt.load(archive)
    assert result.loaded == {"policy", "big", "stats", "rng"} and result.step == 12
    assert torch.equal(objs["policy"].weight, saved["policy"].weight)
    assert all(torch.equal(objs["big"][k], v) for k, v in saved["big"].items())
    assert objs["stats"] == {"episodes": 5}
    assert not any(p.name.startswith("tdcp") for p in Path("/tmp").glob("tdcp*") if p.stat().st_mtime < 0)

    # a partial load reads the policy's bytes, not the 16 x 8 KiB of "big"
    counted: list[int] = []
    original = reader_module.RangeFile.read_at

    def counting(self, f, offset, view):  # type: ignore[no-untyped-def]
        original(self, f, offset, view)
        counted.append(len(view))

    monkeypatch.setattr(reader_module.RangeFile, "read_at", counting)
    ckpt, objs = fresh()
    ckpt.load(archive, components=["policy"], verify=False)
    assert torch.equal(objs["policy"].bias, saved["policy"].bias)
    policy_bytes = (64 * 32 + 32) * 4
    total = sum(f.stat().st_size for f in path.iterdir())
    assert policy_bytes <= sum(counted) < policy_bytes + 16_384 < total // 4, (sum(counted), total)


def test_direct_read_of_a_component(tmp_path: Path) -> None:
    from torchrl_dcp.extract import read_component

    path, saved = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    state = read_component(archive, "policy")
    assert torch.equal(state["weight"], saved["policy"].weight)
    rng = read_component(archive, "rng", rank=0)
    assert "torch" in rng or len(rng) > 0
    with pytest.raises(ValueError, match="per_rank"):
        read_component(archive, "rng")


def _rewrite(
    archive: Path,
    out: Path,
    rename: dict[str, str] | None = None,
    extra: dict[str, bytes] | None = None,
    compress: str | None = None,
    drop: str | None = None,
) -> Path:
    """A copy of ``archive`` with members renamed, added, compressed or dropped (built with stock zipfile)."""
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename == drop:
                continue
            data = src.read(info)
            name = (rename or {}).get(info.filename, info.filename)
            ctype = zipfile.ZIP_DEFLATED if info.filename == compress else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(name), data, compress_type=ctype)
        for name, data in (extra or {}).items():
            dst.writestr(zipfile.ZipInfo(name), data)
    return out


@pytest.mark.parametrize(
    "bad_name,error",
    [
        ("../evil.distcp", tdcp.CheckpointIntegrityError),
        ("/abs/evil.distcp", tdcp.CheckpointIntegrityError),
        ("dir\\evil.distcp", tdcp.CheckpointIntegrityError),
        ("sub/evil.distcp", tdcp.CheckpointFormatError),
    ],
)
def test_escaping_member_names_are_refused(tmp_path: Path, bad_name: str, error: type) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    bad = _rewrite(archive, tmp_path / "bad.zip", extra={bad_name: b"x"})
    for action in (
        lambda: fresh()[0].load(bad),
        lambda: tdcp.verify(bad),
        lambda: tdcp.to_directory(bad, tmp_path / "o"),
    ):
        with pytest.raises(error) as info:
            action()
        assert bad_name in str(info.value)
    assert not (tmp_path / "o").exists() and not (tmp_path / "evil.distcp").exists()


def test_unlisted_missing_duplicate_and_compressed_members_are_refused(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    bad = _rewrite(archive, tmp_path / "extra.zip", extra={"__9_0.distcp": b"x"})
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"__9_0.distcp: member not listed"):
        fresh()[0].load(bad)
    bad = _rewrite(archive, tmp_path / "missing.zip", rename={"__0_0.distcp": "__0_1.distcp"})
    with pytest.raises(tdcp.CheckpointIntegrityError, match="__0_1.distcp: member not listed|__0_0.distcp"):
        tdcp.verify(bad)
    with pytest.warns(UserWarning, match="Duplicate name"):
        bad = _rewrite(archive, tmp_path / "dup.zip", extra={"__0_0.distcp": b"x"})
    with pytest.raises(tdcp.CheckpointFormatError, match=r"__0_0.distcp: the archive holds this member twice"):
        fresh()[0].load(bad)
    bad = _rewrite(archive, tmp_path / "deflated.zip", compress="__0_0.distcp")
    with pytest.raises(tdcp.CheckpointFormatError, match=r"__0_0.distcp: member is compressed"):
        tdcp.verify(bad)


def _central_entry(data: bytes, name: str) -> int:
    """Offset of ``name``'s central directory record."""
    pos = data.index(b"PK\x01\x02" + data[data.index(b"PK\x01\x02") + 4 : data.index(b"PK\x01\x02") + 4][:0])
    while True:
        n, m, k = struct.unpack("<3H", data[pos + 28 : pos + 34])
        if data[pos + 46 : pos + 46 + n] == name.encode():
            return pos
        pos = data.index(b"PK\x01\x02", pos + 46 + n + m + k)


def test_damaged_central_directory_overlap_and_out_of_bounds_are_refused(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    data = archive.read_bytes()

    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(data[: len(data) - 30])  # the end record is gone
    with pytest.raises(tdcp.CheckpointFormatError, match="central directory is damaged"):
        fresh()[0].load(truncated)

    # the manifest's record claims more bytes than it has: its data runs over the next member
    pos = _central_entry(data, "manifest.json")
    size = struct.unpack("<L", data[pos + 24 : pos + 28])[0]
    overlap = bytearray(data)
    overlap[pos + 20 : pos + 28] = struct.pack("<2L", size + 200, size + 200)
    (tmp_path / "overlap.zip").write_bytes(overlap)
    with pytest.raises(tdcp.CheckpointFormatError, match=r"::.metadata: member overlaps member 'manifest.json'"):
        tdcp.verify(tmp_path / "overlap.zip")

    pos = _central_entry(data, "__0_0.distcp")
    beyond = bytearray(data)
    beyond[pos + 20 : pos + 28] = struct.pack("<2L", 1 << 30, 1 << 30)
    (tmp_path / "beyond.zip").write_bytes(beyond)
    with pytest.raises(tdcp.CheckpointFormatError, match=r"__0_0.distcp: member data extends beyond"):
        tdcp.verify(tmp_path / "beyond.zip")

    # the central directory points at the wrong local header
    moved = bytearray(data)
    offset = struct.unpack("<L", data[pos + 42 : pos + 46])[0]
    moved[pos + 42 : pos + 46] = struct.pack("<L", offset + 8)
    (tmp_path / "moved.zip").write_bytes(moved)
    with pytest.raises(tdcp.CheckpointFormatError, match=r"__0_0.distcp: local header is damaged"):
        tdcp.verify(tmp_path / "moved.zip")


def test_damaged_member_data_is_refused_naming_the_member(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    member = read_index(archive)["__0_0.distcp"]
    raw = bytearray(archive.read_bytes())
    raw[member.data_offset + member.size // 2] ^= 0x10
    archive.write_bytes(raw)
    ckpt, objs = fresh()
    before = objs["policy"].weight.detach().clone()
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"c.zip::__0_0.distcp: checksum is crc32:"):
        ckpt.load(archive)
    assert torch.equal(objs["policy"].weight, before)  # nothing restored
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"::__0_0.distcp"):
        tdcp.verify(archive)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"::__0_0.distcp"):
        tdcp.to_directory(archive, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zip", "ckpt"]  # staging removed, nothing published


def test_planted_pickle_in_archived_metadata_is_never_run(tmp_path: Path) -> None:
    """A resealed ``.metadata`` that is a payload: ``verify`` of the archive refuses to unpickle it naming the member;
    a load restores exactly the saved state without reading it; nothing runs."""
    path, saved = make(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path.touch, (marker,))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    forging.reseal(path, ".metadata")  # its size and CRC-32 recorded, the manifest resealed
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"c\.zip::\.metadata"):
        tdcp.verify(archive)
    # a load never reads .metadata (format 5: the manifest's storage entries place the tensors): the saved state
    ckpt, objs = fresh()
    ckpt.load(archive)
    assert torch.equal(objs["policy"].weight, saved["policy"].weight)
    assert (
        all(torch.equal(objs["big"][k], v) for k, v in saved["big"].items())
        and objs["big"].keys() == saved["big"].keys()
    )
    assert not marker.exists()


def test_conversions_resolve_file_urls_as_saves_and_loads_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, saved = make(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a file:// URL read as a relative path would land in here
    a = tdcp.to_archive(f"file://{path}", f"file://{tmp_path}/a.zip")
    assert a == tmp_path / "a.zip" and a.is_file()
    b = tdcp.to_directory(f"file://localhost{a}", f"file://localhost{tmp_path}/b")  # RFC 8089's spelling
    assert b == tmp_path / "b" and all((b / f.name).read_bytes() == f.read_bytes() for f in path.iterdir())
    assert tdcp.to_archive(f"file://{b}", f"file://{a}", overwrite=True) == a
    out = tdcp.export_torchrl(f"file://{a}", f"file://{tmp_path}/p.torchrl", "policy")  # one name, as load takes it
    assert out == tmp_path / "p.torchrl" and out.exists()
    assert tdcp.read_manifest(f"file://localhost{b}")["step"] == 12
    for bad in (f"file://otherhost{path}", "file://relative/c"):  # a host other than localhost: refused, named
        with pytest.raises(tdcp.CheckpointError, match="not host"):
            tdcp.to_archive(path, bad)
        with pytest.raises(tdcp.CheckpointError, match="not host"):
            tdcp.to_directory(bad, tmp_path / "never")
    assert list(cwd.iterdir()) == [] and not (tmp_path / "never").exists()


def test_overwrite_never_replaces_a_checkpoint_directory_holding_user_files(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    (path / "eval_results.txt").write_text("precious")
    (path / "videos").mkdir()
    (path / "videos" / "ep1.mp4").write_text("precious too")
    refused = r"never holds \(\['eval_results.txt', 'videos'\]\)"
    with pytest.raises(tdcp.CheckpointError, match=refused):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(64, 32)).save(path)  # what a save says
    other = tdcp.to_directory(archive, tmp_path / "other")
    with pytest.raises(tdcp.CheckpointError, match=refused):
        tdcp.to_directory(archive, path, overwrite=True)
    with pytest.raises(tdcp.CheckpointError, match=refused):  # nor by an archive
        tdcp.to_archive(other, path, overwrite=True)
    assert (path / "eval_results.txt").read_text() == "precious"
    assert (path / "videos" / "ep1.mp4").read_text() == "precious too"
    (path / "eval_results.txt").unlink()
    shutil.rmtree(path / "videos")
    assert tdcp.verify(path)["files"] > 0  # the checkpoint was left untouched too
    assert tdcp.to_directory(archive, path, overwrite=True) == path  # a plain checkpoint is still replaced


def test_a_conversion_over_a_user_s_file_says_to_choose_another_destination(tmp_path: Path) -> None:
    """A destination that is not a checkpoint (a user's file, a dangling link): the conversion said "already exists;
    pass overwrite=True", and with it then refused ("not a torchrl_dcp checkpoint"). It says what works at once."""
    path, _ = make(tmp_path)
    mine = tmp_path / "results.zip"
    mine.write_text("precious")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for overwrite in (False, True):
        with pytest.raises(tdcp.CheckpointError, match="not a torchrl_dcp checkpoint.*choose another destination"):
            tdcp.to_archive(path, mine, overwrite=overwrite)
        with pytest.raises(tdcp.CheckpointError, match="symbolic link.*choose another destination"):
            tdcp.to_archive(path, tmp_path / "dangling", overwrite=overwrite)
    assert mine.read_text() == "precious"


def test_an_archive_destination_ending_with_a_slash_is_refused(tmp_path: Path) -> None:
    """``convert SRC out/b/``: the slash was dropped and an archive file ``b`` written where a directory was meant."""
    path, _ = make(tmp_path)
    with pytest.raises(tdcp.CheckpointError, match="ends with a slash.*name it"):
        tdcp.to_archive(path, f"{tmp_path}/out/")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_directory_holding_a_user_s_file_named_like_ours_is_never_replaced(tmp_path: Path) -> None:
    """A user's ``__7_0.distcp`` and ``manifest-7.json`` (named like a save's files, listed nowhere) in a checkpoint
    directory: ``to_directory(..., overwrite=True)`` and a save over it deleted them with it. They are the user's:
    refused, as any other file of theirs there, and kept."""
    path, objs = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    dst = tmp_path / "dst"
    shutil.copytree(path, dst)
    (dst / "__7_0.distcp").write_text("my notes")
    (dst / "manifest-7.json").write_text('{"my": "notes"}')
    with pytest.raises(tdcp.CheckpointError, match=r"never holds \(\['__7_0\.distcp', 'manifest-7\.json'\]\)"):
        tdcp.to_directory(archive, dst, overwrite=True)
    with pytest.raises(tdcp.CheckpointError, match=r"__7_0\.distcp"):
        tdcp.DistributedCheckpoint(**objs).save(dst)
    assert (dst / "__7_0.distcp").read_text() == "my notes" and (dst / "manifest-7.json").exists()
    assert tdcp.to_directory(archive, path, overwrite=True) == path  # (a checkpoint holding only its files: replaced)


def test_conversion_refuses_damage_and_existing_destinations(tmp_path: Path) -> None:
    path, _ = make(tmp_path)
    other = tdcp.to_archive(path, tmp_path / "c.zip")
    with pytest.raises(tdcp.CheckpointError, match="already exists"):
        tdcp.to_archive(path, other)
    tdcp.to_archive(path, other, overwrite=True)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(tdcp.CheckpointError, match="not a torchrl_dcp checkpoint"):
        tdcp.to_archive(path, tmp_path / "notes.txt", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"ckpt/__0_0.distcp: checksum is"):
        tdcp.to_archive(path, tmp_path / "d.zip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zip", "ckpt", "notes.txt"]  # no temp file left
    with pytest.raises(tdcp.CheckpointFormatError, match="use to_directory"):
        tdcp.to_archive(other, tmp_path / "x.zip")
    with pytest.raises(tdcp.CheckpointFormatError, match="use to_archive"):
        tdcp.to_directory(path, tmp_path / "x")


def test_zip64_members_round_trip_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members over the ZIP64 limit (lowered here so the test stays small) use ZIP64 records and stay aligned."""
    path, saved = make(tmp_path)
    from torchrl_dcp.format import zipformat

    with monkeypatch.context() as m:
        m.setattr(zipformat, "ZIP64_LIMIT", 1000)
        archive = tdcp.to_archive(path, tmp_path / "c.zip")
    raw = archive.read_bytes()
    assert b"PK\x06\x06" in raw  # the ZIP64 end of central directory record
    with zipfile.ZipFile(archive) as zf:
        assert zf.testzip() is None
    assert all(m.data_offset % ALIGN == 0 for m in read_index(archive).values())
    ckpt, objs = fresh()
    ckpt.load(archive)
    assert torch.equal(objs["policy"].weight, saved["policy"].weight)
    back = tdcp.to_directory(archive, tmp_path / "back")
    assert all((back / f.name).read_bytes() == f.read_bytes() for f in path.iterdir())


def test_export_policy_for_torchrl_checkpoint_without_distributed(tmp_path: Path) -> None:
    path, saved = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    out = tdcp.export_torchrl(archive, tmp_path / "policy.torchrl", ["policy", "stats"])
    torch.save(saved["policy"].state_dict(), tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from torchrl.checkpoint import Checkpoint
        policy, stats = torch.nn.Linear(64, 32), {{}}
        result = Checkpoint(policy=policy, stats=stats).load({str(out)!r})
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        assert result.loaded == {{"policy", "stats"}}, result
        assert all(torch.equal(policy.state_dict()[k], v) for k, v in expected.items())
        assert stats == {{"episodes": 5}}, stats
        assert result.manifest["metadata"]["step"] == 12
        assert "torch.distributed" not in sys.modules or not torch.distributed.is_initialized()
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
    assert tdcp.export_torchrl(path, tmp_path / "rng.torchrl", ["rng"]).exists()  # RNG: rank 0's unless rank=...
    with pytest.raises(tdcp.IncompatibleComponentError, match="nope"):
        tdcp.export_torchrl(path, tmp_path / "x.torchrl", ["nope"])
    with pytest.raises(tdcp.CheckpointError, match="already exists"):
        tdcp.export_torchrl(path, out, ["policy"])
    assert tdcp.export_torchrl(path, out, ["policy"], overwrite=True) == out  # a torchrl checkpoint is replaced
    with pytest.raises(tdcp.CheckpointError, match="torchrl.checkpoint checkpoint already.*loads it as it is"):
        tdcp.export_torchrl(out, tmp_path / "again.torchrl", ["policy"])  # (it said: format 'torchrl.checkpoint')


def test_export_overwrite_never_deletes_what_is_not_a_torchrl_checkpoint(tmp_path: Path) -> None:
    """``export_torchrl(..., overwrite=True)`` handed the destination to torchrl, which replaces whatever is there:
    a directory of the user's was deleted. Only a torchrl checkpoint is replaced now."""
    path, _ = make(tmp_path)
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "eval.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    for dst in (mine, tmp_path / "notes.txt"):
        with pytest.raises(tdcp.CheckpointError, match="is not a torchrl.checkpoint checkpoint"):
            tdcp.export_torchrl(path, dst, ["policy"], overwrite=True)
    assert (mine / "eval.txt").read_text() == "mine" and (tmp_path / "notes.txt").read_text() == "mine"
    real = tdcp.export_torchrl(path, tmp_path / "real.torchrl", ["policy"])  # a link to a real export: said a link
    link = tmp_path / "latest.torchrl"
    link.symlink_to(real)
    with pytest.raises(tdcp.CheckpointError, match="is a symbolic link: overwrite=True never replaces a link"):
        tdcp.export_torchrl(path, link, ["policy"], overwrite=True)
    assert link.is_symlink() and real.exists()


def test_export_overwrite_keeps_a_users_files_put_into_an_old_export(tmp_path: Path) -> None:
    """torchrl replaces the whole tree of an old export: a user's notes and videos put into it were deleted. An
    export holding anything torchrl did not write is refused, nothing deleted."""
    path, _ = make(tmp_path)
    out = tdcp.export_torchrl(path, tmp_path / "export", ["policy"], format="directory")
    (out / "notes.txt").write_text("mine")
    (out / "videos").mkdir()
    (out / "videos" / "eval.mp4").write_bytes(b"mine")
    with pytest.raises(tdcp.CheckpointError, match=r"torchrl.checkpoint did not write \(\['notes.txt', 'videos/'\]\)"):
        tdcp.export_torchrl(path, out, ["policy"], format="directory", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "videos" / "eval.mp4").read_bytes() == b"mine"
    (out / "notes.txt").unlink()
    shutil.rmtree(out / "videos")
    assert tdcp.export_torchrl(path, out, ["policy"], format="directory", overwrite=True) == out  # its own: replaced


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_export_overwrite_keeps_a_file_put_into_the_old_export_while_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The old export was checked once, then torchrl replaced it (renamed aside, ``rmtree``): a file a user wrote
    into it meanwhile was deleted, and the export reported success. The old export is now moved aside by the
    export itself and checked again: the user's file is put back with it, nothing exported."""
    from torchrl.checkpoint import Checkpoint

    path, _ = make(tmp_path)
    out = tdcp.export_torchrl(path, tmp_path / "export", ["policy"], format="directory")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    save = Checkpoint.save

    def save_while_the_user_writes(self: Any, *args: Any, **kwargs: Any) -> Any:
        (out / "eval_results.txt").write_text("mine")
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "save", save_while_the_user_writes)
    with pytest.raises(tdcp.CheckpointError, match=r"did not write \(\['eval_results.txt'\]\).*nothing was exported"):
        tdcp.export_torchrl(path, out, ["policy"], format=fmt, overwrite=True)
    assert (out / "eval_results.txt").read_text() == "mine"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted([*before, "eval_results.txt"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []  # nothing left over
    monkeypatch.undo()
    (out / "eval_results.txt").unlink()
    assert tdcp.export_torchrl(path, out, ["policy"], format=fmt, overwrite=True) == out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []


def test_an_export_that_fails_on_the_file_system_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A name the file system refuses (too long) escaped ``export_torchrl`` as a bare ``OSError``."""
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("p" * 300, {"w": torch.ones(2)})  # (a valid component name: too long for a torchrl file name)
    path = ckpt.save(tmp_path / "ckpt")
    for fmt in ("archive", "directory"):
        with pytest.raises(tdcp.CheckpointError, match="exporting failed"):
            tdcp.export_torchrl(path, tmp_path / f"out-{fmt}", ["p" * 300], format=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


RSS_SCRIPT = """
import sys, time
import torchrl_dcp as tdcp
src, zip_path, back = sys.argv[1:4]
t0 = time.perf_counter(); tdcp.to_archive(src, zip_path); t1 = time.perf_counter()
tdcp.to_directory(zip_path, back); t2 = time.perf_counter()
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(hwm * 1024, t1 - t0, t2 - t1, "torch" in sys.modules)
"""


@pytest.mark.slow
def test_one_gigabyte_converts_both_ways_in_bounded_rss(tmp_path: Path) -> None:
    """Peak RSS of a process converting a 1 GiB checkpoint to an archive and back (a behaviour, not a time)."""
    tensors = {f"t{i}": torch.full((64 << 20,), float(i), dtype=torch.float32) for i in range(4)}  # 4 x 256 MiB
    path = tdcp.DistributedCheckpoint(big=tensors).save(tmp_path / "big")
    del tensors
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size >= 1 << 30
    proc = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(path), str(tmp_path / "big.zip"), str(tmp_path / "back")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak, t_pack, t_unpack, imported_torch = proc.stdout.split()
    print(
        f"1 GiB: pack {size / float(t_pack) / 1e9:.2f} GB/s, unpack {size / float(t_unpack) / 1e9:.2f} GB/s, "
        f"peak RSS {int(peak) / 2**20:.0f} MiB"
    )
    assert imported_torch == "False"  # conversion is pure streaming: it never needs torch
    assert int(peak) < 100 << 20, f"peak RSS {int(peak) / 2**20:.0f} MiB"
    assert all(file_checksum(tmp_path / "back" / f.name) == file_checksum(f) for f in path.iterdir())
    shutil.rmtree(tmp_path / "back")
    assert ArchiveContainer(tmp_path / "big.zip").manifest()["components"]["big"]["nbytes"] == 1 << 30


def test_many_central_entries_cost_a_small_multiple_of_the_archive_to_index(tmp_path: Path) -> None:
    """The index reads the central directory itself (no ``ZipInfo`` per entry): 100,000 tiny members index within
    3x the archive's size in memory (``zipfile`` took ~6x), and an end record that counts other entries than the
    directory holds is refused."""
    import tracemalloc

    from torchrl_dcp.format.zipformat import central_entry, end_records, local_header

    n = 100_000
    body, directory = bytearray(), bytearray()
    for i in range(n):
        name = f"f{i}".encode()
        directory += central_entry(name, 0, 0, len(body))
        body += local_header(name, 0, 0, len(body))
    blob = bytes(body + directory + end_records(n, len(body), len(directory)))
    (tmp_path / "many.zip").write_bytes(blob)
    tracemalloc.start()
    try:
        members = read_index(tmp_path / "many.zip")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(members) == n and members["f7"].size == 0
    assert peak < 3 * len(blob), f"{peak} bytes to index a {len(blob)}-byte archive"
    with pytest.raises(tdcp.CheckpointError, match="counts"):
        miscounted = body + directory + end_records(n + 1, len(body), len(directory))
        (tmp_path / "miscounted.zip").write_bytes(bytes(miscounted))
        read_index(tmp_path / "miscounted.zip")


def test_a_member_added_among_a_rank_s_own_files_is_refused_when_the_archive_is_opened(tmp_path: Path) -> None:
    """Format 7: a rank's own files are listed in its shard, not the root; the archive's other members are counted
    against the root's rank table (format 8) as soon as the archive is opened (before any shard is read): one more member
    named like a file of rank 0 is refused by every reader."""
    path, _ = make(tmp_path)
    root = json.loads((path / "manifest.json").read_text())
    assert "__0_0.distcp" not in root["files"]
    assert rank_table.own_files(root, 0) == (1, (path / "__0_0.distcp").stat().st_size)
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    assert fresh()[0].load(archive).step == 12  # its own file is a member, found through rank 0's shard
    extra = _rewrite(archive, tmp_path / "extra.zip", extra={"__0_9.distcp": b"x"})
    # (named as a directory names it: rank 0's shard, read then, lists its own files; an archive that lacks one
    # named the shard and its counts instead of the missing member)
    missing = _rewrite(archive, tmp_path / "missing.zip", drop="__0_0.distcp")
    for bad, match in (
        (extra, r"extra.zip::__0_9.distcp: member not listed in the manifest"),
        (missing, r"missing.zip::__0_0.distcp: member listed in the manifest is missing"),
    ):
        for action in (
            lambda bad=bad: fresh()[0].load(bad),
            lambda bad=bad: tdcp.verify(bad),
            lambda bad=bad: tdcp.read_manifest(bad),
            lambda bad=bad: tdcp.to_directory(bad, tmp_path / "o"),
        ):
            with pytest.raises(tdcp.CheckpointIntegrityError, match=match):
                action()
    assert not (tmp_path / "o").exists()


def test_nothing_is_written_into_or_over_a_checkpoint_by_a_conversion_or_a_save(tmp_path: Path) -> None:
    """A conversion (or a save) into a checkpoint directory wrote a file its manifest does not list: the checkpoint
    was refused by every later load ("file not listed in the manifest: the checkpoint was altered"). Conversions
    over their own source are refused too; nothing is created anywhere."""
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "a.zip")
    listing = sorted(p.name for p in path.iterdir())
    attempts = {
        "archive inside its source": lambda: tdcp.to_archive(path, path / "x.zip"),
        "archive over its source": lambda: tdcp.to_archive(path, path, overwrite=True),
        "unpack over its archive": lambda: tdcp.to_directory(archive, archive, overwrite=True),
        "unpack into another checkpoint": lambda: tdcp.to_directory(archive, path / "sub" / "ckpt"),
        "export inside": lambda: tdcp.export_torchrl(path, path / "policy.torchrl", ["policy"]),
        "save inside": lambda: tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2)).save(path / "inner"),
        "rotation inside": lambda: tdcp.CheckpointRotation(path / "runs").save(
            tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2)), step=1
        ),
    }
    for what, attempt in attempts.items():
        with pytest.raises(tdcp.CheckpointError, match="inside the checkpoint|is the checkpoint being converted"):
            attempt()
        assert sorted(p.name for p in path.iterdir()) == listing, what
    assert archive.is_file()
    ckpt, objs = fresh()
    assert ckpt.load(path).loaded == {"policy", "big", "stats", "rng"}
    tdcp.verify(archive)


def test_a_path_stepping_up_through_a_checkpoint_makes_nothing_inside_it(tmp_path: Path) -> None:
    """``<ckpt>/x/../../out``: the checks saw the path the file system takes (beside ``<ckpt>``), but the save or
    conversion made its parents as written, ``<ckpt>/x`` first, and the committed checkpoint no longer verified
    ("file not listed in the manifest"). Each now writes where the path leads, and makes nothing on the way."""
    path, _ = make(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "a.zip")
    listing = sorted(p.name for p in path.iterdir())
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2))
    up = path / "{}" / ".." / ".."
    writes = {
        "save": lambda: ckpt.save(str(up).format("s") + "/saved"),
        "archive": lambda: tdcp.to_archive(path, str(up).format("a") + "/out.zip"),
        "unpack": lambda: tdcp.to_directory(archive, str(up).format("u") + "/unpacked"),
        "export": lambda: tdcp.export_torchrl(path, str(up).format("e") + "/p.torchrl", ["policy"]),
        "rotation": lambda: tdcp.CheckpointRotation(str(up).format("r") + "/runs").save(ckpt, step=1),
        "file URL": lambda: ckpt.save("file://" + str(up).format("f") + "/by-url"),
    }
    for what, write in writes.items():
        write()
        assert sorted(p.name for p in path.iterdir()) == listing, what
    rotation = tdcp.CheckpointRotation(
        tmp_path / "shared", every_steps=100, local=tdcp.LocalTier(str(up).format("t") + "/tier", every_steps=1)
    )
    rotation.maybe_save(ckpt, 1)
    assert sorted(p.name for p in path.iterdir()) == listing
    assert {"saved", "out.zip", "unpacked", "p.torchrl", "runs", "by-url", "tier"} <= {
        p.name for p in tmp_path.iterdir()
    }
    tdcp.verify(path)
    with pytest.raises(tdcp.CheckpointError, match="inside the checkpoint"):  # a path that ends inside is refused
        ckpt.save(path / "x" / ".." / "y")
    assert sorted(p.name for p in path.iterdir()) == listing


def test_a_link_to_an_archive_loads_as_the_archive(tmp_path: Path) -> None:
    """Users point at checkpoints with links (``latest.zip -> step-5.zip``), archives as directories."""
    src = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)}).save(tmp_path / "c", step=5)
    archive = tdcp.to_archive(src, tmp_path / "step-5.zip")
    (tmp_path / "latest.zip").symlink_to(archive.name)
    got: dict = {}
    tdcp.DistributedCheckpoint(w=got).load(tmp_path / "latest.zip")
    assert torch.equal(got["x"], torch.arange(3.0))
    assert tdcp.verify(tmp_path / "latest.zip")["files"] >= 2
    assert tdcp.read_manifest(tmp_path / "latest.zip")["step"] == 5
    unpacked = tdcp.to_directory(tmp_path / "latest.zip", tmp_path / "unpacked")  # a source link is only read
    assert tdcp.read_manifest(unpacked)["step"] == 5
    with pytest.raises(tdcp.CheckpointError, match="symbolic link"):  # never replaced through the link
        tdcp.to_archive(src, tmp_path / "latest.zip", overwrite=True)
    assert (tmp_path / "latest.zip").is_symlink() and tdcp.verify(archive)


def test_an_archive_replaces_a_checkpoint_directory_with_overwrite(tmp_path: Path) -> None:
    src = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)}).save(tmp_path / "c", step=1)
    old = tdcp.DistributedCheckpoint(w={"x": torch.zeros(2)}).save(tmp_path / "old", step=0)
    out = tdcp.to_archive(src, old, overwrite=True)
    assert out == old and old.is_file() and tdcp.read_manifest(old)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "old"]  # no staging, trash or lock left


def test_export_of_values_torchrl_cannot_store_names_the_component(tmp_path: Path) -> None:
    from pathlib import PurePosixPath

    path = tdcp.DistributedCheckpoint(cfg={"ids": {1, 2}, "root": PurePosixPath("/data")}).save(tmp_path / "c")
    with pytest.raises(tdcp.CheckpointFormatError, match=r"component 'cfg' cannot be exported: cfg\['ids'\] is a set"):
        tdcp.export_torchrl(path, tmp_path / "cfg.torchrl", "cfg")
    assert not (tmp_path / "cfg.torchrl").exists()


def test_export_of_a_mapping_with_keys_json_changes_is_refused_and_a_refusal_says_what_to_export(
    tmp_path: Path,
) -> None:
    """``{"by_level": {1: 10.0}}`` was exported without a word and torchrl loaded ``{"1": 10.0}`` (JSON keys are
    strings); a component export cannot hold (a TensorDict) failed the default export saying nothing of
    ``components=``. Each refusal now names the others to export."""
    from tensordict import TensorDict

    path = tdcp.DistributedCheckpoint(
        policy=torch.nn.Linear(2, 2), cfg={"by_level": {1: 10.0}}, td=TensorDict({"x": torch.ones(2)}, [])
    ).save(tmp_path / "c")
    with pytest.raises(
        tdcp.CheckpointFormatError, match=r"cfg\['by_level'\] has the key 1 of type int .*components=\['policy'\]"
    ):
        tdcp.export_torchrl(path, tmp_path / "a.torchrl", ["policy", "cfg"])
    with pytest.raises(
        tdcp.CheckpointFormatError,
        match=r"'cfg' cannot be exported: .*has the key 1.*'td' cannot be exported.*components=\['policy'\]",
    ):
        tdcp.export_torchrl(path, tmp_path / "b.torchrl")
    assert not (tmp_path / "a.torchrl").exists() and not (tmp_path / "b.torchrl").exists()


def test_a_damaged_field_zipfile_cannot_read_is_never_an_exception_of_another_kind(tmp_path: Path) -> None:
    """The "version needed to extract" of a member in the central directory set to 0xFF: Python's zipfile (asked
    whether the file is a torchrl.checkpoint archive) raised NotImplementedError out of verify and load. The field
    is not ours to read: the archive loads, or a CheckpointError says why."""
    policy = torch.nn.Linear(4, 3)
    directory = tdcp.DistributedCheckpoint(policy=policy).save(tmp_path / "c", step=1)
    archive = tdcp.to_archive(directory, tmp_path / "c.zip")
    raw = bytearray(archive.read_bytes())
    at = raw.find(b"PK\x01\x02")  # the manifest's central directory header (its name 46 bytes in)
    while raw[at + 46 : at + 46 + len(b"manifest.json")] != b"manifest.json":
        at = raw.find(b"PK\x01\x02", at + 4)
    raw[at + 6 : at + 8] = b"\xff\x00"
    archive.write_bytes(bytes(raw))
    for attempt in (lambda: tdcp.verify(archive), lambda: tdcp.DistributedCheckpoint(policy=policy).load(archive)):
        try:
            attempt()
        except tdcp.CheckpointError:
            pass


def _end_record(data: bytes) -> tuple[int, int, int]:
    """``(position, central directory size, central directory offset)`` of a ZIP's end record."""
    at = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, at + 12)
    return at, cd_size, cd_offset


def _central_entries(directory: bytes) -> list[int]:
    out, at = [], 0
    while at < len(directory):
        out.append(at)
        at += 46 + sum(struct.unpack_from("<HHH", directory, at + 28))
    return out


def _polyglot(ours: bytes, theirs: bytes) -> bytes:
    """One file that is ``ours`` to a reader that takes the end record's offsets as they are, and ``theirs`` (a
    torchrl.checkpoint archive) to Python's zipfile, which takes whatever lies between the central directory and
    the end record for a prefix and shifts every offset by its length: ``ours``'s members, ``theirs``'s, ``ours``'s
    central directory, ``theirs``'s (both padded to one size with an entry comment), one end record."""
    (end_a, size_a, off_a), (_, size_b, off_b) = _end_record(ours), _end_record(theirs)
    size = max(size_a, size_b)

    def padded(directory: bytes, extra: int) -> bytearray:
        out = bytearray(directory)
        last = _central_entries(out)[-1]
        struct.pack_into("<H", out, last + 32, struct.unpack_from("<H", out, last + 32)[0] + extra)
        return out + b" " * extra

    cd_a = padded(ours[off_a : off_a + size_a], size - size_a)
    cd_b = padded(theirs[off_b : off_b + size_b], size - size_b)
    for at in _central_entries(cd_b):  # zipfile adds the gap (one directory's size) to each header offset
        struct.pack_into("<I", cd_b, at + 42, struct.unpack_from("<I", cd_b, at + 42)[0] + off_a - size)
    end = bytearray(ours[end_a:])
    struct.pack_into("<II", end, 12, size, off_a + off_b)
    return ours[:off_a] + theirs[:off_b] + bytes(cd_a) + bytes(cd_b) + bytes(end)


def test_one_file_is_never_read_as_two_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Bytes between an archive's central directory and its end record: this package's reader took the offsets as
    written (our archive, step 12), Python's zipfile (which asks whether a file is a torchrl.checkpoint archive, first)
    took the bytes for a prefix and read another archive (a torchrl.checkpoint of other weights, step 999):
    ``resume`` said step 12 and restored the other weights. Every reader refuses the file now, nothing restored."""
    policy = torch.nn.Linear(8, 4)
    ours = tdcp.to_archive(tdcp.DistributedCheckpoint(policy=policy).save(tmp_path / "a", step=12), tmp_path / "a.zip")
    other = torch.nn.Linear(8, 4)
    with torch.no_grad():
        other.weight.fill_(42.0)
    theirs = tmp_path / "b.torchrl"
    tdcp.export_torchrl(tdcp.DistributedCheckpoint(policy=other).save(tmp_path / "b", step=999), theirs, ["policy"])
    (tmp_path / "run").mkdir()
    both = tmp_path / "run" / "step-000000000012.zip"
    both.write_bytes(_polyglot(ours.read_bytes(), theirs.read_bytes()))
    with zipfile.ZipFile(both) as z:  # (the forgery works: zipfile finds the other archive's members)
        assert any("components/" in n for n in z.namelist())
    live = torch.nn.Linear(8, 4)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    for attempt in (
        lambda: tdcp.read_manifest(both),
        lambda: tdcp.verify(both),
        lambda: tdcp.DistributedCheckpoint(policy=live).load(both),
        lambda: tdcp.to_directory(both, tmp_path / "back"),
    ):
        with pytest.raises(tdcp.CheckpointError, match="between the central directory and the end record"):
            attempt()
    with pytest.warns(UserWarning):
        assert tdcp.resume(tdcp.DistributedCheckpoint(policy=live), both.parent) is None
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    from torchrl_dcp.cli import main

    assert main(["verify", str(both)]) == 1
    assert "please report" not in capsys.readouterr().err


def test_an_export_of_a_component_the_checkpoint_lacks_is_a_checkpoint_error_naming_what_it_holds(
    tmp_path: Path,
) -> None:
    src = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2)).save(tmp_path / "step-1")
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"\['critic'\].*holds \['policy'\]") as err:
        tdcp.export_torchrl(src, tmp_path / "out", components=["policy", "critic"])
    assert "step-1" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_torch_save_file_is_named_as_one(tmp_path: Path) -> None:
    """A ``torch.save`` file is a ZIP (its ZIP64 end record written even when small, which this package's reader
    follows as zipfile does): it was called a damaged archive "in a sub-directory (a torchrl.checkpoint archive?)"."""
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    for attempt in (
        lambda: tdcp.verify(tmp_path / "model.pt"),
        lambda: tdcp.read_manifest(tmp_path / "model.pt"),
        lambda: tdcp.DistributedCheckpoint(w={}).load(tmp_path / "model.pt"),
        lambda: tdcp.to_directory(tmp_path / "model.pt", tmp_path / "d"),
    ):
        with pytest.raises(tdcp.CheckpointFormatError, match=r"a torch.save file, not a checkpoint.*torch.load"):
            attempt()


def test_an_end_record_whose_fields_hold_its_own_signature_is_found_at_the_end() -> None:
    """Probe r3: a torchrl archive whose central directory starts at byte 0x06054B50 (its end record's offset field
    spells the signature): looking for an archive comment, the last signature found was that field, and the archive
    was refused. zipfile takes the end record at the very end first; so does this search."""
    from torchrl_dcp.format.zipformat import central_directory_span, central_entry, end_records

    at = 0x06054B50
    directory = central_entry(b"manifest.json", 0, 5, 0)
    tail = directory + end_records(1, at, len(directory))
    size = at + len(tail)

    def read(offset: int, n: int) -> bytes:  # (a sparse 101 MB file: its last bytes only)
        out = bytearray(n)
        lo = max(offset, at)
        out[lo - offset : offset + n - offset] = tail[lo - at : offset + n - at]
        return bytes(out)

    for comment in (False, True):
        assert central_directory_span(read, size, comment=comment) == (at, len(directory), 1)
