"""Damaged, foreign and hostile checkpoints are refused with a CheckpointError naming the file."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.format.manifest import seal
from torchrl_dcp.storage.filesystem import safe_load_metadata


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# format 6: the replicated model is in the shared file, the per-rank tensors in the rank's own data file
DATA_FILES = ("__0_shared.distcp", "__0_0.distcp")


def _checkpoint(model: torch.nn.Module, stats: dict, own: dict) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(model=model, stats=stats)
    ckpt.register("own", own, placement="per_rank")
    return ckpt


def save(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    return _checkpoint(model, {"n": 1}, {"x": torch.arange(4.0)}).save(tmp_path / "c", step=1), model


def reseal(path: Path, name: str) -> None:
    """Update the manifest's record of ``name`` so that only the content check remains."""
    forging.reseal(path, name)


def load_into_fresh(path: Path) -> torch.nn.Module:
    target = torch.nn.Linear(3, 2)
    before = target.weight.detach().clone()
    own = {"x": torch.zeros(4)}
    with pytest.raises(tdcp.CheckpointError) as info:
        _checkpoint(target, {}, own).load(path)
    assert torch.equal(target.weight, before), "a failed load changed the object"
    assert torch.equal(own["x"], torch.zeros(4)), "a failed load changed the object"
    return info


def loads_exactly_the_save(path: Path, model: torch.nn.Module) -> None:
    """A load of ``path`` restores exactly the state ``model`` was saved with (format 5: loads read the manifest's
    storage entries, never ``.metadata``, so a forgery of ``.metadata`` alone is neither read nor restored)."""
    target = torch.nn.Linear(3, 2)
    stats: dict[str, object] = {}
    own = {"x": torch.zeros(4)}
    _checkpoint(target, stats, own).load(path)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())
    assert stats == {"n": 1} and torch.equal(own["x"], torch.arange(4.0))


def test_planted_pickle_in_metadata_is_refused_and_never_run(tmp_path: Path) -> None:
    """Format 5: loads never read ``.metadata`` (the manifest says where records are), so a planted pickle there is
    never unpickled by a load, which restores exactly the saved state; ``verify``, which reads ``.metadata``, refuses
    it as unsafe, naming it, without running it."""
    path, model = save(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    reseal(path, ".metadata")
    loads_exactly_the_save(path, model)
    assert not marker.exists()
    with pytest.raises(tdcp.UnsafeCheckpointError) as info:
        tdcp.verify(path)
    assert ".metadata" in str(info.value)
    assert "pathlib.Path" not in str(info.value) or "refused" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", DATA_FILES)
def test_planted_pickle_in_data_file_is_never_run(tmp_path: Path, name: str) -> None:
    path, _ = save(tmp_path)
    marker = tmp_path / "pwned"
    data = path / name
    data.write_bytes(pickle.dumps(_Payload(marker)))
    info = load_into_fresh(path)  # checksum mismatch
    assert name in str(info.value)
    reseal(path, name)
    load_into_fresh(path)  # content is only ever read with weights_only=True
    assert not marker.exists()


def test_metadata_pointing_outside_is_refused(tmp_path: Path) -> None:
    path, model = save(tmp_path)
    metadata = safe_load_metadata(path / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path, ".metadata")
    with pytest.raises(tdcp.CheckpointIntegrityError, match="outside the checkpoint") as err:
        tdcp.verify(path)  # verify reads .metadata: refused, naming it
    assert ".metadata" in str(err.value)
    loads_exactly_the_save(path, model)  # a load never reads .metadata: it restores what was saved
    # a complete forger points the manifest's storage entries outside too: the load refuses them
    assert forging.write_metadata(path, metadata)
    info = load_into_fresh(path)
    assert "../../etc/passwd" in str(info.value) and "manifest" in str(info.value)
    with pytest.raises(tdcp.CheckpointError, match=r"\.\./\.\./etc/passwd"):
        tdcp.verify(path)
    # and one who lists that path among the files is refused for the name itself
    forging.edit(path, lambda m: m["files"].__setitem__("../../etc/passwd", {"size": 1, "checksum": "crc32:0"}))
    info = load_into_fresh(path)
    assert "../../etc/passwd" in str(info.value) and "not a plain file name" in str(info.value)


@pytest.mark.parametrize(
    "damage, expected",
    [
        *((lambda p, n=n: (p / n).write_bytes((p / n).read_bytes()[:-10]), "truncated") for n in DATA_FILES),
        *((lambda p, n=n: _flip(p / n), "checksum") for n in DATA_FILES),
        *((lambda p, n=n: (p / n).unlink(), "missing") for n in DATA_FILES),
        (lambda p: (p / "extra.bin").write_bytes(b"x"), "not listed"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda p: _edit(p, world_size="two"), "world_size"),
        (lambda p: _edit(p, format_version=99), "format version 99"),
        (lambda p: _edit(p, format="something"), "format"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    ],
)
def test_damage_is_refused_naming_the_file(tmp_path: Path, damage, expected: str) -> None:
    path, _ = save(tmp_path)
    damage(path)
    info = load_into_fresh(path)
    assert expected in str(info.value)
    with pytest.raises(tdcp.CheckpointError, match=expected):
        tdcp.verify(path)


def test_foreign_empty_and_absent_paths(tmp_path: Path) -> None:
    with pytest.raises(tdcp.CheckpointNotFoundError):
        tdcp.DistributedCheckpoint(a=1).load(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(tdcp.CheckpointFormatError, match="no manifest.json"):
        tdcp.DistributedCheckpoint(a=1).load(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(tdcp.CheckpointFormatError):
        tdcp.DistributedCheckpoint(a=1).load(tmp_path / "file")


def test_a_plain_dcp_checkpoint_is_named_as_one_and_the_error_says_how_to_read_it(tmp_path: Path) -> None:
    """A directory written by plain ``dcp.save`` used to get "not a torchrl_dcp checkpoint, or a save that never
    committed": the user could not tell it from a killed save."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled" in one process
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain"))
    for attempt in (
        lambda: tdcp.DistributedCheckpoint(a={"w": torch.zeros(3)}).load(tmp_path / "plain"),
        lambda: tdcp.verify(tmp_path / "plain"),
        lambda: tdcp.read_manifest(tmp_path / "plain"),
    ):
        with pytest.raises(tdcp.CheckpointFormatError, match=r"plain torch.distributed.checkpoint.save \(read it with"):
            attempt()


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _edit(p: Path, **fields) -> None:
    m = json.loads((p / "manifest.json").read_text())
    m.update(fields)
    (p / "manifest.json").write_text(json.dumps(seal(m)))


@pytest.mark.parametrize("value", [None, 3.5, "w"])
def test_a_module_value_that_is_no_tensor_is_refused_before_any_copy(tmp_path: Path, value: object) -> None:
    """A manifest whose skeleton turns ``bias`` into a non-tensor: load_state_dict would copy ``weight`` first."""
    path, _ = save(tmp_path)
    m = forging.read_parts(path)
    items = m["components"]["model"]["state"]["items"]
    assert [k for k, _ in items] == ["weight", "bias"]
    items[1][1] = value
    forging.write_parts(path, m)
    info = load_into_fresh(path)  # the inventory still names the bias tensor: refused while planning
    assert "replicated/model/bias" in str(info.value) and "inventory" in str(info.value)
    m["components"]["model"]["inventory"].pop("replicated/model/bias")
    m["components"]["model"].update(num_tensors=1, nbytes=24)  # the totals recounted, as a forger would
    forging.write_parts(path, m)
    info = load_into_fresh(path)  # the manifest's storage entries still place the bias, which nothing holds now
    assert "replicated/model/bias" in str(info.value) and "does not hold" in str(info.value)
    m["index"]["entries"] = [e for e in m["index"]["entries"] if e[0] != "replicated/model/bias"]
    forging.write_parts(path, m)
    with pytest.raises(tdcp.CheckpointIntegrityError) as err:  # .metadata still holds the bias record: verify sees it
        tdcp.verify(path)
    assert ".metadata" in str(err.value) and "replicated/model/bias" in str(err.value)
    assert "no component" in str(err.value)
    info = load_into_fresh(path)  # a load reads the entries only: refused by the module adapter, before any copy
    assert "'bias'" in str(info.value) and "a tensor in the module" in str(info.value)
    md = safe_load_metadata(path / ".metadata")  # a consistent forgery: the record dropped from .metadata too
    md.state_dict_metadata.pop("replicated/model/bias")
    for index in [i for i in md.storage_data if i.fqn == "replicated/model/bias"]:
        md.storage_data.pop(index)
    forging.write_metadata(path, md)
    info = load_into_fresh(path)  # refused by the module adapter, before it copies weight
    assert "'bias'" in str(info.value) and "a tensor in the module" in str(info.value)


def test_a_manifest_dense_in_json_values_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """A resealed manifest of a million empty objects (3 MiB) would cost ~24x its size once decoded; it is refused,
    naming the manifest, by load and verify, before ``json.loads`` builds anything (peak memory a few times the
    file). A manifest the writer makes (thousands of tensors) still loads."""
    import tracemalloc

    path, _ = save(tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    m["metadata"] = {"x": [{}] * 1_000_000}
    text = json.dumps(seal(m), separators=(",", ":"))
    (path / "manifest.json").write_text(text)
    tracemalloc.start()
    try:
        info = load_into_fresh(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "manifest.json" in str(info.value) and "dense" in str(info.value)
    assert peak < 4 * len(text), f"{peak} bytes to refuse a {len(text)}-byte manifest"
    with pytest.raises(tdcp.CheckpointError, match="dense"):
        tdcp.verify(path)
    many = tdcp.DistributedCheckpoint(stats={f"t{i}": torch.zeros(2) for i in range(5000)})
    saved = many.save(tmp_path / "many")
    tdcp.DistributedCheckpoint(stats={f"t{i}": torch.ones(2) for i in range(5000)}).load(saved)
