"""Forgeries of what names a file's writer or place, resealed where the format documents a checksum.

- a data file's identity trailer names the rank that wrote it; the file's name says a rank too (``__<r>_0``,
  ``__<r>_shared``, ``__<r>_<n>``): a file of another rank under this rank's name is refused, resealed or not
  (two ranks' files swapped: ``tests_distributed/test_forged_rank_files.py``);
- a local tier's part directory planted as a link to a directory outside the tier is never followed, as a linked
  step directory is not;
- an archive's local headers say the CRC-32 and sizes its central directory says (a reader that streams the local
  headers sees the same members), and an archive is one disk.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp import chunking, local_records, local_tier
from torchrl_dcp.format.layout import TRAILER_SIZE, read_identity
from torchrl_dcp.storage.archive import read_index


# ---------------------------------------------------------------------- identity trailers: the writing rank
def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"policy": torch.nn.Linear(8, 4), "table": {"rows": torch.randn(64, 16)}}


def _ckpt(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"], table=objs["table"])
    ckpt.register("rng", tdcp.RNGState())  # per_rank tensors: __0_0.distcp, listed in the shard
    return ckpt


def _rewrite_trailer_rank(data: bytes | bytearray, rank: int) -> bytes:
    """``data`` (a data file) with the rank in its identity trailer replaced, the save id kept."""
    out = bytearray(data)
    found = read_identity(bytes(out[-TRAILER_SIZE:]))
    assert found is not None
    out[-TRAILER_SIZE + 40 : -TRAILER_SIZE + 48] = rank.to_bytes(8, "little")
    assert read_identity(bytes(out[-TRAILER_SIZE:])) == (found[0], rank)
    return bytes(out)


def _refused_unchanged(path: Path, match: str) -> None:
    """Loads (verified or not) and ``verify`` refuse ``path`` with ``match``; the live objects keep their state."""
    fresh = _objects(1)
    before = fresh["policy"].weight.detach().clone()
    for verify in (True, False):
        with pytest.raises(tdcp.CheckpointIntegrityError, match=match):
            _ckpt(fresh).load(path, verify=verify)
    assert torch.equal(fresh["policy"].weight, before)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=match):
        tdcp.verify(path)


@pytest.mark.parametrize("name", ["__0_shared.distcp", "__0_0.distcp"])
def test_a_data_file_whose_trailer_names_another_rank_is_refused(tmp_path: Path, name: str) -> None:
    """The trailer names rank 3, the name rank 0; the file's record resealed: every reader that checks identities
    (load, verify, conversion, extraction) refuses it, naming the file and both ranks; nothing is restored."""
    saved = _objects(0)
    path = _ckpt(saved).save(tmp_path / "c", step=1)
    (path / name).write_bytes(_rewrite_trailer_rank((path / name).read_bytes(), 3))
    forging.reseal(path, name)
    match = rf"{name}: data file's identity trailer names rank 3, its name says rank 0"
    _refused_unchanged(path, match)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=match):
        tdcp.to_archive(path, tmp_path / "c.zip")
    assert not (tmp_path / "c.zip").exists()


@pytest.mark.parametrize("how", ["another save's shared file", "this save's own id", ".metadata"])
def test_an_origin_on_anything_but_a_kept_chunk_file_is_refused(tmp_path: Path, how: str) -> None:
    """``origin`` (a chunk file an incremental save kept) waived the identity comparisons for any file: another
    save's shared file came in with its record resealed and ``origin`` set to that save (its weights loaded), and a
    per-rank file under ``origin`` = this save's own id skipped the rank check (two ranks' files swapped). An origin
    on a file without a trailer (``.metadata``) was accepted. The manifest refuses each before any file is read."""
    saved = _objects(0)
    path = _ckpt(saved).save(tmp_path / "c", step=1)
    name = {"another save's shared file": "__0_shared.distcp", ".metadata": ".metadata"}.get(how, "__0_0.distcp")
    if how == "another save's shared file":
        other = _ckpt(_objects(5)).save(tmp_path / "other", step=1)
        (path / name).write_bytes((other / name).read_bytes())
        origin = forging.read_parts(other)["save_id"]
    elif how == "this save's own id":
        (path / name).write_bytes(_rewrite_trailer_rank((path / name).read_bytes(), 3))
        origin = forging.read_parts(path)["save_id"]
    else:
        origin = "e" * 32
    forging.reseal(path, name)
    forging.edit(path, lambda m: m["files"][name].update(origin=origin))
    refused = rf"files\['{re.escape(name)}'\]\.origin: only a chunk file an incremental save kept"
    fresh = _objects(1)
    before = fresh["policy"].weight.detach().clone()
    for action in (
        lambda: _ckpt(fresh).load(path, verify=False),
        lambda: tdcp.verify(path),
        lambda: tdcp.to_archive(path, tmp_path / "c.zip"),
    ):
        with pytest.raises(tdcp.CheckpointFormatError, match=refused):
            action()
    assert torch.equal(fresh["policy"].weight, before)


def test_a_kept_chunk_file_whose_origin_is_its_own_save_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk file's ``origin`` naming the save that lists it (no save writes that: it would waive the checks of
    its trailer) is refused by the manifest, in the shard that lists it."""
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    buf = {"rows": torch.randn(64, 64)}
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("buf", buf, placement="per_rank")
    path = ckpt.save(tmp_path / "c", step=1)
    m = forging.read_parts(path)
    chunk = next(n for n in m["files"] if n.startswith("__0_") and n != "__0_0.distcp" and n.endswith(".distcp"))
    forging.edit(path, lambda m: m["files"][chunk].update(origin=m["save_id"]))
    with pytest.raises(tdcp.CheckpointFormatError, match=rf"manifest-0\.json.*files\['{re.escape(chunk)}'\]\.origin"):
        tdcp.verify(path)


@pytest.mark.parametrize("verify", [False, True])
def test_a_data_file_replaced_after_its_identity_was_checked_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """A save over the checkpoint replaced its data file between the identity check and the reads (a real race:
    one in ~45 s of back-to-back saves and loads): with ``verify=False`` the load returned the other save's values,
    no error. Each handle the reads open is now the very file whose trailer was checked."""
    from torchrl_dcp import load_engine

    saved, other = _objects(0), _objects(7)
    path = _ckpt(saved).save(tmp_path / "c", step=1)
    theirs = _ckpt(other).save(tmp_path / "other", step=1)
    checked = load_engine.verify_bytes

    def then_replaced(*args: Any, **kwargs: Any) -> Any:
        out = checked(*args, **kwargs)
        for name in ("__0_shared.distcp", "__0_0.distcp"):  # renamed in, as a save's publish does
            os.link(theirs / name, tmp_path / f"{name}.new")
            os.rename(tmp_path / f"{name}.new", path / name)
        return out

    monkeypatch.setattr(load_engine, "verify_bytes", then_replaced)
    fresh = _objects(1)
    before = fresh["policy"].weight.detach().clone()
    with pytest.raises(tdcp.CheckpointError, match="distcp"):
        _ckpt(fresh).load(path, verify=verify)
    assert torch.equal(fresh["policy"].weight, before)


def test_a_data_file_whose_trailer_names_another_rank_is_refused_in_an_object_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same forgery on an object (a chunk file of a replicated tensor, listed in the root): refused from the
    trailers a verified load fetches with the data, and from the separate trailer reads of an unverified one."""
    import json
    import uuid

    import torchrl_dcp.chunking as chunking
    from torchrl_dcp.format.checksums import crc32, format_crc
    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.storage.urls import resolve_path

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 2 << 20)
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}/c"
    big = {"x": torch.randn(1 << 20)}  # 4 MiB: chunk files __0_1 .. __0_4
    path = tdcp.DistributedCheckpoint(big=big).save(url)
    fs = resolve_path(url, {}).fs
    key = (path / "__0_2.distcp").key
    forged = _rewrite_trailer_rank(fs.cat_file(key), 1)
    fs.pipe_file(key, forged)
    manifest = json.loads(fs.cat_file((path / "manifest.json").key))
    manifest["files"]["__0_2.distcp"] = {"size": len(forged), "checksum": format_crc(crc32(forged))}
    manifest.pop("manifest_checksum", None)
    fs.pipe_file((path / "manifest.json").key, dumps(seal(manifest)))
    fresh = {"x": torch.zeros(1 << 20)}
    for verify in (True, False):
        with pytest.raises(tdcp.CheckpointIntegrityError, match="names rank 1, its name says rank 0") as err:
            tdcp.DistributedCheckpoint(big=fresh).load(url, verify=verify)
        assert "__0_2.distcp" in str(err.value)
    assert not fresh["x"].any()  # nothing restored
    with pytest.raises(tdcp.CheckpointIntegrityError, match="names rank 1, its name says rank 0"):
        tdcp.verify(url)


def test_a_kept_chunk_file_carries_its_origin_save_s_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk file an incremental save kept (``origin``) carries the trailer the base's writer gave it, whichever
    rank that was (after a world-size change or a rebalanced plan, not the rank of its new name): its rank is not
    compared, the save id of its origin is."""
    import torchrl_dcp.chunking as chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 2 << 20)
    state = {"x": torch.randn(1 << 20)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    base = ckpt.save(tmp_path / "a")
    state["x"][:10] = 0.0  # the first chunk changes, the others are kept
    path = ckpt.save(tmp_path / "b", incremental_from=base)
    files = forging.read_parts(path)["files"]
    kept = sorted(n for n, rec in files.items() if "origin" in rec)
    assert kept, "the incremental save kept no chunk file"
    name = kept[0]
    (path / name).unlink()  # (a hard link into the base: written anew, not through the link)
    (path / name).write_bytes(_rewrite_trailer_rank((base / name).read_bytes(), 5))
    forging.reseal(path, name)
    tdcp.verify(path)
    fresh = {"x": torch.zeros(1 << 20)}
    tdcp.DistributedCheckpoint(state=fresh).load(path)
    assert torch.equal(fresh["x"], state["x"])


# ---------------------------------------------------------------------- local tier: linked part directories
def _rotation(root: Path) -> tdcp.CheckpointRotation:
    local = tdcp.LocalTier(root / "tier", every_steps=1, keep_last=1)
    return tdcp.CheckpointRotation(root / "shared", every_steps=1, keep_last=2, local=local)


def _saved_tier(root: Path) -> tuple[torch.nn.Linear, Path]:
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    rotation = _rotation(root)
    rotation.maybe_save(tdcp.DistributedCheckpoint(policy=policy), 1)
    rotation.close()
    return policy, root / "tier" / f"step-{1:012d}" / "rank-00000"


def _plant_link(part: Path, outside: Path) -> None:
    """Move the part out of the tier and leave a link to it in its place (the part itself stays intact)."""
    os.rename(part, outside)
    os.symlink(outside, part)


def test_a_part_directory_linked_outside_the_tier_is_not_resumed_from(tmp_path: Path) -> None:
    policy, part = _saved_tier(tmp_path)
    _plant_link(part, tmp_path / "outside")
    assert tdcp.LocalTier(tmp_path / "tier", every_steps=1).steps() == []  # the linked part is not held
    fresh = torch.nn.Linear(4, 3)
    info = _rotation(tmp_path).resume(tdcp.DistributedCheckpoint(policy=fresh))
    assert info is not None and info.tier == "shared" and info.step == 1  # the shared tier's entry, not the link
    assert torch.equal(fresh.weight, policy.weight)
    assert sorted(os.listdir(tmp_path / "outside")) == sorted(os.listdir(tmp_path / "shared" / f"step-{1:012d}"))


def test_a_linked_part_s_record_and_manifest_digest_are_refused(tmp_path: Path) -> None:
    _, part = _saved_tier(tmp_path)
    step_dir = part.parent
    assert local_records.read_record(step_dir, 0, 1, None) is not None
    _plant_link(part, tmp_path / "outside")
    assert local_records.read_record(step_dir, 0, 1, None) is None
    with pytest.raises(tdcp.CheckpointError, match="not a directory"):
        local_records.manifest_digest(part)
    with pytest.raises(tdcp.CheckpointError, match="not a directory"):
        local_records.write_record(step_dir, 0, 1, "0" * 32, {})


def test_a_part_linked_after_the_tier_was_listed_is_refused_before_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link planted between the listing (the part was a real directory) and the load: refused there, the
    shared tier is next."""
    policy, part = _saved_tier(tmp_path)
    chosen = local_tier.newest_complete

    def then_plant(*args: Any) -> Any:
        found = chosen(*args)
        _plant_link(part, tmp_path / "outside")
        return found

    monkeypatch.setattr(local_tier, "newest_complete", then_plant)
    fresh = torch.nn.Linear(4, 3)
    info = _rotation(tmp_path).resume(tdcp.DistributedCheckpoint(policy=fresh))
    assert info is not None and info.tier == "shared"
    assert torch.equal(fresh.weight, policy.weight)


def test_pruning_a_step_removes_a_linked_part_never_what_it_points_to(tmp_path: Path) -> None:
    _, part = _saved_tier(tmp_path)
    _plant_link(part, tmp_path / "outside")
    before = sorted(os.listdir(tmp_path / "outside"))
    rotation = _rotation(tmp_path)
    rotation.maybe_save(tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 3)), 2)  # keep_last=1: step 1 goes
    rotation.close()
    assert not os.path.lexists(part) and sorted(os.listdir(tmp_path / "outside")) == before
    assert tdcp.LocalTier(tmp_path / "tier", every_steps=1).steps() == [2]


# ---------------------------------------------------------------------- archives: local headers, one disk
def _archive(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(8, 4)).save(tmp_path / "c", step=1)
    return tdcp.to_archive(path, tmp_path / "a.zip")


def _central(data: bytes | bytearray) -> list[tuple[int, str, int]]:
    """``(offset of its central entry, name, local header offset)`` of every member."""
    eocd = data.rfind(b"PK\x05\x06")
    count = struct.unpack_from("<H", data, eocd + 10)[0]
    at = struct.unpack_from("<I", data, eocd + 16)[0]
    out = []
    for _ in range(count):
        n_name, n_extra, n_comment = struct.unpack_from("<3H", data, at + 28)
        name = bytes(data[at + 46 : at + 46 + n_name]).decode()
        out.append((at, name, struct.unpack_from("<I", data, at + 42)[0]))
        at += 46 + n_name + n_extra + n_comment
    return out


def _forge_local(data: bytearray, lho: int, how: str) -> None:
    crc, csize, size = struct.unpack_from("<3I", data, lho + 14)
    if how == "crc":
        struct.pack_into("<I", data, lho + 14, crc ^ 0xDEADBEEF)
    elif how == "sizes":
        struct.pack_into("<II", data, lho + 18, 7, 7)
    elif how == "size":
        struct.pack_into("<I", data, lho + 22, size + 1)
    elif how == "descriptor_other_crc":  # a data descriptor announced, the local CRC neither zero nor the same
        struct.pack_into("<H", data, lho + 6, struct.unpack_from("<H", data, lho + 6)[0] | 0x8)
        struct.pack_into("<I", data, lho + 14, crc ^ 1)
    elif how == "encrypted":
        struct.pack_into("<H", data, lho + 6, struct.unpack_from("<H", data, lho + 6)[0] | 0x1)


@pytest.mark.parametrize("how", ["crc", "sizes", "size", "descriptor_other_crc", "encrypted"])
def test_a_local_header_that_contradicts_the_central_directory_is_refused(tmp_path: Path, how: str) -> None:
    archive = _archive(tmp_path)
    data = bytearray(archive.read_bytes())
    _, name, lho = _central(data)[1]
    _forge_local(data, lho, how)
    archive.write_bytes(data)
    match = rf"a\.zip::{name}: local header says"
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.verify(archive)
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.to_directory(archive, tmp_path / "out")
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.read_manifest(archive)
    assert not (tmp_path / "out").exists()


def test_a_data_descriptor_with_zero_local_fields_is_accepted(tmp_path: Path) -> None:
    """General-purpose flag bit 3: the local CRC-32 and sizes may be zero (APPNOTE 4.4.4); the central directory's
    are the member's."""
    archive = _archive(tmp_path)
    data = bytearray(archive.read_bytes())
    for central_at, _, lho in _central(data):
        for at in (lho + 6, central_at + 8):
            struct.pack_into("<H", data, at, struct.unpack_from("<H", data, at)[0] | 0x8)
        struct.pack_into("<3I", data, lho + 14, 0, 0, 0)
    archive.write_bytes(data)
    tdcp.verify(archive)
    back = tdcp.to_directory(archive, tmp_path / "out")
    assert all((back / f.name).read_bytes() == f.read_bytes() for f in (tmp_path / "c").iterdir())


def test_zip64_local_sizes_are_compared_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrl_dcp.format import zipformat

    torch.manual_seed(0)
    path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(64, 32)).save(tmp_path / "c", step=1)
    with monkeypatch.context() as m:
        m.setattr(zipformat, "ZIP64_LIMIT", 1000)
        archive = tdcp.to_archive(path, tmp_path / "a.zip")
    members = read_index(archive)  # the honest ZIP64 archive reads
    data = bytearray(archive.read_bytes())
    big = [(m.name, m.header_offset) for m in members.values() if m.size >= 1000]
    assert big
    name, lho = big[0]
    assert struct.unpack_from("<2I", data, lho + 18) == (zipformat.U32, zipformat.U32)
    n_name = struct.unpack_from("<H", data, lho + 26)[0]
    extra = lho + 30 + n_name
    assert struct.unpack_from("<H", data, extra)[0] == 1  # the ZIP64 extra field: size, compressed size
    struct.pack_into("<Q", data, extra + 4, members[name].size - 64)
    archive.write_bytes(data)
    with pytest.raises(tdcp.CheckpointFormatError, match=rf"a\.zip::{name}: local header says"):
        tdcp.verify(archive)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (4, 1, "on disk 1"),  # number of this disk
        (6, 2, "central directory on disk 2"),  # disk where the central directory starts
        (8, 1, "1 of its"),  # entries on this disk != entries in all
    ],
)
def test_an_end_record_of_a_split_archive_is_refused(tmp_path: Path, field: int, value: int, match: str) -> None:
    archive = _archive(tmp_path)
    data = bytearray(archive.read_bytes())
    struct.pack_into("<H", data, data.rfind(b"PK\x05\x06") + field, value)
    archive.write_bytes(data)
    for read in (tdcp.verify, tdcp.read_manifest):
        with pytest.raises(tdcp.CheckpointFormatError, match=f"{match}.*split \\(multi-disk\\) archive"):
            read(archive)


def test_a_member_on_another_disk_is_refused_naming_it(tmp_path: Path) -> None:
    archive = _archive(tmp_path)
    data = bytearray(archive.read_bytes())
    central_at, name, _ = _central(data)[1]
    struct.pack_into("<H", data, central_at + 34, 3)  # disk number start
    archive.write_bytes(data)
    with pytest.raises(tdcp.CheckpointFormatError, match=rf"a\.zip::{name}: .*on disk 3"):
        tdcp.verify(archive)
    with pytest.raises(tdcp.CheckpointFormatError, match=rf"a\.zip::{name}: .*on disk 3"):
        tdcp.to_directory(archive, tmp_path / "out")


def test_a_zip64_locator_of_several_disks_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrl_dcp.format import zipformat

    torch.manual_seed(0)
    path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(64, 32)).save(tmp_path / "c", step=1)
    with monkeypatch.context() as m:
        m.setattr(zipformat, "ZIP64_LIMIT", 100)  # the central directory's offset too: ZIP64 end records
        archive = tdcp.to_archive(path, tmp_path / "a.zip")
    tdcp.verify(archive)
    data = bytearray(archive.read_bytes())
    locator = data.rfind(b"PK\x06\x07")
    assert locator > 0
    struct.pack_into("<I", data, locator + 16, 2)  # total number of disks
    archive.write_bytes(data)
    with pytest.raises(tdcp.CheckpointFormatError, match="counts 2 disks"):
        tdcp.verify(archive)


@pytest.mark.parametrize("name", ["a/b", "..", "../../outside", "x\nmore"])
def test_a_component_name_no_save_writes_is_refused_by_every_reader(tmp_path: Path, name: str) -> None:
    """A resealed manifest renaming a component to a name every save refuses (``a/b``, ``..``) passed ``verify`` and
    ``inspect``; ``export_torchrl`` then raised torchrl's bare ``ValueError`` ("names cannot contain path
    separators"). Refused as a malformed manifest, naming it, by every reader."""
    src = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), no_dist=True).save(tmp_path / "c", step=1)

    def rename(m: dict[str, Any]) -> None:
        comp = m["components"].pop("policy")
        comp["inventory"] = {k.replace("/policy/", f"/{name}/"): v for k, v in comp["inventory"].items()}
        m["components"][name] = comp
        m["index"]["entries"] = [[e[0].replace("/policy/", f"/{name}/"), *e[1:]] for e in m["index"]["entries"]]
        forging.mirror_into_metadata(src, m)

    forging.edit(src, rename)
    why = re.escape(f"component name {name!r} is not one a save writes")
    with pytest.raises(tdcp.CheckpointFormatError, match=why) as err:
        tdcp.verify(src)
    assert str(err.value.path) == str(src / "manifest.json")
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.export_torchrl(src, tmp_path / "export")
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), no_dist=True).load(src)
    assert not (tmp_path / "export").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("name", ["README.txt", ".metadata.tmp", ".step-1.tdcp-lock", "\uff3f_0_0.distcp"])
def test_a_listed_file_no_save_writes_is_refused(tmp_path: Path, name: str) -> None:
    """A resealed manifest listing a file of another name (a user's README.txt, a temporary's name, a full-width
    look-alike of a data file), present with its size and checksum: verify, load and both conversions accepted it,
    and the conversions carried it. Only names a save writes may be listed."""
    from torchrl_dcp.format.checksums import crc32, format_crc

    src = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), no_dist=True).save(tmp_path / "c", step=1)
    body = b"planted"
    (src / name).write_bytes(body)

    def plant(m: dict[str, Any]) -> None:
        m["files"][name] = {"size": len(body), "checksum": format_crc(crc32(body))}

    forging.edit(src, plant)
    why = re.escape(f"file name {name!r} is not one a save writes")
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.verify(src)
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2), no_dist=True).load(src)
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.to_archive(src, tmp_path / "c.zip")
    assert not (tmp_path / "c.zip").exists()
