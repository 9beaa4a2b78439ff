"""The manifest checks itself: every single-bit flip of a real manifest is refused, by parse, load and verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.format import rank_table
from torchrl_dcp.format.layout import shard_name
from torchrl_dcp.format.manifest import CHECKSUM_FIELD, FORMAT_VERSION, body_checksum, loads_manifest, seal


def _objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optim = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=1e-4)
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "stats": {"episodes": seed, "lr_scale": 0.5}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tdcp.DistributedCheckpoint(**_objects(1)).save(tmp_path_factory.mktemp("m") / "c", step=7)


def test_the_seal_is_the_checksum_of_the_canonical_body(saved: Path) -> None:
    raw = json.loads((saved / "manifest.json").read_text())
    assert raw[CHECKSUM_FIELD] == body_checksum(raw) and raw["format_version"] == FORMAT_VERSION == 8
    assert len(raw["save_id"]) == 32
    assert seal(raw) == raw


def test_the_seal_covers_every_rank_shard(tmp_path: Path) -> None:
    """Format 5: per-rank states live in ``manifest-<rank>.json``, whose size and CRC-32 the sealed root records; a
    flipped value in a shard is refused by load and verify, naming the shard, the objects unchanged."""
    objs = {**_objects(1), "rng": tdcp.RNGState()}
    path = tdcp.DistributedCheckpoint(**objs).save(tmp_path / "c", step=7)
    raw = json.loads((path / "manifest.json").read_text())
    shard = path / shard_name(0)
    assert raw["sharded"] is True and raw[CHECKSUM_FIELD] == body_checksum(raw)
    assert rank_table.shard_record(raw, 0)["size"] == shard.stat().st_size
    data = bytearray(shard.read_bytes())
    at = data.index(b'["pos",') + len(b'["pos",')
    data[at] ^= 0x01  # the numpy generator's position: still valid JSON, another state
    shard.write_bytes(bytes(data))
    target = _objects(2)
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    with pytest.raises(tdcp.CheckpointIntegrityError, match=shard.name):
        tdcp.DistributedCheckpoint(**target, rng=tdcp.RNGState()).load(path)
    assert all(torch.equal(before[k], v) for k, v in target["model"].state_dict().items())
    with pytest.raises(tdcp.CheckpointIntegrityError, match=shard.name):
        tdcp.verify(path)


def test_no_single_bit_flip_loads_a_different_state(saved: Path) -> None:
    """Every flip is refused, except those that spell the same manifest (``1e-08`` -> ``1E-08``): never another state."""
    data = (saved / "manifest.json").read_bytes()
    original = loads_manifest(data, "m")
    accepted = []
    for at in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[at] ^= 1 << bit
            try:
                parsed = loads_manifest(bytes(flipped), "m")
            except tdcp.CheckpointError:
                continue
            accepted.append((at, bit, bytes(flipped[max(0, at - 8) : at + 8])))
            assert parsed == original, f"flip of bit {bit} at byte {at} loads a different manifest"
    assert len(accepted) < 10, accepted


@pytest.mark.parametrize("needle", ['["lr",0.01', '"step":7', '["episodes",1', '["weight_decay",0.0001'])
def test_a_flipped_value_is_refused_by_load_and_verify_objects_unchanged(
    saved: Path, tmp_path: Path, needle: str
) -> None:
    path = Path(shutil.copytree(saved, tmp_path / "c"))
    data = bytearray((path / "manifest.json").read_bytes())
    at = data.index(needle.encode()) + len(needle) - 1
    data[at] ^= 0x01  # 0.01 -> 0.00, 7 -> 6, 1 -> 0, ...: still valid JSON, a different state
    (path / "manifest.json").write_bytes(bytes(data))
    objs = _objects(2)
    before = {k: v.clone() for k, v in objs["model"].state_dict().items()}
    lr = objs["optim"].param_groups[0]["lr"]
    with pytest.raises(tdcp.CheckpointIntegrityError, match="manifest checksum"):
        tdcp.DistributedCheckpoint(**objs).load(path)
    assert all(torch.equal(before[k], v) for k, v in objs["model"].state_dict().items())
    assert objs["optim"].param_groups[0]["lr"] == lr and objs["stats"]["episodes"] == 2
    with pytest.raises(tdcp.CheckpointIntegrityError, match="manifest.json"):
        tdcp.verify(path)


def test_a_data_file_from_another_save_is_refused(saved: Path, tmp_path: Path) -> None:
    """A data file copied in with its manifest entry (size and checksum consistent) is not this save's."""
    a = Path(shutil.copytree(saved, tmp_path / "a"))
    b = tdcp.DistributedCheckpoint(**_objects(1)).save(tmp_path / "b", step=7)  # same objects: same sizes
    shutil.copyfile(b / "__0_shared.distcp", a / "__0_shared.distcp")
    m = json.loads((a / "manifest.json").read_text())
    m["files"]["__0_shared.distcp"] = json.loads((b / "manifest.json").read_text())["files"]["__0_shared.distcp"]
    (a / "manifest.json").write_text(json.dumps(seal(m)))
    for attempt in (lambda: tdcp.DistributedCheckpoint(**_objects(2)).load(a), lambda: tdcp.verify(a)):
        with pytest.raises(tdcp.CheckpointIntegrityError, match="__0_shared.distcp.*another checkpoint"):
            attempt()
    shutil.copyfile(b / ".metadata", a / ".metadata")
    m["files"][".metadata"] = json.loads((b / "manifest.json").read_text())["files"][".metadata"]
    (a / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(tdcp.CheckpointIntegrityError, match="another checkpoint"):
        tdcp.verify(a)


@pytest.mark.parametrize("claimed", [[1 << 28], [1 << 20, 1 << 10]])
def test_a_forged_shape_larger_than_its_record_is_refused_before_allocating(tmp_path: Path, claimed: list[int]) -> None:
    """Manifest and .metadata consistently claim a huge tensor whose record holds 16 bytes: refused, nothing allocated."""
    import pickle
    import resource

    from torchrl_dcp.storage.filesums import file_checksum
    from torchrl_dcp.storage.filesystem import safe_load_metadata

    path = tdcp.DistributedCheckpoint(state={"w": torch.arange(4.0)}).save(tmp_path / "c")
    meta = safe_load_metadata(path / ".metadata")
    entry = meta.state_dict_metadata["replicated/state/w"]
    entry.size = torch.Size(claimed)
    entry.chunks[0].sizes = torch.Size(claimed)
    index = next(i for i in meta.storage_data if i.fqn == "replicated/state/w")
    meta.storage_data[type(index)(index.fqn, torch.Size([0] * len(claimed)), index.index)] = meta.storage_data.pop(
        index
    )
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    m = json.loads((path / "manifest.json").read_text())
    m["files"][".metadata"] = {
        "size": (path / ".metadata").stat().st_size,
        "checksum": file_checksum(path / ".metadata"),
    }
    node = m["components"]["state"]["state"]["items"][0][1]
    node["shape"] = claimed
    m["components"]["state"]["inventory"]["replicated/state/w"]["shape"] = claimed
    (path / "manifest.json").write_text(json.dumps(seal(m)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    target = {"w": torch.zeros(1)}
    with pytest.raises(tdcp.CheckpointIntegrityError, match="claims .* bytes but its records hold"):
        tdcp.DistributedCheckpoint(state=target).load(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing like 1 GiB
    with pytest.raises(tdcp.CheckpointIntegrityError, match="claims"):
        tdcp.verify(path)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two saves of equal shapes, each a tensor cut into 130 chunk files (identities read 64 files at a time)."""
    import torchrl_dcp.chunking as chunking

    root = tmp_path_factory.mktemp("many")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunking, "CHUNK_BYTES", 4096)
        mp.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
        a = tdcp.DistributedCheckpoint(w={"x": torch.arange(130 * 1024.0).reshape(130, 1024)}).save(root / "a")
        b = tdcp.DistributedCheckpoint(w={"x": torch.zeros(130, 1024)}).save(root / "b")
    return a, b


@pytest.mark.parametrize("which", [0, 63, 64, 65, 127, -1])
def test_a_chunk_file_from_another_save_is_refused_wherever_it_is(
    many_files: tuple[Path, Path], tmp_path: Path, which: int
) -> None:
    a, b = many_files
    chunks = sorted(f.name for f in a.iterdir() if f.name.endswith(".distcp"))
    assert len(chunks) >= 130
    name = chunks[which]
    c = Path(shutil.copytree(a, tmp_path / "c"))
    shutil.copyfile(b / name, c / name)  # same size; its checksum recorded too: only its identity differs
    m = json.loads((c / "manifest.json").read_text())
    m["files"][name] = json.loads((b / "manifest.json").read_text())["files"][name]
    (c / "manifest.json").write_text(json.dumps(seal(m)))
    for verify in (True, False):
        live = {"x": torch.full((130, 1024), -1.0)}
        with pytest.raises(tdcp.CheckpointIntegrityError, match=f"{name}.*another checkpoint"):
            tdcp.DistributedCheckpoint(w=live).load(c, verify=verify)
        assert torch.equal(live["x"], torch.full((130, 1024), -1.0))
    with pytest.raises(tdcp.CheckpointIntegrityError, match=f"{name}.*another checkpoint"):
        tdcp.verify(c)
    live = {"x": torch.zeros(130, 1024)}
    tdcp.DistributedCheckpoint(w=live).load(a)  # the intact save loads whole
    assert torch.equal(live["x"], torch.arange(130 * 1024.0).reshape(130, 1024))


@pytest.mark.parametrize("inventory", [True, 3, "x", [["k", {"dtype": "float32", "shape": [2]}]]])
def test_an_inventory_that_is_not_an_object_is_a_format_error(saved: Path, tmp_path: Path, inventory: object) -> None:
    """A resealed manifest whose component inventory is not an object is refused as malformed (it was read by the
    index check before the components were validated: a bool raised ``TypeError``), and nothing is loaded."""
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    raw = json.loads((path / "manifest.json").read_text())
    raw["components"]["stats"]["inventory"] = inventory
    raw.pop(CHECKSUM_FIELD)
    (path / "manifest.json").write_text(json.dumps(seal(raw)))
    with pytest.raises(tdcp.CheckpointFormatError, match="inventory must map tensor keys") as err:
        tdcp.verify(path)
    assert "manifest.json" in str(err.value)
    objs = _objects(2)
    before = objs["stats"].copy()
    with pytest.raises(tdcp.CheckpointFormatError, match="inventory"):
        tdcp.DistributedCheckpoint(**objs).load(path)
    assert objs["stats"] == before


@pytest.mark.parametrize("totals", [{"num_tensors": -1}, {"nbytes": -(10**30)}, {"nbytes": True}, {"num_tensors": 1.0}])
def test_component_totals_that_are_not_counts_are_malformed(saved: Path, tmp_path: Path, totals: dict) -> None:
    """A resealed manifest whose ``num_tensors``/``nbytes`` are not counts is refused by parse (``verify``, ``load``
    and ``inspect`` read it), naming the field."""
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    raw = json.loads((path / "manifest.json").read_text())
    raw["components"]["model"].update(totals)
    raw.pop(CHECKSUM_FIELD)
    (path / "manifest.json").write_text(json.dumps(seal(raw)))
    (field,) = totals
    with pytest.raises(tdcp.CheckpointFormatError, match=f"{field} must be a count") as err:
        tdcp.verify(path)
    assert "manifest.json" in str(err.value)
    with pytest.raises(tdcp.CheckpointFormatError, match=field):
        tdcp.DistributedCheckpoint(**_objects(2)).load(path)


@pytest.mark.parametrize("component", ["model", "optim"])
def test_component_totals_that_miscount_the_inventory_are_refused_by_verify(
    saved: Path, tmp_path: Path, component: str
) -> None:
    """Counts that are counts but not the inventory's (what ``inspect`` shows) are refused by ``verify``, which reads
    every rank's inventory."""
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    raw = json.loads((path / "manifest.json").read_text())
    raw["components"][component]["nbytes"] += 4
    raw.pop(CHECKSUM_FIELD)
    (path / "manifest.json").write_text(json.dumps(seal(raw)))
    with pytest.raises(tdcp.CheckpointIntegrityError, match=f"component '{component}' claims .* its inventory holds"):
        tdcp.verify(path)


def test_honest_manifests_dense_in_small_values_load(tmp_path: Path) -> None:
    """800,000 zeros in a JSON component and a list buffer of 150,000 ints: manifests a save writes, ~4x their size
    once decoded, which the parse bound (then 100 bytes a value) refused as denser than 16x."""
    from torchrl.data import ListStorage, ReplayBuffer

    lengths = {"episode_lengths": [0] * 800_000}
    rb = ReplayBuffer(storage=ListStorage(150_000))
    rb.extend(list(range(150_000)))
    path = tdcp.DistributedCheckpoint(stats=lengths, rb=rb).save(tmp_path / "c")
    tdcp.verify(path)
    got: dict = {}
    rb2 = ReplayBuffer(storage=ListStorage(150_000))
    tdcp.DistributedCheckpoint(stats=got, rb=rb2).load(path)
    assert got == lengths and len(rb2) == 150_000 and rb2[149_999] == 149_999


def test_a_save_never_writes_a_manifest_every_load_refuses() -> None:
    from torchrl_dcp.commit_records import parseable
    from torchrl_dcp.format.manifest import check_parse_cost

    dense = b"[" + b"{}," * (8 << 20) + b"{}]"  # 24 MiB of empty objects: ~18x once decoded
    with pytest.raises(tdcp.CheckpointFormatError, match="more than 16x"):
        check_parse_cost(dense, "m")
    with pytest.raises(tdcp.EncodingError, match="would be refused by every load"):
        parseable(dense, "the root manifest")
    fine = json.dumps([0] * 100_000, separators=(",", ":")).encode()
    assert parseable(fine, "the root manifest") is fine


@pytest.mark.parametrize("fingerprint", ["md5:00", "crc32:0123abcd", 7, "CRC32:0123ABCD/ADLER32:0123ABCD"])
def test_a_chunk_fingerprint_not_spelled_as_a_save_writes_it_is_refused(
    tmp_path: Path, fingerprint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was accepted by load and verify (harmless to what loads, since a kept chunk's bytes are compared, but no
    save writes it: a damaged or forged manifest)."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from torchrl_dcp import chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)  # (read once, at import)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    rb = ReplayBuffer(storage=LazyTensorStorage(4096))
    rb.extend(torch.arange(4096.0))
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")

    def spoil(m: dict[str, Any]) -> None:
        entries = next(iter(m["chunks"].values()))
        entries[0]["fingerprint"] = fingerprint

    forging.edit(path, spoil)
    with pytest.raises(tdcp.CheckpointFormatError, match="fingerprint"):
        tdcp.verify(path)
    with pytest.raises(tdcp.CheckpointFormatError, match="fingerprint"):
        tdcp.DistributedCheckpoint(buffer=ReplayBuffer(storage=LazyTensorStorage(4096))).load(path)
