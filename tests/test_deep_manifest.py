"""A manifest nested deeply anywhere, sealed so that only its shape is wrong.

Every place a forger can nest (a replicated state, a per-rank state and inventory, which
format 5 keeps in the rank's manifest shard, a tensor inventory, a storage entry, a file
record, the user's metadata, the chunk table), every container kind, depths past
the manifest's limit and near Python's recursion limit, in the current format and in an
older one (migrations walk states recursively): ``load`` and ``verify`` refuse it with a
``CheckpointError`` (never a ``RecursionError``); ``inspect``, ``convert`` and ``diff``, which never decode
states, describe, copy (the archive is refused the same way) or compare it, or refuse it in one line; a
refused load changes nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.cli import main
from torchrl_dcp.format.layout import shard_name

WRAP: dict[str, Callable[[Any], Any]] = {
    "skeleton list": lambda n: {"t": "list", "items": [n]},
    "skeleton dict": lambda n: {"t": "dict", "items": [["k", n]]},
    "skeleton np": lambda n: {"t": "np", "dtype": "<f8", "v": n},
    "json list": lambda n: [n],
    "json object": lambda n: {"k": n},
}


def _nest(kind: str, depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = WRAP[kind](node)
    return node


PLACES: dict[str, Callable[[dict[str, Any], Any], None]] = {
    "replicated state": lambda m, deep: m["components"]["stats"].__setitem__("state", deep),
    "inside a replicated state": lambda m, deep: m["components"]["stats"]["state"]["items"].append(["x", deep]),
    "per-rank state": lambda m, deep: m["components"]["rng"]["ranks"]["0"].__setitem__("state", deep),
    "inventory entry": lambda m, deep: next(iter(m["components"]["model"]["inventory"].values())).__setitem__(
        "shape", [deep]
    ),
    "next to an inventory entry": lambda m, deep: next(
        iter(m["components"]["model"]["inventory"].values())
    ).__setitem__("extra", deep),
    "per-rank inventory entry": lambda m, deep: next(  # format 5: in the rank's manifest shard
        iter(m["components"]["rng"]["inventory"].values())
    ).__setitem__("shape", [deep]),
    "storage entry": lambda m, deep: m.__setitem__(  # format 5: the index (a format-3 manifest's is dropped)
        "index", {"entries": [["replicated/model/weight", deep, 0, 0]]}
    ),
    "file record": lambda m, deep: m["files"][".metadata"].__setitem__("extra", deep),
    "user metadata": lambda m, deep: m["metadata"].__setitem__("deep", deep),
    "chunk table": lambda m, deep: m.setdefault("chunks", {}).__setitem__("model/weight", [deep]),
}


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 2), "stats": {"seed": 1, "tags": ["a"]}, "rng": tdcp.RNGState()}


def _forge(tmp_path: Path, place: str, kind: str, depth: int, old_format: bool) -> Path:
    path = tdcp.DistributedCheckpoint(**_state()).save(tmp_path / "ck", metadata={"run": 1})
    m = forging.read_parts(path)  # the root with its shards merged in: per-rank states where a reader sees them
    if old_format:  # format 3: one manifest file, no chunk table, no commit counter, no index (migrated on load)
        m["format_version"] = 3
        for field in ("chunks", "sequence", "sharded", "index"):
            m.pop(field, None)
        for r in range(m["world_size"]):
            m["files"].pop(shard_name(r), None)
            (path / shard_name(r)).unlink()
        assert "ranks" in m["components"]["rng"]  # the per-rank state is in the one file, as format 3 kept it
    PLACES[place](m, _nest(kind, depth))
    m.pop("manifest_checksum", None)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # the forger's own json.dumps
    try:
        forging.write_parts(path, m)  # the root (and, in format 5, the shard holding a per-rank state) resealed
    finally:
        sys.setrecursionlimit(limit)
    return path


def _snapshot(state: dict[str, Any]) -> Any:
    return (
        {k: v.clone() for k, v in state["model"].state_dict().items()},
        json.dumps(state["stats"]),
    )


@pytest.mark.parametrize("old_format", [False, True], ids=["current", "format 3"])
@pytest.mark.parametrize("depth", [300, 900])
@pytest.mark.parametrize("kind", sorted(WRAP))
@pytest.mark.parametrize("place", sorted(PLACES))
def test_deep_nesting_anywhere_is_refused_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture, place: str, kind: str, depth: int, old_format: bool
) -> None:
    path = _forge(tmp_path, place, kind, depth, old_format)
    state = _state()
    with torch.no_grad():
        state["model"].weight.fill_(7.0)
    state["stats"]["seed"] = 99
    before = _snapshot(state)
    with pytest.raises(tdcp.CheckpointError) as err:
        tdcp.DistributedCheckpoint(**state).load(path)
    assert str(path) in str(err.value) or "manifest" in str(err.value)
    after = _snapshot(state)
    assert before[1] == after[1]
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    with pytest.raises(tdcp.CheckpointError):
        tdcp.verify(path)
    good = tdcp.DistributedCheckpoint(**_state()).save(tmp_path / "good")
    archive = tmp_path / "a.zip"
    for argv in (
        ["verify", str(path)],
        ["diff", str(path), str(good)],
        ["convert", str(path), str(archive)],
        ["inspect", str(path)],
    ):
        code = main(argv)
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "Recursion" not in out.err, out.err
        if argv[0] in ("inspect", "convert") and code == 0:  # byte-level tools: describe or copy, never decode
            continue
        if argv[0] == "diff":  # compares the JSON states as JSON: "they differ" (exit 1) or one error line (exit 2)
            assert (code, out.err.startswith("error: ")) in ((2, True), (1, False)), (out.out, out.err)
            assert code == 2 or "differ" in out.out, (out.out, out.err)
            continue
        assert code == 1 and out.err.startswith("error: "), (argv, out.err)
    if archive.exists():  # a faithful copy, refused the same way
        with pytest.raises(tdcp.CheckpointError):
            tdcp.DistributedCheckpoint(**_state()).load(archive)
        with pytest.raises(tdcp.CheckpointError):
            tdcp.verify(archive)


def test_metadata_nested_deeper_than_a_load_reads_is_refused_at_save_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """Metadata nested 256 levels was saved (replacing the checkpoint at its path), and every load refused the
    manifest as nested too deeply: a save never writes what every load refuses. 255 levels load."""

    def nested(levels: int) -> Any:
        value: Any = 1
        for i in range(levels):
            value = {"a": value} if i % 2 else [value]
        return value

    ckpt = tdcp.DistributedCheckpoint(no_dist=True, a={"x": torch.ones(2)})
    path = ckpt.save(tmp_path / "c", metadata={"m": nested(254)})
    assert tdcp.read_manifest(path)["metadata"]["m"] == nested(254)
    with pytest.raises(tdcp.EncodingError, match="nested more than 255 levels deep"):
        ckpt.save(tmp_path / "c", metadata={"m": nested(255)})
    assert tdcp.read_manifest(path)["metadata"]["m"] == nested(254)  # the checkpoint there is kept
