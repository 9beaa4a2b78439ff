"""Format 5: per-rank manifest shards, storage entries in the manifest, ``.metadata`` spliced from every rank's part.

Multi-rank behaviour (each rank writes and reads its own shard) is in ``tests_distributed/test_exchanges.py``;
these are the single-process guarantees: the layout, that a load never parses ``.metadata``, that the spliced
``.metadata`` is what a plain ``dcp.load`` reads, and that shards are checked against their root.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import torchrl_dcp as tdcp
import torchrl_dcp.storage.source as source_module
from tests import forging
from torchrl_dcp.format import rank_table
from torchrl_dcp.format.dcp_metadata import metadata_fragments, parse_metadata, spliced_metadata
from torchrl_dcp.format.layout import shard_name, shard_rank
from torchrl_dcp.format.shards import record_shards
from torchrl_dcp.storage.writer import build_metadata


def _save(path: Path, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    objs = {
        "policy": {"w": torch.randn(4, 3, generator=g)},
        "stats": {"x": torch.randn(5, generator=g), "n": seed},
    }
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"])
    ckpt.register("stats", objs["stats"], placement="per_rank")
    return ckpt.save(path, step=seed), objs


def _load(path: Any) -> dict[str, Any]:
    objs = {"policy": {"w": torch.zeros(4, 3)}, "stats": {"x": torch.zeros(5), "n": -1}}
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"])
    ckpt.register("stats", objs["stats"], placement="per_rank")
    ckpt.load(path)
    return objs


def test_per_rank_state_is_in_the_rank_s_shard_and_readers_see_it_assembled(tmp_path: Path) -> None:
    path, _ = _save(tmp_path / "c")
    root = json.loads((path / "manifest.json").read_text())
    shard = json.loads((path / shard_name(0)).read_text())
    assert root["format_version"] == 8 and root["sharded"] is True
    assert set(root["components"]["stats"]) == {"adapter", "adapter_version", "placement", "num_tensors", "nbytes"}
    assert "state" in root["components"]["policy"] and "inventory" in root["components"]["policy"]
    assert [e[0] for e in root["index"]["entries"]] == ["replicated/policy/w"]
    assert shard["rank"] == 0 and shard["save_id"] == root["save_id"]
    assert list(shard["components"]["stats"]["inventory"]) == ["rank/0/stats/x"]
    assert [e[0] for e in shard["entries"]] == ["rank/0/stats/x"]
    assert (
        shard_name(0) not in root["files"]
        and rank_table.shard_record(root, 0)["size"] == (path / shard_name(0)).stat().st_size
    )
    m = tdcp.read_manifest(path)  # what tools see: the format-4 shape
    assert m["components"]["stats"]["ranks"]["0"]["state"] == shard["components"]["stats"]["state"]
    assert sorted(m["components"]["stats"]["inventory"]) == ["rank/0/stats/x"]
    assert sorted(e[0] for e in m["index"]["entries"]) == ["rank/0/stats/x", "replicated/policy/w"]
    assert m["shards_read"] == [0]


def test_a_save_of_replicated_state_only_writes_no_shard(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}).save(tmp_path / "c")
    root = json.loads((path / "manifest.json").read_text())
    assert root["sharded"] is False and not list(path.glob("manifest-*.json"))
    assert tdcp.read_manifest(path)["shards_read"] is None


def test_a_load_never_parses_the_metadata_file_and_verify_does(tmp_path: Path, monkeypatch: Any) -> None:
    path, saved = _save(tmp_path / "c", seed=3)
    parsed: list[str] = []
    original = source_module.parse_metadata

    def counting(data: bytes, where: Any) -> Any:
        parsed.append(str(where))
        return original(data, where)

    monkeypatch.setattr(source_module, "parse_metadata", counting)
    loaded = _load(path)
    assert parsed == []
    assert torch.equal(loaded["policy"]["w"], saved["policy"]["w"]) and torch.equal(
        loaded["stats"]["x"], saved["stats"]["x"]
    )
    assert loaded["stats"]["n"] == 3
    tdcp.verify(path)
    assert parsed and parsed[0].endswith(".metadata")


def test_the_spliced_metadata_is_what_plain_dcp_load_reads(tmp_path: Path) -> None:
    """The ``.metadata`` rank 0 concatenates from every rank's pickled part loads as one ``Metadata`` holding every
    key, and a plain ``dcp.load`` reads every tensor back exactly."""
    path, saved = _save(tmp_path / "c", seed=5)
    state = {"replicated/policy/w": torch.empty(4, 3), "rank/0/stats/x": torch.empty(5)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(state["replicated/policy/w"], saved["policy"]["w"])
    assert torch.equal(state["rank/0/stats/x"], saved["stats"]["x"])


def test_splicing_gives_the_metadata_pickle_would_give() -> None:
    """Fragments pickled by several processes, each with its own memo, concatenate into one valid pickle."""
    parts = []
    for r in range(3):
        tensors = {f"rank/{r}/s/{i}": (torch.float32, (i + 1, 2)) for i in range(1200)}  # > one SETITEMS batch
        entries = [(k, f"__{r}_0.distcp", 100 * i, 90) for i, k in enumerate(tensors)]
        parts.append(build_metadata(tensors, entries, "c", "0" * 32))
    shared = build_metadata(
        {"replicated/p": (torch.int64, (3,))}, [("replicated/p", "__0_0.distcp", 0, 10)], "c", "0" * 32
    )
    data = spliced_metadata(shared, [metadata_fragments(p) for p in parts])
    whole = parse_metadata(data, "spliced")  # the allow-list unpickler
    plain = pickle.loads(data)
    assert isinstance(whole, Metadata) and whole.storage_meta.save_id == "0" * 32
    expected_state = {**shared.state_dict_metadata, **{k: v for p in parts for k, v in p.state_dict_metadata.items()}}
    expected_storage = {**shared.storage_data, **{k: v for p in parts for k, v in p.storage_data.items()}}
    for md in (whole, plain):
        assert md.state_dict_metadata == expected_state
        assert md.storage_data == expected_storage


def test_a_shard_of_another_save_is_refused_naming_it(tmp_path: Path) -> None:
    path, _ = _save(tmp_path / "c", seed=1)
    other, _ = _save(tmp_path / "o", seed=2)
    shutil.copyfile(other / shard_name(0), path / shard_name(0))
    _record_only(path, shard_name(0))
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"manifest-0\.json.*|another save"):
        _load(path)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="another save"):
        tdcp.verify(path)


def _record_only(path: Path, name: str) -> None:
    """Record ``name``'s size and CRC-32 in the root, reseal the root, leave every shard as it is on disk."""
    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.storage.filesums import file_checksum

    root = json.loads((path / "manifest.json").read_text())
    record = {"size": (path / name).stat().st_size, "checksum": file_checksum(path / name)}
    if shard_rank(name) is not None:  # (format 8: in the root's rank table)
        record_shards(root, {shard_rank(name): record})
    else:
        root["files"][name] = record
    (path / "manifest.json").write_bytes(dumps(seal(root)))


@pytest.mark.parametrize("key", ["replicated/policy/w", "rank/1/stats/x"])
def test_a_shard_may_place_only_its_own_tensors(tmp_path: Path, key: str) -> None:
    """A resealed shard with an entry for a tensor it does not hold (a replicated one, another rank's) is refused."""
    path, _ = _save(tmp_path / "c")
    shard = json.loads((path / shard_name(0)).read_text())
    shard["entries"].append([key, "__0_0.distcp", 0, 8])
    from torchrl_dcp.format.manifest import dumps

    (path / shard_name(0)).write_bytes(dumps(shard))
    _record_only(path, shard_name(0))
    for action in (lambda: _load(path), lambda: tdcp.verify(path)):
        with pytest.raises(tdcp.CheckpointFormatError, match=rf"manifest-0\.json.*{key}|{key}.*does not hold"):
            action()


def test_a_forged_index_that_reseals_everything_but_metadata_is_refused_by_verify(tmp_path: Path) -> None:
    """Entries moved in the manifest alone (``.metadata`` left as saved): the load reads what the manifest says (here
    a record of the same shape: the other tensor's bytes), verify refuses because ``.metadata`` places it elsewhere."""
    path, saved = _save(tmp_path / "c", seed=7)
    m = forging.read_parts(path)
    entries = {e[0]: e for e in m["index"]["entries"]}
    w, x = entries["replicated/policy/w"], entries["rank/0/stats/x"]
    x[1], x[2], x[3] = (
        w[1],
        w[2],
        w[3],
    )  # x's entry now points at w's record (another shape: refused by the record check)
    forging.write_parts(path, m)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="rank/0/stats/x"):
        _load(path)
    with pytest.raises(tdcp.CheckpointError):
        tdcp.verify(path)


def test_a_damaged_shard_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path, _ = _save(tmp_path / "c")
    data = bytearray((path / shard_name(0)).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / shard_name(0)).write_bytes(bytes(data))
    for action in (lambda: _load(path), lambda: tdcp.verify(path)):
        with pytest.raises(tdcp.CheckpointIntegrityError, match=r"manifest-0\.json"):
            action()


def test_a_sharded_root_lists_one_shard_per_saved_rank(tmp_path: Path) -> None:
    """A resealed root claiming a world of a billion ranks is refused at once (readers iterate the listed shards,
    never ``range(world_size)`` of a forged number)."""
    from torchrl_dcp.format.manifest import dumps, seal

    path, _ = _save(tmp_path / "c")
    root = json.loads((path / "manifest.json").read_text())
    root["world_size"] = 10**9
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    for action in (lambda: _load(path), lambda: tdcp.verify(path), lambda: tdcp.read_manifest(path)):
        with pytest.raises(tdcp.CheckpointFormatError, match="one shard per saved rank"):
            action()


# ---------------------------------------------------------------------- format 7: a rank's own files in its shard
def _save_own_files(path: Path, monkeypatch: Any, rows: int = 32) -> tuple[Path, dict[str, Any]]:
    """A replicated policy and a per-rank buffer cut into chunk files of 4 KiB (its own files: ``__0_0.distcp`` and
    the chunk files of ``rank/0/buf/rows``)."""
    from torchrl_dcp import chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    g = torch.Generator().manual_seed(rows)
    objs = {
        "policy": {"w": torch.randn(4, 3, generator=g)},
        "buf": {"rows": torch.randn(rows, 64, generator=g), "seen": torch.randn(3, generator=g)},
    }
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"])
    ckpt.register("buf", objs["buf"], placement="per_rank")
    return ckpt.save(path, step=1), objs


def _load_own_files(path: Path, rows: int = 32) -> dict[str, Any]:
    objs = {"policy": {"w": torch.zeros(4, 3)}, "buf": {"rows": torch.zeros(rows, 64), "seen": torch.zeros(3)}}
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"])
    ckpt.register("buf", objs["buf"], placement="per_rank")
    ckpt.load(path)
    return objs


def test_a_rank_s_own_files_are_listed_in_its_shard_and_only_counted_in_the_root(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The root lists what more than one rank reads (shared files, ``.metadata``; the shards in its rank table) and
    counts each rank's own files: it does not grow with the chunk files a rank writes for its per-rank state (every rank parses the root)."""
    roots = []
    for rows in (32, 128):  # 2 and 8 chunk files of the per-rank buffer
        path, saved = _save_own_files(tmp_path / f"c{rows}", monkeypatch, rows)
        root = json.loads((path / "manifest.json").read_text())
        shard = json.loads((path / shard_name(0)).read_text())
        own = sorted(shard["files"])
        chunk_files = sorted({c["file"] for c in shard["chunks"]["rank/0/buf/rows"]})
        assert own == sorted(["__0_0.distcp", *chunk_files]) and len(chunk_files) == rows // 16
        assert not set(own) & set(root["files"]) and "__0_shared.distcp" in root["files"]
        assert rank_table.own_files(root, 0) == (len(own), sum((path / n).stat().st_size for n in own))
        assert shard["format_version"] == 7
        loaded = _load_own_files(path, rows)
        assert all(torch.equal(loaded["buf"][k], saved["buf"][k]) for k in ("rows", "seen"))
        assert torch.equal(loaded["policy"]["w"], saved["policy"]["w"])
        assert tdcp.verify(path)["files"] == len(own) + len(root["files"]) + 1  # (+ the shard)
        assert sorted(tdcp.read_manifest(path)["files"]) == sorted([*own, *root["files"], shard_name(0)])
        roots.append(root)
    assert sorted(roots[0]["files"]) == sorted(roots[1]["files"])


@pytest.mark.parametrize("change", ["extra", "removed", "truncated", "directory", "link"])
def test_a_rank_s_own_files_altered_on_disk_are_refused(tmp_path: Path, monkeypatch: Any, change: str) -> None:
    path, _ = _save_own_files(tmp_path / "c", monkeypatch)
    own = sorted(json.loads((path / shard_name(0)).read_text())["files"])
    chunk = own[-1]
    if change == "extra":
        (path / "__0_9.distcp").write_bytes(b"x" * 16)
    elif change == "removed":
        (path / chunk).unlink()
    elif change == "truncated":
        os.truncate(path / chunk, (path / chunk).stat().st_size - 1)
    elif change == "directory":
        (path / "__0_9.distcp").mkdir()
    else:
        (path / "__0_9.distcp").symlink_to(path / chunk)
    named = chunk if change in ("removed", "truncated") else "__0_9.distcp"
    for action in (
        lambda: _load_own_files(path),
        lambda: tdcp.verify(path),
        lambda: tdcp.to_archive(path, tmp_path / "a.zip"),
    ):
        with pytest.raises(tdcp.CheckpointIntegrityError, match=re.escape(named)):
            action()


@pytest.mark.parametrize("forgery", ["shared file", "another rank's file", "not counted", "root lists it too"])
def test_a_resealed_shard_may_list_only_its_rank_s_own_files_as_the_root_counts_them(
    tmp_path: Path, monkeypatch: Any, forgery: str
) -> None:
    """A forger who rewrites a shard's ``files`` and reseals the shard's record (and the root) is refused: a shard
    lists only ``__<rank>_<n>.distcp`` files the root does not list, exactly as many bytes as its rank table row
    says."""
    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.storage.filesums import file_checksum

    path, _ = _save_own_files(tmp_path / "c", monkeypatch)
    root = json.loads((path / "manifest.json").read_text())
    shard = json.loads((path / shard_name(0)).read_text())
    if forgery == "shared file":
        shard["files"]["__0_shared.distcp"] = root["files"]["__0_shared.distcp"]
    elif forgery == "another rank's file":
        shard["files"]["__1_0.distcp"] = shard["files"].pop("__0_0.distcp")
    elif forgery != "not counted":
        root["files"]["__0_0.distcp"] = shard["files"]["__0_0.distcp"]
    (path / shard_name(0)).write_bytes(dumps(shard))
    row = rank_table.rows(root)[0]
    root["rank_table"] = rank_table.rank_table(
        [
            row._replace(
                shard_size=(path / shard_name(0)).stat().st_size,
                shard_crc=int(file_checksum(path / shard_name(0)).split(":")[1], 16),
                own_bytes=row.own_bytes + (forgery == "not counted"),
            )
        ]
    )
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    says = "damaged or altered" if forgery == "not counted" else "may only list this rank's own"
    for action in (lambda: _load_own_files(path), lambda: tdcp.verify(path), lambda: tdcp.read_manifest(path)):
        with pytest.raises(tdcp.CheckpointError, match=rf"manifest-0\.json.*{says}"):
            action()


@pytest.mark.parametrize("listed", ["a file outside", "a file of the root", "junk"])
def test_a_version_5_shard_listing_files_is_refused_by_every_reader(tmp_path: Path, listed: str) -> None:
    """Probe m4: a root resealed with a version-5 rank table (a migrated format 5/6 checkpoint's: the root lists every
    file) over a shard that kept a ``files`` table: nothing checked it, and readers took it in. ``verify`` read and
    counted ``../../secret.txt`` outside the checkpoint, ``to_archive`` wrote it as a member that unpacks outside
    (and ``{"x": 5}`` crashed ``verify`` with a TypeError); a 1-rank load accepted a planted file it listed."""
    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.storage.filesums import file_checksum

    secret = tmp_path / "secret.txt"
    secret.write_text("outside the checkpoint")
    path = tmp_path / "sub" / "c"
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2))
    ckpt.register("mine", {"x": torch.ones(3)}, placement="per_rank")
    ckpt.save(path, step=1)
    root = json.loads((path / "manifest.json").read_text())
    shard = json.loads((path / shard_name(0)).read_text())
    root["files"].update(shard.pop("files"))
    shard["format_version"] = 5
    shard["files"] = {
        "a file outside": {"../../secret.txt": {"size": secret.stat().st_size, "checksum": file_checksum(secret)}},
        "a file of the root": {"__0_shared.distcp": root["files"]["__0_shared.distcp"]},
        "junk": {"x": 5},
    }[listed]
    (path / shard_name(0)).write_bytes(dumps(shard))
    crc = int(file_checksum(path / shard_name(0)).split(":")[1], 16)
    root["rank_table"] = rank_table.rank_table(
        [rank_table.RankRow((path / shard_name(0)).stat().st_size, crc, 0, 0)], 5
    )
    root.pop("manifest_checksum")
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    for action in (
        lambda: tdcp.verify(path),
        lambda: tdcp.to_archive(path, tmp_path / "c.zip"),
        lambda: tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2), mine={"x": torch.zeros(3)}).load(
            path
        ),
    ):
        with pytest.raises(tdcp.CheckpointFormatError, match=r"manifest-0\.json.*a v5 shard lists no files"):
            action()
    assert not (tmp_path / "c.zip").exists()


def test_a_sealed_manifest_naming_no_save_is_refused(tmp_path: Path) -> None:
    """Probe m4: ``save_id`` set to null in a format-8 root and shard, resealed, turned every save-identity check
    off: another save's data file copied in loaded, and ``verify`` called it a format < 3 checkpoint. Only a format 2
    checkpoint's migration names no save."""
    from torchrl_dcp.format.manifest import dumps, seal

    path = tmp_path / "c"
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2))
    ckpt.register("mine", {"x": torch.ones(3)}, placement="per_rank")
    ckpt.save(path, step=1)
    root = json.loads((path / "manifest.json").read_text())
    root["save_id"] = None
    root.pop("manifest_checksum")
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    for action in (lambda: tdcp.verify(path), lambda: ckpt.load(path), lambda: tdcp.read_manifest(path)):
        with pytest.raises(
            tdcp.CheckpointFormatError, match=r"manifest\.json.*save_id is null, which format version 8"
        ):
            action()


@pytest.mark.parametrize(
    "field,value",
    [("rank", 0.0), ("rank", False), ("format_version", 7.0), ("entries", 0), ("entries", False), ("entries", {})],
)
def test_a_shard_spelling_a_field_as_another_type_is_refused(tmp_path: Path, field: str, value) -> None:
    """Probe n5: a shard naming its rank ``0.0`` or ``false`` (or its version ``7.0``), resealed, was taken for rank
    0 (``0.0 == 0``): no save writes one. Probe t2: ``entries`` of ``0`` or ``false`` passed for no entries, then
    failed every reader with a bare ``TypeError`` (``assemble`` extends a list with it)."""
    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.storage.filesums import file_checksum

    path = tmp_path / "c"
    ckpt = tdcp.DistributedCheckpoint(no_dist=True)
    ckpt.register("mine", {"x": torch.ones(3)}, placement="per_rank")
    ckpt.save(path, step=1)
    shard = json.loads((path / shard_name(0)).read_text())
    shard[field] = value
    (path / shard_name(0)).write_bytes(dumps(shard))
    root = json.loads((path / "manifest.json").read_text())
    root.pop("manifest_checksum")
    record_shards(
        root, {0: {"size": (path / shard_name(0)).stat().st_size, "checksum": file_checksum(path / shard_name(0))}}
    )
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    forged = tmp_path / "forged.zip"  # the same files in an archive (what an archive holds: stored members)
    with zipfile.ZipFile(forged, "w", zipfile.ZIP_STORED) as z:
        for f in sorted(os.listdir(path)):
            z.write(path / f, f)
    archive, directory = tmp_path / "c.zip", tmp_path / "d"
    readers = [lambda p: tdcp.verify(p), lambda p: ckpt.load(p), lambda p: tdcp.read_manifest(p)]
    for source, action in [(s, r) for s in (path, forged) for r in readers] + [
        (path, lambda p: tdcp.to_archive(p, archive)),
        (forged, lambda p: tdcp.to_directory(p, directory)),
    ]:
        with pytest.raises(tdcp.CheckpointError, match=re.escape(shard_name(0))):
            action(source)
    assert not archive.exists() and not directory.exists()


def test_a_resealed_root_without_a_components_totals_is_refused_by_every_reader(tmp_path: Path, capsys) -> None:
    """Probe n5: ``nbytes`` removed from a replicated component, resealed: ``inspect`` raised a bare ``KeyError``
    (the command line: "error: nbytes", naming no file). Every save writes the totals (a v1's migration counts them):
    a root without them is malformed, for every reader."""
    from torchrl_dcp.cli import main
    from torchrl_dcp.format.manifest import dumps, seal

    path = tmp_path / "c"
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2))
    ckpt.save(path, step=1)
    root = json.loads((path / "manifest.json").read_text())
    root.pop("manifest_checksum")
    del root["components"]["policy"]["nbytes"]
    (path / "manifest.json").write_bytes(dumps(seal(root)))
    for action in (lambda: tdcp.verify(path), lambda: ckpt.load(path), lambda: tdcp.read_manifest(path)):
        with pytest.raises(tdcp.CheckpointFormatError, match=r"manifest\.json.*\.nbytes must be a count"):
            action()
    assert main(["inspect", str(path)]) == 1
    assert "manifest.json" in capsys.readouterr().err


def test_a_tool_that_rewrites_a_checkpoint_keeps_each_rank_s_own_files_in_its_shard(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """``split`` (what the forging tools and rewriting tools use) puts each rank's own files back into its shard,
    counted in the root, as a save writes them."""
    path, saved = _save_own_files(tmp_path / "c", monkeypatch)
    before = (json.loads((path / "manifest.json").read_text()), json.loads((path / shard_name(0)).read_text()))
    forging.write_parts(path, forging.read_parts(path))
    root, shard = json.loads((path / "manifest.json").read_text()), json.loads((path / shard_name(0)).read_text())
    assert shard["files"] == before[1]["files"] and root["rank_table"] == before[0]["rank_table"]
    assert sorted(root["files"]) == sorted(before[0]["files"])
    assert torch.equal(_load_own_files(path)["buf"]["rows"], saved["buf"]["rows"])


@pytest.mark.parametrize("chunk_file", ["__1_1.distcp", "__0_1.distcp", "__0_shared.distcp"])
def test_a_shard_s_chunks_are_in_its_own_files_or_the_root_s_never_another_rank_s(chunk_file: str) -> None:
    """Rank 1's chunk table may name its own files and the files the root lists, never rank 0's own ones (a load
    that reads every shard, after a change of world size, would otherwise accept them)."""
    from torchrl_dcp.format.shards import check_shard

    record = {"size": 10, "checksum": "crc32:00000000"}
    root = {
        "save_id": "0" * 32,
        "components": {"b": {"placement": "per_rank"}},
        "files": {"__0_shared.distcp": record},
        "index": {"entries": []},
        "world_size": 2,
        "rank_table": rank_table.rank_table([rank_table.RankRow(10, 0, 1, 10)] * 2),
    }
    chunk = {
        "start": 0,
        "rows": 4,
        "file": chunk_file,
        "offset": 0,
        "length": 10,
        "fingerprint": "crc32:00000000/adler32:00000001",
    }
    shard = {
        "format": "torchrl_dcp.shard",
        "format_version": 7,
        "save_id": "0" * 32,
        "rank": 1,
        "components": {"b": {"state": {}, "inventory": {"rank/1/b/x": {"dtype": "float32", "shape": [4]}}}},
        "chunks": {"rank/1/b/x": [chunk]},
        "entries": [],
        "files": {"__1_1.distcp": record},
    }
    if chunk_file == "__0_1.distcp":
        with pytest.raises(tdcp.CheckpointFormatError, match=r"chunk file '__0_1\.distcp' is not in 'files'"):
            check_shard(shard, root, 1, "s")
    else:
        assert check_shard(shard, root, 1, "s") is shard
