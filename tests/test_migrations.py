"""Format and adapter-payload migrations: the committed v1 fixture loads through the chain."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
import torchrl_dcp.chunking as chunking
from tests import forging
from torchrl_dcp.format import manifest as mf
from torchrl_dcp.format import migrations as mg
from torchrl_dcp.format.layout import shard_name
from torchrl_dcp.format.manifest import dumps, seal
from torchrl_dcp.format.migrations import make_skeleton_dict, register_adapter_migration, skeleton_dict
from torchrl_dcp.storage.filesystem import safe_load_metadata

FIXTURE = Path(__file__).parent / "fixtures" / "v1_checkpoint"


@pytest.fixture(autouse=True)
def _isolated_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Migrations registered by a test vanish after it."""
    monkeypatch.setattr(mg, "MIGRATIONS", dict(mg.MIGRATIONS))
    monkeypatch.setattr(mg, "ADAPTER_MIGRATIONS", dict(mg.ADAPTER_MIGRATIONS))


class Counter:
    def __init__(self) -> None:
        self.value, self.label, self.unit = -1, "", ""


class CounterAdapterV2(tdcp.Adapter):
    """v2 payload: ``{"value": tensor, "label": str, "unit": str}`` (v1 had ``count`` and no unit)."""

    adapter_id = "tests.counter"
    version = 2

    def state(self, obj: Counter, ctx: Any) -> Any:
        return {"value": torch.tensor([obj.value]), "label": obj.label, "unit": obj.unit}

    def restore(self, obj: Counter, state: Any, ctx: Any) -> None:
        obj.value, obj.label, obj.unit = int(state["value"][0]), state["label"], state["unit"]


def register_counter_v1_to_v2() -> None:
    @register_adapter_migration("tests.counter", 1)
    def _counter_v1_to_v2(state: Any) -> Any:
        d = skeleton_dict(state)
        d["value"] = d.pop("count")  # the tensor reference moves; its bytes stay where they are
        d["unit"] = "steps"
        return make_skeleton_dict(d)


def fresh(counter_adapter: tdcp.Adapter | None = None) -> tuple[tdcp.DistributedCheckpoint, dict[str, Any]]:
    objs: dict[str, Any] = {
        "policy": torch.nn.Linear(3, 2),
        "stats": {},
        "counter": Counter(),
        "episode": {"return": torch.zeros(2)},
    }
    torch.nn.init.zeros_(objs["policy"].weight)
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"], stats=objs["stats"])
    ckpt.register("counter", objs["counter"], adapter=counter_adapter or CounterAdapterV2())
    ckpt.register("episode", objs["episode"], placement="per_rank")
    return ckpt, objs


def copy_fixture(tmp_path: Path) -> Path:
    dst = tmp_path / "v1"
    shutil.copytree(FIXTURE, dst)
    return dst


def edit_manifest(path: Path, **fields: Any) -> None:
    m = json.loads((path / "manifest.json").read_text())
    m.update(fields)
    (path / "manifest.json").write_text(json.dumps(seal(m)))


def test_fixture_really_is_format_v1() -> None:
    raw = json.loads((FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 1
    assert all("inventory" not in rec for rec in raw["components"].values())
    assert raw["components"]["counter"]["adapter_version"] == 1
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 16_000  # stays tiny


def test_v1_to_v2_adds_the_tensor_inventory_a_fresh_save_writes(tmp_path: Path) -> None:
    m = tdcp.read_manifest(FIXTURE)
    assert m["format_version"] == mf.FORMAT_VERSION == 8
    assert m["chunks"] == {}  # v3 -> v4: nothing was cut into chunk files
    assert m["sharded"] is False and m["index"] is None  # v4 -> v5: one file, DCP's .metadata says where records are
    assert m["components"]["policy"]["inventory"] == {
        "replicated/policy/bias": {"dtype": "float32", "shape": [2]},
        "replicated/policy/weight": {"dtype": "float32", "shape": [2, 3]},
    }
    assert m["components"]["episode"]["inventory"] == {"rank/0/episode/return": {"dtype": "float32", "shape": [2]}}
    assert m["components"]["counter"]["inventory"] == {"replicated/counter/count": {"dtype": "int64", "shape": [1]}}
    assert m["components"]["stats"]["inventory"] == {} and m["components"]["stats"]["num_tensors"] == 0
    assert m["components"]["policy"]["nbytes"] == 32 and m["components"]["policy"]["num_tensors"] == 2
    # the migrated inventory equals what the v2 writer records for the same objects
    ckpt, _ = fresh()
    path = ckpt.save(tmp_path / "v2")
    root = json.loads((path / "manifest.json").read_text())
    assert root["format_version"] == 8 and root["sharded"] is True
    assert "inventory" not in root["components"]["episode"]  # a per-rank inventory is in the rank's shard
    written = tdcp.read_manifest(path)  # the root with its shards: per-rank inventories where format 4 had them
    for name in ("policy", "episode", "stats"):
        assert written["components"][name]["inventory"] == m["components"][name]["inventory"]
    # migration works on a copy: parsing twice gives the same answer
    raw = json.loads((FIXTURE / "manifest.json").read_text())
    mf.parse_manifest(raw, "x")
    assert raw["format_version"] == 1 and "inventory" not in raw["components"]["policy"]


def test_v1_fixture_loads_through_the_chain_into_objects() -> None:
    register_counter_v1_to_v2()
    ckpt, objs = fresh()
    result = ckpt.load(FIXTURE)
    assert result.loaded == {"policy", "stats", "counter", "episode"}
    torch.manual_seed(0)
    expected = torch.nn.Linear(3, 2)  # what the fixture generator saved
    assert torch.equal(objs["policy"].weight, expected.weight) and torch.equal(objs["policy"].bias, expected.bias)
    assert objs["stats"] == {"episodes": 3, "name": "v1"}
    c = objs["counter"]
    assert (c.value, c.label, c.unit) == (41, "forty-one", "steps")
    assert torch.equal(objs["episode"]["return"], torch.tensor([1.5, -2.0]))
    assert result.step == 7 and result.manifest["metadata"]["reward"] == 1.25
    assert result.manifest["format_version"] == 8 and result.manifest["index"] is None
    report = tdcp.verify(FIXTURE)
    assert report["tensors"] == 4
    assert any("manifest checksum" in u for u in report["unchecked"]) and any(
        "identity" in u for u in report["unchecked"]
    )


def test_missing_payload_migration_makes_the_component_incompatible() -> None:
    ckpt, objs = fresh()
    result = ckpt.load(FIXTURE, strict="ignore")
    assert "counter" in result.incompatible and "no migration from v1" in result.incompatible["counter"]
    assert "policy" in result.loaded and objs["counter"].value == -1
    with pytest.raises(tdcp.IncompatibleComponentError, match="no migration from v1"):
        fresh()[0].load(FIXTURE)


def test_format_migrations_run_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = dict(mg.MIGRATIONS)

    def recording(version: int) -> Any:
        def step(m: dict[str, Any]) -> dict[str, Any]:
            seen.append(m["format_version"])
            return real[version](m)

        return step

    def record_8(m: dict[str, Any]) -> dict[str, Any]:
        seen.append(m["format_version"])
        m["metadata"]["upgraded_to_9"] = True
        m["format_version"] = 9
        return m

    for version in (1, 2, 3, 4, 5, 6, 7):
        monkeypatch.setitem(mg.MIGRATIONS, version, recording(version))
    monkeypatch.setitem(mg.MIGRATIONS, 8, record_8)
    monkeypatch.setattr(mf, "FORMAT_VERSION", 9)
    m = tdcp.read_manifest(FIXTURE)
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8] and m["format_version"] == 9 and m["metadata"]["upgraded_to_9"] is True
    assert "inventory" in m["components"]["policy"]  # the v1 -> v2 step ran first
    assert m["sharded"] is False and m["index"] is None  # and the v4 -> v5 step before the last four
    assert m["rank_table"] is None and "rank_files" not in m  # and the v7 -> v8 step before the last


def as_format_4(path: Path) -> None:
    """Rewrite a fresh save as the format-4 writer wrote it: one manifest file (per-rank states and inventories in
    it, no shards, no ``sharded``, no ``index``, chunk entries without offset and length), ``.metadata`` one pickle
    of DCP's whole ``Metadata``. (Checked against the format-4 library's own output for the same objects: the
    manifests agree but for save ids, times and checksums, the ``.metadata`` records are the same.)"""
    m = forging.read_parts(path)
    m["format_version"] = 4
    del m["sharded"], m["index"]
    for entries in m["chunks"].values():
        for entry in entries:
            del entry["offset"], entry["length"]
    for r in range(m["world_size"]):
        del m["files"][shard_name(r)]
        (path / shard_name(r)).unlink()
    (path / ".metadata").write_bytes(pickle.dumps(safe_load_metadata(path / ".metadata")))
    m["files"][".metadata"] = {"size": (path / ".metadata").stat().st_size, "checksum": ""}
    forging.write_parts(path, m)
    forging.reseal(path, ".metadata")


def test_a_format_4_checkpoint_loads_and_verifies_through_its_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v4 -> v5: a format-4 checkpoint (per-rank states in its one manifest, a tensor cut into chunk files) loads
    exactly and verifies; having no storage entries, its loads read DCP's ``.metadata``, checked as format 4 did."""
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)

    def objects(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        big = torch.arange(4096.0).reshape(16, 256) * seed
        return {"policy": torch.nn.Linear(3, 2), "stats": {"episodes": seed}, "big": {"x": big}, "rng": tdcp.RNGState()}

    saved = objects(1)
    path = tdcp.DistributedCheckpoint(**saved).save(tmp_path / "c", step=7)
    expected_rng = torch.get_rng_state()
    as_format_4(path)
    raw = json.loads((path / "manifest.json").read_text())
    assert raw["format_version"] == 4 and "index" not in raw and "sharded" not in raw
    assert "ranks" in raw["components"]["rng"] and len(raw["chunks"]["replicated/big/x"]) == 4
    assert not (path / shard_name(0)).exists()
    m = tdcp.read_manifest(path)
    assert m["format_version"] == 8 and m["sharded"] is False and m["index"] is None

    torch.manual_seed(99)
    target = objects(2)
    result = tdcp.DistributedCheckpoint(**target).load(path)
    assert result.loaded == {"policy", "stats", "big", "rng"} and result.step == 7
    assert all(torch.equal(target["policy"].state_dict()[k], v) for k, v in saved["policy"].state_dict().items())
    assert torch.equal(target["big"]["x"], saved["big"]["x"]) and target["stats"] == {"episodes": 1}
    assert torch.equal(torch.get_rng_state(), expected_rng)
    report = tdcp.verify(path)
    assert report["tensors"] == 6  # the policy's 2, the big one, the generators' 3
    assert report["unchecked"] == []

    # its loads read .metadata (the manifest says nowhere else where records are): a planted pickle is refused
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    forging.reseal(path, ".metadata")
    target = objects(3)
    with pytest.raises(tdcp.UnsafeCheckpointError, match=r"\.metadata"):
        tdcp.DistributedCheckpoint(**target).load(path)
    assert torch.equal(target["big"]["x"], objects(3)["big"]["x"]) and not marker.exists()


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_newer_format_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = copy_fixture(tmp_path)
    edit_manifest(path, format_version=mf.FORMAT_VERSION + 1)
    newer, current = mf.FORMAT_VERSION + 1, mf.FORMAT_VERSION
    with pytest.raises(tdcp.CheckpointVersionError, match=f"format version {newer}.*reads up to {current}.*upgrade"):
        tdcp.read_manifest(path)
    with pytest.raises(tdcp.CheckpointVersionError):
        fresh()[0].load(path)


def test_missing_or_broken_format_migration_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(mg.MIGRATIONS, 1)
    with pytest.raises(tdcp.CheckpointVersionError, match="no migration from it is registered"):
        tdcp.read_manifest(FIXTURE)
    monkeypatch.setitem(mg.MIGRATIONS, 1, lambda m: m)  # forgets to bump the version
    with pytest.raises(tdcp.CheckpointVersionError, match="did not upgrade it"):
        tdcp.read_manifest(FIXTURE)


class ScoreAdapter(tdcp.Adapter):
    """A test-local adapter whose payload changed twice: v1 ``{"s": t}``, v2 ``{"score": t}``, v3 adds ``"scale"``."""

    adapter_id = "tests.score"

    def __init__(self, version: int) -> None:
        self.version = version

    def state(self, obj: dict[str, Any], ctx: Any) -> Any:
        key = "s" if self.version == 1 else "score"
        out: dict[str, Any] = {key: obj["score"].clone()}
        if self.version >= 3:
            out["scale"] = obj.get("scale", 1.0)
        return out

    def restore(self, obj: dict[str, Any], state: Any, ctx: Any) -> None:
        obj["score"] = state["score"] * state["scale"]


def test_payload_migrations_chain_v1_to_v3_for_replicated_and_per_rank(tmp_path: Path) -> None:
    calls: list[str] = []

    @register_adapter_migration("tests.score", 1)
    def _v1_to_v2(state: Any) -> Any:
        calls.append("1->2")
        d = skeleton_dict(state)
        return make_skeleton_dict({"score": d["s"]})

    @register_adapter_migration("tests.score", 2)
    def _v2_to_v3(state: Any) -> Any:
        calls.append("2->3")
        return make_skeleton_dict({**skeleton_dict(state), "scale": 2.0})

    saved = {"score": torch.tensor([1.0, 3.0])}
    mine = {"score": torch.tensor([5.0])}
    old = tdcp.DistributedCheckpoint()
    old.register("shared", saved, adapter=ScoreAdapter(1))
    old.register("mine", mine, adapter=ScoreAdapter(1), placement="per_rank")
    path = old.save(tmp_path / "c")
    assert tdcp.read_manifest(path)["components"]["shared"]["adapter_version"] == 1

    shared, own = {}, {}
    new = tdcp.DistributedCheckpoint()
    new.register("shared", shared, adapter=ScoreAdapter(3))
    new.register("mine", own, adapter=ScoreAdapter(3), placement="per_rank")
    result = new.load(path)
    assert result.loaded == {"shared", "mine"} and calls == ["1->2", "2->3", "1->2", "2->3"]
    assert torch.equal(shared["score"], torch.tensor([2.0, 6.0])) and torch.equal(own["score"], torch.tensor([10.0]))
    # only the v2 step is needed for a v2 reader
    calls.clear()
    two: dict[str, Any] = {}
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("shared", two, adapter=ScoreAdapter(2))

    class V2(ScoreAdapter):
        def restore(self, obj: dict[str, Any], state: Any, ctx: Any) -> None:
            obj["score"] = state["score"]

    ckpt._components["shared"].adapter = V2(2)
    ckpt.load(path, components=["shared"])
    assert calls == ["1->2"] and torch.equal(two["score"], torch.tensor([1.0, 3.0]))


def test_newer_payload_and_failing_migration_are_reported(tmp_path: Path) -> None:
    data = {"score": torch.tensor([1.0])}
    path = tdcp.DistributedCheckpoint().register("x", data, adapter=ScoreAdapter(3)).save(tmp_path / "c")
    result = tdcp.DistributedCheckpoint().register("x", {}, adapter=ScoreAdapter(2)).load(path, strict="ignore")
    assert "v3" in result.incompatible["x"] and "reads up to v2" in result.incompatible["x"]

    path = tdcp.DistributedCheckpoint().register("x", data, adapter=ScoreAdapter(1)).save(tmp_path / "d")

    @register_adapter_migration("tests.score", 1)
    def _broken(state: Any) -> Any:
        raise KeyError("nope")

    result = tdcp.DistributedCheckpoint().register("x", {}, adapter=ScoreAdapter(2)).load(path, strict="ignore")
    assert "v1 -> v2 failed" in result.incompatible["x"] and "KeyError" in result.incompatible["x"]


def test_version_skew_is_reported_and_logged_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = copy_fixture(tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    m["versions"]["torch"] = "2.0.0"
    m["versions"]["torchrl"] = "0.1.0"
    (path / "manifest.json").write_text(json.dumps(seal(m)))
    register_counter_v1_to_v2()
    ckpt, objs = fresh()
    with caplog.at_level(logging.WARNING, logger="torchrl_dcp"):
        result = ckpt.load(path)
    assert result.loaded == {"policy", "stats", "counter", "episode"}
    assert result.version_skew
    assert result.comparison["versions"]["torch"] == {
        "checkpoint": "2.0.0",
        "runtime": torch.__version__,
        "matches": False,
    }
    assert result.comparison["versions"]["tensordict"]["matches"] is True
    assert "torch 2.0.0 -> " in caplog.text and "torchrl 0.1.0 -> " in caplog.text


def test_registration_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        mg.register_migration(0)
    with pytest.raises(ValueError):
        register_adapter_migration("", 1)
    with pytest.raises(tdcp.CheckpointFormatError, match="expected a dict skeleton"):
        skeleton_dict({"t": "list", "items": []})


V4_FIXTURE = Path(__file__).parent / "fixtures" / "v4_checkpoint"


def test_the_committed_format_4_checkpoint_loads_exactly(tmp_path: Path) -> None:
    """A checkpoint written by the format-4 library itself (``tests/fixtures/v4_checkpoint``: a module, a chunked
    tensor, a dict and the RNG streams, step 7) loads through the v4 -> v5 migration exactly as a plain ``dcp.load``
    of its files reads them, and verifies with nothing unchecked."""
    raw = json.loads((V4_FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 4 and "ranks" in raw["components"]["rng"] and len(raw["chunks"]) == 1
    path = Path(shutil.copytree(V4_FIXTURE, tmp_path / "c"))
    files = {k: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"])) for c in raw["components"].values()
             for k, t in c["inventory"].items()}  # fmt: skip
    dcp.load(files, checkpoint_id=str(path), no_dist=True)  # DCP's own reading of the files: the reference
    target = {"policy": torch.nn.Linear(3, 2), "stats": {"episodes": -1}, "big": {"x": torch.zeros(16, 256)}}
    result = tdcp.DistributedCheckpoint(**target, rng=tdcp.RNGState()).load(path)
    assert result.loaded == {"policy", "stats", "big", "rng"} and result.step == 7
    assert torch.equal(target["policy"].weight, files["replicated/policy/weight"])
    assert torch.equal(target["policy"].bias, files["replicated/policy/bias"])
    assert torch.equal(target["big"]["x"], files["replicated/big/x"]) and target["stats"] == {"episodes": 3}
    assert torch.equal(torch.get_rng_state(), files["rank/0/rng/torch"])
    assert tdcp.verify(path)["unchecked"] == []


V5_FIXTURE = Path(__file__).parent / "fixtures" / "v5_checkpoint"


def _copy_and_read_with_dcp(fixture: Path, to: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A copy of the single-rank ``fixture`` and every tensor its manifest and shard inventory, read by a plain
    ``dcp.load`` of its files (DCP's own reading: the reference a load must match)."""
    raw = json.loads((fixture / "manifest.json").read_text())
    shard = json.loads((fixture / shard_name(0)).read_text())
    path = Path(shutil.copytree(fixture, to))
    inventories = [c["inventory"] for c in raw["components"].values() if "inventory" in c]
    inventories += [c["inventory"] for c in shard["components"].values()]
    files = {k: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"])) for inv in inventories
             for k, t in inv.items()}  # fmt: skip
    dcp.load(files, checkpoint_id=str(path), no_dist=True)
    return path, files


def test_the_committed_format_5_checkpoint_loads_exactly(tmp_path: Path) -> None:
    """A checkpoint written by the format-5 library itself (``tests/fixtures/v5_checkpoint``: a module, a chunked
    tensor, a dict, a per-rank dict and the RNG streams, step 7, with ``TDCP_CHUNK_BYTES=4096``; its replicated and
    per-rank tensors share ``__0_0.distcp``) loads exactly as a plain ``dcp.load`` of its files reads them, and
    verifies with nothing unchecked."""
    raw = json.loads((V5_FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 5 and raw["sharded"] is True and len(raw["chunks"]) == 1
    assert sorted(n for n in raw["files"] if n.endswith(".distcp")) == [f"__0_{i}.distcp" for i in range(5)]
    path, files = _copy_and_read_with_dcp(V5_FIXTURE, tmp_path / "c")
    target = {"policy": torch.nn.Linear(3, 2), "stats": {"episodes": -1}, "big": {"x": torch.zeros(16, 256)}}
    small = {"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.bool)}
    ckpt = tdcp.DistributedCheckpoint(**target, rng=tdcp.RNGState())
    ckpt.register("small", small, placement="per_rank")
    result = ckpt.load(path)
    assert result.loaded == {"policy", "stats", "big", "rng", "small"} and result.step == 7
    assert torch.equal(target["policy"].weight, files["replicated/policy/weight"])
    assert torch.equal(target["big"]["x"], files["replicated/big/x"]) and target["stats"] == {"episodes": 3}
    assert torch.equal(small["a"], files["rank/0/small/a"]) and small["b"].tolist() == [True, False]
    assert torch.equal(torch.get_rng_state(), files["rank/0/rng/torch"])
    assert tdcp.verify(path)["unchecked"] == []


V6_FIXTURE = Path(__file__).parent / "fixtures" / "v6_checkpoint"


def _load_the_fixture_state(path: Path, files: dict[str, torch.Tensor]) -> Any:
    """Load the state the format-6 and format-7 fixtures hold into fresh objects; check it is what a plain
    ``dcp.load`` of their files reads (``files``) and that the checkpoint verifies with nothing unchecked."""
    target = {"policy": torch.nn.Linear(3, 2), "stats": {"episodes": -1}, "big": {"x": torch.zeros(16, 256)}}
    small = {"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.bool)}
    buf = {"rows": torch.zeros(32, 64)}
    ckpt = tdcp.DistributedCheckpoint(**target, rng=tdcp.RNGState())
    ckpt.register("small", small, placement="per_rank")
    ckpt.register("buf", buf, placement="per_rank")
    result = ckpt.load(path)
    assert result.loaded == {"policy", "stats", "big", "rng", "small", "buf"} and result.step == 7
    assert torch.equal(target["policy"].weight, files["replicated/policy/weight"])
    assert torch.equal(target["big"]["x"], files["replicated/big/x"]) and target["stats"] == {"episodes": 3}
    assert torch.equal(small["a"], files["rank/0/small/a"]) and small["b"].tolist() == [True, False]
    assert torch.equal(buf["rows"], files["rank/0/buf/rows"])
    assert torch.equal(torch.get_rng_state(), files["rank/0/rng/torch"])
    assert tdcp.verify(path)["unchecked"] == []
    return result


def test_the_committed_format_6_checkpoint_loads_exactly(tmp_path: Path) -> None:
    """A checkpoint written by the format-6 library itself (``tests/fixtures/v6_checkpoint``: a module, a chunked
    replicated tensor, a dict, per-rank dicts (one chunked) and the RNG streams, step 7, ``TDCP_CHUNK_BYTES=4096``;
    its root lists every file, rank 0's own ones included) loads exactly as a plain ``dcp.load`` of its files reads
    them, and verifies with nothing unchecked: format 7's ``rank_files`` is ``null`` (its shards list no files)."""
    raw = json.loads((V6_FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 6 and "rank_files" not in raw and "__0_0.distcp" in raw["files"]
    shard = json.loads((V6_FIXTURE / shard_name(0)).read_text())
    assert "files" not in shard and "rank/0/buf/rows" in shard["chunks"]
    path, files = _copy_and_read_with_dcp(V6_FIXTURE, tmp_path / "c")
    result = _load_the_fixture_state(path, files)
    assert result.manifest["format_version"] == 8 and result.manifest["rank_table"]["shard_version"] == 5
    (path / "__0_9.distcp").write_bytes(b"x")  # nothing is counted by rank: every file must be listed
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"__0_9\.distcp: file not listed"):
        tdcp.verify(path)


V7_FIXTURE = Path(__file__).parent / "fixtures" / "v7_checkpoint"


def test_the_committed_format_7_checkpoint_loads_exactly(tmp_path: Path) -> None:
    """A checkpoint written by the format-7 library itself (``tests/fixtures/v7_checkpoint``: the v6 fixture's state,
    saved by the library of format 7: its root lists its shard in ``files`` and counts rank 0's own files in
    ``rank_files``) loads exactly as a plain ``dcp.load`` of its files reads them, migrated to format 8's rank table
    (the shard's record and the counts in one row), and verifies with nothing unchecked."""
    from torchrl_dcp.format import rank_table

    raw = json.loads((V7_FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 7 and shard_name(0) in raw["files"] and raw["rank_files"][0][0] == 3
    path, files = _copy_and_read_with_dcp(V7_FIXTURE, tmp_path / "c")
    result = _load_the_fixture_state(path, files)
    m = result.manifest
    assert m["format_version"] == 8 and "rank_files" not in m and m["rank_table"]["shard_version"] == 7
    shard = (V7_FIXTURE / shard_name(0)).read_bytes()
    own = raw["rank_files"][0]
    assert rank_table.rows(m) == [rank_table.RankRow(len(shard), zlib.crc32(shard), own[0], own[1])]
    (path / "__0_9.distcp").write_bytes(b"x")  # counted against the migrated row: one file more than it says
    with pytest.raises(tdcp.CheckpointIntegrityError, match=r"__0_9\.distcp: file not listed"):
        tdcp.verify(path)


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        (lambda m: m["files"].pop("manifest-0.json"), "one shard per saved rank"),
        (lambda m: m["files"]["manifest-0.json"].update(checksum="sha256:00"), "one shard per saved rank"),
        (lambda m: m["files"]["manifest-0.json"].update(size=2**64), "one shard per saved rank"),
        (lambda m: m.update(rank_files=[[2**32, 1]]), "counts more files"),
        (lambda m: m.update(rank_files=[[1]]), r"rank_files\[0\]"),
        (lambda m: m.update(rank_files=[]), "rank_files must hold"),
        (
            lambda m: m["files"].update({"manifest-1.json": {"size": 1, "checksum": "crc32:00000000"}}),
            "list the shards",
        ),
        (lambda m: m["files"]["manifest-0.json"].update(origin=m["save_id"]), "no save writes that"),
    ],
)
def test_a_format_7_root_the_migration_cannot_pack_is_refused(tmp_path: Path, forge: Any, why: str) -> None:
    """A sealed format-7 root whose shard records or ``rank_files`` no format-7 save writes: the v7 -> v8 step (or
    the validation after it) refuses it, naming the manifest, instead of packing something else."""
    path = tmp_path / "c"
    shutil.copytree(V7_FIXTURE, path)
    raw = json.loads((path / "manifest.json").read_text())
    forge(raw)
    (path / "manifest.json").write_bytes(dumps(seal(raw)))
    with pytest.raises(tdcp.CheckpointFormatError, match=why) as err:
        tdcp.read_manifest(path)
    assert "manifest.json" in str(err.value)


@pytest.mark.parametrize(
    ("shape", "why"), [([10**4000], "not sizes below 2\\*\\*63"), ([2**62] * 240, "of 2\\*\\*63 elements or more")]
)
def test_a_v1_tensor_shape_past_any_size_is_refused_by_the_migration(tmp_path: Path, shape: list, why: str) -> None:
    """A format-1 manifest (no checksum to forge) with a shape of 10**4000, or of 240 sizes of 2**62 each: the v1 ->
    v2 migration multiplied it into a 4,000-digit ``nbytes``, and ``inspect`` failed printing it ("Exceeds the limit
    (4300 digits)"), naming no file. The migration refuses sizes, and element counts, past 2**63."""
    from torchrl_dcp.cli import main

    dst = tmp_path / "v1"
    shutil.copytree(FIXTURE, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    raw["components"]["counter"]["state"]["items"][0][1]["shape"] = shape
    (dst / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.read_manifest(dst)
    assert main(["inspect", str(dst)]) == 1


def test_a_forged_world_size_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A format-1 manifest (no seal) whose world_size says 10**9: its per-rank component's states were compared with
    10**9 rank names built first (a MemoryError, or the process killed). Refused from the counts, in 2 GiB more."""
    forged = tmp_path / "v1"
    shutil.copytree(FIXTURE, forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    assert any(c["placement"] == "per_rank" for c in manifest["components"].values())
    manifest["world_size"] = 10**9
    (forged / "manifest.json").write_text(json.dumps(manifest))
    child = (
        "import resource, sys, torch\n"
        "import torchrl_dcp as tdcp\n"
        "mapped = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) << 10\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), mapped + (2 << 30)))\n"
        "try:\n"
        "    tdcp.read_manifest(sys.argv[1])\n"
        "except tdcp.CheckpointFormatError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(forged)], capture_output=True, text=True, timeout=300)
    assert "refused:" in done.stdout and "one state per saved rank" in done.stdout, (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("world_size", [10**9 + 1, 2**70])
def test_a_world_size_no_file_name_can_spell_is_refused_with_the_file_named(tmp_path: Path, world_size: int) -> None:
    """``len(range(2**70))`` raised a bare ``OverflowError`` from read_manifest, verify and inspect ("please report
    this as a torchrl_dcp bug"), and a load said "validating the checkpoint failed" without the file."""
    from torchrl_dcp.cli import main

    forged = tmp_path / "v1"
    shutil.copytree(FIXTURE, forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["world_size"] = world_size
    (forged / "manifest.json").write_text(json.dumps(manifest))
    says = "world_size must be a positive integer of at most 1000000000"
    for call in (tdcp.read_manifest, tdcp.verify):
        with pytest.raises(tdcp.CheckpointFormatError, match=says) as err:
            call(forged)
        assert str(forged / "manifest.json") in str(err.value)
    assert main(["inspect", str(forged)]) == 1
