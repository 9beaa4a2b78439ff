"""Forged DCP metadata that reseals every checksum the format documents never becomes the state.

The forger rewrites ``.metadata`` (pickled by DCP, read here through the allow-list
unpickler), mirrors its records into the manifest's storage entries where they can say
the same (``tests/forging.py``: a forger who moves a record moves it in both), records the
new sizes and CRC-32s in the manifest and recomputes its seal, as ``docs/format.md``
describes. Only structure can then catch the forgery: every tensor must be tiled by its
chunks, each chunk backed by its own record, no two records on the same bytes.

Format 5: loads build DCP's metadata from the manifest's storage entries and never read
``.metadata``; ``verify`` reads it too. So each case: ``verify`` refuses naming what is
forged; where the forgery reached the manifest's entries, ``load`` refuses naming them with
the live objects bit-for-bit unchanged; where only ``.metadata`` is forged, ``load``
restores exactly the saved state, and ``.metadata`` (what a plain ``dcp.load`` reads) is
refused by its own checks. For directories, archives and object stores (fsspec's memory
store).
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.storage.backends import open_source
from torchrl_dcp.storage.filesystem import safe_load_metadata

WEIGHT = "replicated/policy/weight"  # read in place into the live module
TABLE = "replicated/stats/table"  # read into a fresh buffer, then copied


def objects(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    policy = torch.nn.Linear(16, 8)
    with torch.no_grad():
        policy.weight.copy_(torch.randn(8, 16, generator=g))
        policy.bias.copy_(torch.randn(8, generator=g))
    return {"policy": policy, "stats": {"table": torch.randn(64, 4, generator=g), "n": seed}}


def snapshot(objs: dict[str, Any]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*objs["policy"].state_dict().values(), objs["stats"]["table"])]


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _no_chunks(md: Any, key: str) -> None:
    md.state_dict_metadata[key].chunks = []


def _half_the_rows(md: Any, key: str) -> None:
    saved = md.state_dict_metadata[key]
    rows, *rest = saved.size
    saved.chunks = [_chunk((0,) * len(saved.size), (rows // 2, *rest))]


def _negative_size(md: Any, key: str) -> None:
    saved = md.state_dict_metadata[key]
    saved.chunks = [_chunk((0,) * len(saved.size), tuple(-n for n in saved.size))]


def _past_the_end(md: Any, key: str) -> None:
    saved = md.state_dict_metadata[key]
    rows, *rest = saved.size
    saved.chunks = [_chunk((rows // 2, *[0] * len(rest)), tuple(saved.size))]
    info = md.storage_data.pop(MetadataIndex(key, torch.Size((0,) * len(saved.size))))
    md.storage_data[MetadataIndex(key, torch.Size((rows // 2, *[0] * len(rest))))] = info


def _a_million_references(md: Any, key: str) -> None:
    saved = md.state_dict_metadata[key]
    saved.chunks = saved.chunks * 100_000  # a few MB of .metadata naming one record again and again


def _two_tensors_one_record(md: Any, key: str) -> None:
    other = TABLE if key == WEIGHT else WEIGHT
    mine = next(i for idx, i in md.storage_data.items() if idx.fqn == key)
    theirs = next(idx for idx in md.storage_data if idx.fqn == other)
    if md.state_dict_metadata[other].size == md.state_dict_metadata[key].size:
        md.storage_data[theirs] = copy.copy(mine)
    else:  # the other tensor's record moved onto this one's bytes (lengths as recorded)
        moved = copy.copy(md.storage_data[theirs])
        moved.relative_path, moved.offset = mine.relative_path, mine.offset
        md.storage_data[theirs] = moved


FORGERIES: dict[str, Callable[[Any, str], None]] = {
    "no chunks": _no_chunks,
    "half the rows": _half_the_rows,
    "negative sizes": _negative_size,
    "past the end": _past_the_end,
    "a million references": _a_million_references,
    "two tensors on one record": _two_tensors_one_record,
}


# the forgeries whose records the manifest's storage entries can say too (moved or dropped records); the others
# (chunk lists, which the manifest derives from the inventory) stay in .metadata, which loads do not read
MIRRORED = {"past the end", "two tensors on one record"}


def forge(path: Path, fn: Callable[[Any, str], None], key: str) -> bool:
    """Rewrite ``.metadata`` with ``fn``, mirror its records into the manifest's storage entries where they can say
    the same, then reseal: the files' sizes and CRC-32s, and the manifest's own seal. ``True``: the manifest's
    entries changed too (else only ``.metadata`` is forged)."""
    return forging.forge_metadata(path, lambda md: fn(md, key))


def _at(kind: str, forged: Path, tmp_path: Path) -> str:
    if kind == "directory":
        return str(forged)
    if kind == "archive":
        return str(tdcp.to_archive(forged, tmp_path / "forged.zip"))  # the archive keeps the resealed files
    url = f"memory://tdcp-forged/{tmp_path.name}"
    fs = fsspec.filesystem("memory")
    for p in forged.iterdir():
        fs.pipe_file(f"/tdcp-forged/{tmp_path.name}/{p.name}", p.read_bytes())
    return url


def refused_by_verify_and_load(
    where: str | Path, error: type | tuple[type, ...], verify_match: str, load_match: str
) -> None:
    """``verify`` refuses ``where``; ``load`` refuses it too, and the live objects are bit-for-bit unchanged."""
    with pytest.raises(error, match=verify_match):
        tdcp.verify(where)
    objs = objects(2)
    before = snapshot(objs)
    with pytest.raises(error, match=load_match):
        tdcp.DistributedCheckpoint(**objs).load(where)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(objs), before)), "a refused load changed the objects"


def loads_exactly_the_saved_state(where: str | Path) -> None:
    """A load of ``where`` (whose forged ``.metadata`` it does not read) restores exactly ``objects(1)``."""
    objs = objects(2)
    tdcp.DistributedCheckpoint(**objs).load(where)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(objs), snapshot(objects(1)))), "the load is not exact"
    assert objs["stats"]["n"] == 1


def refused_by_verify_loaded_exactly(where: str | Path, error: type, verify_match: str) -> None:
    """Only ``.metadata`` is forged: ``verify`` refuses it naming it; a load (which reads the manifest's storage
    entries, never ``.metadata``) restores exactly the saved state."""
    with pytest.raises(error, match=verify_match):
        tdcp.verify(where)
    loads_exactly_the_saved_state(where)


def test_the_control_loads_exactly(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    objs = objects(2)
    tdcp.DistributedCheckpoint(**objs).load(path)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(objs), snapshot(objects(1))))


@pytest.mark.parametrize("kind", ["directory", "archive", "store"])
@pytest.mark.parametrize("key", [WEIGHT, TABLE])
@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_forged_chunk_lists_are_refused_and_nothing_changes(tmp_path: Path, case: str, key: str, kind: str) -> None:
    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    mirrored = forge(path, FORGERIES[case], key)
    assert mirrored == (case in MIRRORED), "the forgery reached the manifest's storage entries other than expected"
    where = _at(kind, path, tmp_path)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"\.metadata.*forged"):  # what a plain dcp.load reads
        open_source(where).saved_dcp_metadata()
    if mirrored:  # the manifest's own entries are forged (a structure error there is a CheckpointFormatError)
        refused_by_verify_and_load(
            where,
            (tdcp.CheckpointIntegrityError, tdcp.CheckpointFormatError),
            r"manifest's storage entries.*forged",
            r"manifest's storage entries.*forged",
        )
    else:
        refused_by_verify_loaded_exactly(where, tdcp.CheckpointIntegrityError, r"\.metadata.*forged")


def test_a_record_far_longer_than_its_tensor_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A record claiming far more bytes than its tensor (a data file grown by a sparse hole before its trailer, the
    entries and every checksum resealed) was read whole into memory before it was found undecodable: a 1 GiB hole
    for a 48-byte tensor took 1 GiB of memory. Records hold their tensor's bytes and at most ``RECORD_SLACK`` more."""
    from torchrl_dcp.format.layout import TRAILER_SIZE
    from torchrl_dcp.format.metadata_checks import RECORD_SLACK

    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    md = safe_load_metadata(path / ".metadata")
    index, info = max(md.storage_data.items(), key=lambda item: item[1].offset)  # a file's last record: it grows
    assert sum(v.relative_path == info.relative_path for v in md.storage_data.values()) == len(md.storage_data)
    data = (path / info.relative_path).read_bytes()
    grown = RECORD_SLACK + 4096
    (path / info.relative_path).write_bytes(data[:-TRAILER_SIZE] + bytes(grown) + data[-TRAILER_SIZE:])

    def longer(md: Any) -> None:
        md.storage_data[index].length += grown

    forging.forge_metadata(path, longer)
    forging.reseal(path, info.relative_path)
    refused_by_verify_and_load(
        path,
        tdcp.CheckpointIntegrityError,
        r"more than any record of them",
        r"more than any record of them",
    )


def _deflated_record(tensor: torch.Tensor) -> bytes:
    """``torch.save`` of ``tensor`` with every ZIP member DEFLATED (a record torch.save never writes)."""
    import io
    import zipfile

    plain = io.BytesIO()
    torch.save(tensor, plain)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


@pytest.mark.parametrize("kind", ["directory", "archive", "store"])
def test_a_compressed_record_is_refused_before_torch_load(tmp_path: Path, kind: str) -> None:
    """A record whose members are DEFLATED (a decompression bomb in the making) never reaches ``torch.load``."""
    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    md = safe_load_metadata(path / ".metadata")
    index = next(i for i in md.storage_data if i.fqn == TABLE)
    info = md.storage_data[index]
    data = (path / info.relative_path).read_bytes()
    record = _deflated_record(torch.full((64, 4), 7.0))
    (path / info.relative_path).write_bytes(data[:-64] + record + data[-64:])  # the identity trailer stays last
    moved = copy.copy(info)
    moved.offset, moved.length = len(data) - 64, len(record)
    md.storage_data[index] = moved
    assert forging.write_metadata(path, md), "the moved record is not in the manifest's storage entries"
    forging.reseal(path, info.relative_path)
    refused_by_verify_and_load(
        _at(kind, path, tmp_path), tdcp.CheckpointIntegrityError, "STORED|compressed", "compressed"
    )


def test_a_skeleton_naming_the_meta_device_is_refused(tmp_path: Path) -> None:
    """``"device": "meta"`` in a resealed skeleton would load a tensor without data: refused by load and verify."""
    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")

    def to_meta(manifest: dict[str, Any]) -> None:
        text = json.dumps(manifest["components"]["stats"]["state"])
        assert '"device": "cpu"' in text
        manifest["components"]["stats"]["state"] = json.loads(text.replace('"device": "cpu"', '"device": "meta"'))

    forging.edit(path, to_meta)
    refused_by_verify_and_load(path, tdcp.CheckpointFormatError, "meta device", "meta device")
    with pytest.raises(tdcp.EncodingError, match="meta device"):
        tdcp.DistributedCheckpoint(w={"x": torch.empty(3, device="meta")}).save(tmp_path / "m")


@pytest.mark.parametrize("field", ["state_dict_metadata", "storage_data"])
def test_metadata_with_containers_of_the_wrong_types_is_a_checkpoint_error(tmp_path: Path, field: str) -> None:
    """A list where DCP writes a dict: ``verify`` says so naming ``.metadata`` (no AttributeError escapes); the
    manifest's entries cannot say it, so a load (which never reads ``.metadata``) restores the saved state."""
    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    assert not forge(path, lambda md, key: setattr(md, field, list(getattr(md, field).items())), WEIGHT)
    refused_by_verify_loaded_exactly(path, tdcp.CheckpointFormatError, r"\.metadata.*wrong types")


def test_a_reference_with_another_shape_than_the_tensor_it_names_is_refused(tmp_path: Path) -> None:
    """A shared tensor (stored once, referenced as ``xref``) whose reference declares another shape: refused."""
    policy = torch.nn.Linear(16, 8)
    path = tdcp.DistributedCheckpoint(policy=policy, head={"w": policy.weight}).save(tmp_path / "c")

    def reshape(manifest: dict[str, Any]) -> None:
        text = json.dumps(manifest["components"]["head"]["state"])
        assert '"t": "xref"' in text and '"shape": [8, 16]' in text
        manifest["components"]["head"]["state"] = json.loads(text.replace('"shape": [8, 16]', '"shape": [16, 8]'))

    forging.edit(path, reshape)
    with pytest.raises(tdcp.CheckpointError, match="refers to"):
        tdcp.verify(path)
    fresh = torch.nn.Linear(16, 8)
    before = fresh.weight.detach().clone()
    with pytest.raises(tdcp.CheckpointError, match="refers to|inconsistent or forged"):
        tdcp.DistributedCheckpoint(policy=fresh, head={"w": torch.zeros(8, 16)}).load(path)
    assert torch.equal(fresh.weight, before)


@pytest.mark.parametrize("kind", ["directory", "archive", "store"])
@pytest.mark.parametrize("into", ["live", "fresh"])
def test_a_bool_byte_other_than_0_or_1_is_refused_before_anything_changes(tmp_path: Path, kind: str, into: str) -> None:
    """``torch.save`` writes bools as 0 or 1; a forged 2 (resealed) makes a value that is neither, so the record
    is refused (naming its file) before the module, read in place, changes; ``verify`` refuses it too. Read into a
    live tensor (a module's buffer: checked before any read) or into a fresh buffer (a dict's tensor: checked as it
    is read, before anything is restored), from every backend."""
    from torchrl_dcp.format.record import record_data_offset

    def with_flags(seed: int, flags: torch.Tensor) -> dict[str, Any]:
        objs = objects(seed)
        if into == "live":
            objs["flags"] = torch.nn.Module()
            objs["flags"].register_buffer("done", flags)
        else:
            objs["flags"] = {"done": flags}
        return objs

    path = tdcp.DistributedCheckpoint(**with_flags(0, torch.tensor([True, False, True, False] * 4))).save(
        tmp_path / "c"
    )
    key = "replicated/flags/done"
    md = safe_load_metadata(path / ".metadata")
    (info,) = [s for i, s in md.storage_data.items() if i.fqn == key]
    data = bytearray((path / info.relative_path).read_bytes())
    record = bytes(data[info.offset : info.offset + info.length])
    at = record_data_offset(lambda o, n: record[o : o + n], record, info.length, torch.bool, (16,))
    assert at is not None
    data[info.offset + at] = 2
    (path / info.relative_path).write_bytes(bytes(data))
    forging.reseal(path, info.relative_path)
    where = _at(kind, path, tmp_path)
    live = with_flags(1, torch.zeros(16, dtype=torch.bool))
    flags = live["flags"].done if into == "live" else live["flags"]["done"]
    before = [*snapshot(live), flags.clone()]
    with pytest.raises(tdcp.CheckpointError, match="bool") as err:
        tdcp.DistributedCheckpoint(**live).load(where)
    assert info.relative_path in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, [*snapshot(live), flags]))
    with pytest.raises(tdcp.CheckpointError, match="bool"):
        tdcp.verify(where)


def test_a_decoded_bool_record_with_other_bytes_is_refused() -> None:
    """The same for a record decoded by ``torch.load`` (not our writer's layout)."""
    from torchrl_dcp.format.record import decode_record

    flags = torch.tensor([True, False, True])
    flags.view(torch.uint8)[1] = 7
    buf = io.BytesIO()
    torch.save(flags, buf)
    with pytest.raises(tdcp.CheckpointError, match="bool byte"):
        decode_record(buf.getvalue(), torch.bool, (3,), "f.distcp", "k")


@pytest.mark.parametrize("shape", [[1 << 40], [1 << 62, 1 << 62]])
def test_a_forged_inventory_shape_is_refused_by_the_tools_before_anything_is_allocated(
    tmp_path: Path, shape: list[int]
) -> None:
    """``iter_inventory`` (what ``diff`` reads through) allocates from the inventory: a resealed inventory claiming
    4 TiB (or more elements than an int64 counts) is refused against the bytes its storage records hold (format 5:
    DCP's metadata is built from the inventory and the manifest's storage entries), a ``CheckpointError`` naming
    the checkpoint, not a ``RuntimeError`` from the allocator."""
    from torchrl_dcp.extract import iter_inventory

    path = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "c")
    forging.edit(path, lambda m: m["components"]["stats"]["inventory"][TABLE].__setitem__("shape", shape))
    with pytest.raises(tdcp.CheckpointError, match=r"claims \d+ bytes but its records hold \d+") as err:
        list(iter_inventory(path, "stats"))
    assert str(path) in str(err.value)


# ---------------------------------------------------------------------- the tools read as verify does
def _cli(*args: str) -> tuple[int, str]:
    import contextlib

    from torchrl_dcp.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


@pytest.mark.parametrize("kind", ["directory", "archive", "memory"])
@pytest.mark.parametrize(
    "forgery", ["another-saves-file", "state-dtype", "unused-file-without-identity", "flipped-byte"]
)
def test_diff_and_verify_refuse_what_a_load_refuses(tmp_path: Path, kind: str, forgery: str) -> None:
    """``diff`` read tensors through a path of its own, which skipped the save identity and the state checks a load
    and ``verify`` run: a data file copied in from another save (resealed) was "identical" to that save, a forged
    state merely "different", a damaged object printed DCP's traceback; ``verify`` passed a listed data file without
    identity. Now ``diff`` checks what ``verify`` checks before reading (exit 2, one line naming the file),
    ``verify`` every listed data file, and ``to_archive`` packs no file of another save."""
    a = tdcp.DistributedCheckpoint(**objects(0)).save(tmp_path / "a")
    b = tdcp.DistributedCheckpoint(**objects(1)).save(tmp_path / "b")
    forged = tmp_path / "forged"
    import shutil

    shutil.copytree(a, forged)
    if forgery == "another-saves-file":
        shutil.copy(b / "__0_shared.distcp", forged / "__0_shared.distcp")
        forging.reseal(forged, "__0_shared.distcp")
        named = "__0_shared.distcp"
    elif forgery == "state-dtype":  # the state says float64 where the inventory (and the file) say float32
        forging.edit(
            forged, lambda m: forging.tensor_node(m["components"]["policy"]["state"], "bias").update(dtype="float64")
        )
        named = "manifest.json"
    elif forgery == "flipped-byte":  # damage, not resealed: diff on an object store printed DCP's traceback
        if kind == "archive":
            pytest.skip("to_archive packs only files that pass their checksums")
        data = bytearray((forged / "__0_shared.distcp").read_bytes())
        data[200] ^= 0xFF
        (forged / "__0_shared.distcp").write_bytes(bytes(data))
        named = "__0_shared.distcp"
    else:
        (forged / "__0_7.distcp").write_bytes(b"x" * 100)
        forging.reseal(forged, "__0_7.distcp")
        named = "__0_7.distcp"
    if kind == "archive" and forgery in ("another-saves-file", "unused-file-without-identity"):
        with pytest.raises(tdcp.CheckpointIntegrityError, match=f"{named}: data file carries"):
            tdcp.to_archive(forged, tmp_path / "forged.zip")  # a conversion checks identities too: packs nothing
        assert not (tmp_path / "forged.zip").exists()
        return
    where = _at(kind, forged, tmp_path)
    if forgery != "unused-file-without-identity":
        code, err = _cli("diff", where, str(b))
        assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(tdcp.CheckpointError, match=named if forgery != "state-dtype" else "inventory disagrees"):
        tdcp.verify(where)


def test_a_record_whose_pickle_is_refused_says_so_in_one_line_without_torchs_advice() -> None:
    """A record holding an object torch's weights-only unpickler refuses: the error quoted torch's six lines, among
    them its advice to re-run ``torch.load`` with ``weights_only=False``, the one thing never to do with a damaged
    or forged file."""
    from fractions import Fraction

    from torchrl_dcp.format.record import decode_record

    buf = io.BytesIO()
    torch.save(Fraction(1, 2), buf)
    with pytest.raises(tdcp.CheckpointIntegrityError) as caught:
        decode_record(buf.getvalue(), torch.float32, (1,), "f.distcp", "k")
    said = str(caught.value)
    assert "\n" not in said and "Re-running" not in said, said
    assert "cannot be decoded (UnpicklingError)" in said and "never load it with torch.load(weights_only=False)" in said


def _rewrite_record(path: Path, key: str, members: Callable[[str, bytes], list[tuple[str, bytes]]]) -> None:
    """Rewrite the ``torch.save`` record of ``key`` with ``members(name, bytes)`` per member, everything resealed."""
    import io
    import zipfile

    from torchrl_dcp.storage.filesums import file_checksum

    m = forging.read_parts(path)
    entry = next(e for e in m["index"]["entries"] if e[0] == key)
    data = (path / entry[1]).read_bytes()
    record = zipfile.ZipFile(io.BytesIO(data[entry[2] : entry[2] + entry[3]]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in record.infolist():
            for name, blob in members(info.filename, record.read(info.filename)):
                z.writestr(zipfile.ZipInfo(name), blob)
    new = out.getvalue()
    (path / entry[1]).write_bytes(data[: entry[2]] + new + data[entry[2] + entry[3] :])
    entry[3] = len(new)
    m["files"][entry[1]] = {"size": (path / entry[1]).stat().st_size, "checksum": file_checksum(path / entry[1])}
    assert forging.mirror_into_metadata(path, m)
    forging.write_parts(path, m)


def test_a_record_with_a_second_copy_of_its_bytes_loads_what_dcp_loads_and_one_in_two_folders_is_refused(
    tmp_path: Path,
) -> None:
    """A record holding ``archive/data/0`` and ``archive/x/data/0`` (resealed): the record check took the last
    member of each short name, so a load restored the second copy where ``torch.load`` and ``dcp.load`` read the
    first; members in two folders passed too (which ``torch.load`` refuses)."""
    key = "replicated/cfg/u"
    path = tdcp.DistributedCheckpoint(no_dist=True, cfg={"u": torch.zeros(3)}).save(tmp_path / "c")
    ones, twos = torch.full((3,), 1.0).numpy().tobytes(), torch.full((3,), 2.0).numpy().tobytes()

    def second_copy(name: str, blob: bytes) -> list[tuple[str, bytes]]:
        return (
            [(name, ones), (name.replace("data/0", "x/data/0"), twos)] if name.endswith("/data/0") else [(name, blob)]
        )

    _rewrite_record(path, key, second_copy)
    live = {"u": torch.zeros(3)}
    tdcp.DistributedCheckpoint(no_dist=True, cfg=live).load(path)
    by_dcp = {key: torch.zeros(3)}
    dcp.load(by_dcp, checkpoint_id=str(path))
    assert torch.equal(live["u"], by_dcp[key]) and torch.equal(live["u"], torch.ones(3))

    path = tdcp.DistributedCheckpoint(no_dist=True, cfg={"u": torch.zeros(3)}).save(tmp_path / "d")
    _rewrite_record(
        path, key, lambda name, blob: [("evil/" + name.split("/", 1)[1] if "data.pkl" in name else name, blob)]
    )
    for attempt in (lambda: tdcp.verify(path), lambda: tdcp.DistributedCheckpoint(no_dist=True, cfg=live).load(path)):
        with pytest.raises(tdcp.CheckpointError):
            attempt()


def test_a_record_of_a_parameter_is_refused_saying_so(tmp_path: Path) -> None:
    """The refusal read "holds torch.float32 [3], the manifest and DCP's metadata say torch.float32 [3]": no
    difference named (the record is of an ``nn.Parameter``, which no save writes)."""
    from torchrl_dcp.storage.filesums import file_checksum

    path = tdcp.DistributedCheckpoint(no_dist=True, cfg={"u": torch.zeros(3)}).save(tmp_path / "c")
    m = forging.read_parts(path)
    entry = next(e for e in m["index"]["entries"] if e[0] == "replicated/cfg/u")
    data, buf = (path / entry[1]).read_bytes(), io.BytesIO()
    torch.save(torch.nn.Parameter(torch.full((3,), 5.0)), buf)
    (path / entry[1]).write_bytes(data[: entry[2]] + buf.getvalue() + data[entry[2] + entry[3] :])
    entry[3] = len(buf.getvalue())
    m["files"][entry[1]] = {"size": (path / entry[1]).stat().st_size, "checksum": file_checksum(path / entry[1])}
    assert forging.mirror_into_metadata(path, m)
    forging.write_parts(path, m)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"holds a Parameter \(torch.float32 \[3\]\), not a plain"):
        tdcp.verify(path)
