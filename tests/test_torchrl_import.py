"""Checkpoints written by ``torchrl.checkpoint`` (torchrl 0.14.1) load into a DistributedCheckpoint, read-only.

Every case writes a real torchrl checkpoint (directory and ``.torchrl`` archive), restores it
once with torchrl's own ``Checkpoint.load`` and once with ours into equal fresh objects, and
compares the whole objects by the state audit: the import restores what torchrl's load does.
Then forgeries an attacker would write: pickles, foreign classes, sizes, names.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint, CheckpointError, GlobalRNGState, StateDictCheckpointAdapter
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.samplers import SliceSampler

import torchrl_dcp as tdcp
from torchrl_dcp.audit import state_differences, state_snapshot

pytestmark = pytest.mark.filterwarnings("ignore::torchrl_dcp.UnrestoredComponentWarning")


def _module() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _trained(seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    policy = _module()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2)
    for _ in range(3):
        policy(torch.randn(5, 3)).sum().backward()
        optim.step()
        sched.step()
    return {"policy": policy, "optimizer": optim, "scheduler": sched}


def _fresh() -> dict[str, object]:
    torch.manual_seed(123)
    policy = _module()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    return {"policy": policy, "optimizer": optim, "scheduler": torch.optim.lr_scheduler.StepLR(optim, 2)}


def _buffers(fill: bool) -> dict[str, ReplayBuffer]:
    out = {
        "prioritized": TensorDictReplayBuffer(
            storage=LazyTensorStorage(20), sampler=PrioritizedSampler(20, 0.7, 0.5), batch_size=4
        ),
        "memmap_nested": TensorDictReplayBuffer(
            storage=LazyMemmapStorage(16), sampler=SamplerWithoutReplacement(), batch_size=2
        ),
        "plain_tensor": ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2),
    }
    out["plain_tensor"].set_rng(torch.Generator().manual_seed(7))
    if fill:
        torch.manual_seed(1)
        out["prioritized"].extend(TensorDict({"obs": torch.randn(7, 3), "a": torch.arange(7)}, [7]))
        s = out["prioritized"].sample()
        s["td_error"] = torch.rand(4)
        out["prioritized"].update_tensordict_priority(s)
        out["memmap_nested"].extend(TensorDict({"x": torch.randn(5, 2), "next": {"x": torch.randn(5, 2)}}, [5]))
        out["memmap_nested"].sample()
        out["plain_tensor"].extend(torch.randn(4, 2))
        out["plain_tensor"].sample()
    return out


def _save(tmp_path: Path, container: str, **components: object) -> Path:
    if container == "archive":
        return Checkpoint(**components).save(tmp_path / "run.torchrl", format="archive", metadata={"step": 30})
    return Checkpoint(**components).save(tmp_path / "ckpt", metadata={"step": 30})


def _audit(objs: dict[str, object]) -> dict[str, object]:
    return {name: state_snapshot(obj, name) for name, obj in objs.items()}


def _same(a: dict[str, object], b: dict[str, object]) -> list[str]:
    return [str(d) for name in a for d in state_differences(a[name], b[name])]


@pytest.mark.parametrize("container", ["directory", "archive"])
def test_learner_components_load_as_torchrl_loads_them(tmp_path: Path, container: str) -> None:
    saved = _trained()
    stats: dict[str, object] = {"episodes": 3, "best": 1.5}
    path = _save(tmp_path, container, **saved, stats=stats, note="hello")
    by_torchrl, ours = _fresh(), _fresh()
    theirs_stats: dict[str, object] = {}
    our_stats: dict[str, object] = {"stale": 1}
    Checkpoint(**by_torchrl, stats=theirs_stats, note=None).load(path)
    result = tdcp.DistributedCheckpoint(**ours, stats=our_stats, note="").load(path)
    assert result.loaded == {"policy", "optimizer", "scheduler", "stats", "note"}
    assert result.step == 30 and result.values["note"] == "hello"
    assert our_stats == theirs_stats == stats  # a mapping is updated in place, as torchrl does
    assert _same(_audit(by_torchrl), _audit(ours)) == []
    assert _same(_audit(saved), _audit(ours)) == []  # and it is the state that was saved


#: what torchrl's dump of a buffer does not hold: the indices of the storage's last write
NOT_IN_TORCHRL_DUMPS = ("_storage._last_cursor", "_storage._last_cursor_index_value")


@pytest.mark.parametrize("container", ["directory", "archive"])
def test_replay_buffers_load_as_torchrl_loads_them(tmp_path: Path, container: str) -> None:
    saved = _buffers(fill=True)
    path = _save(tmp_path, container, **saved)
    by_torchrl, ours = _buffers(fill=False), _buffers(fill=False)
    # torchrl 0.14's own load cannot fill a fresh lazy storage of one tensor ("Cannot fill a non-initialized
    # pytree-based TensorStorage"): that one is compared with the saved buffer only
    Checkpoint(**{k: v for k, v in by_torchrl.items() if k != "plain_tensor"}).load(path, components=["prioritized", "memmap_nested"])  # fmt: skip
    ckpt = tdcp.DistributedCheckpoint()
    for name, rb in ours.items():
        ckpt.register(name, rb, placement="per_rank")
    result = ckpt.load(path)
    assert result.loaded == set(ours)
    both = {k: ours[k] for k in ("prioritized", "memmap_nested")}
    # where ours differs from torchrl's load, ours matches the saved buffer: torchrl's load leaves the max priority
    # (a float32 and an int64 tensor when saved) as the Python floats its JSON holds, and drops the batches a
    # SamplerWithoutReplacement has left (ours derives them from the saved sample list)
    versus_torchrl = _same(_audit({k: by_torchrl[k] for k in both}), _audit(both))
    assert [d.split(":")[0] for d in versus_torchrl] == [
        "prioritized._sampler._max_priority[0]",
        "prioritized._sampler._max_priority[1]",
        "memmap_nested._sampler._remaining_batches",
    ]
    differences = _same(_audit(saved), _audit(ours))
    assert [d for d in differences if not any(a in d for a in NOT_IN_TORCHRL_DUMPS)] == []
    for name in ours:  # and the buffers sample as the saved ones do
        torch.manual_seed(5), np.random.seed(5), random.seed(5)
        a = saved[name].sample()
        torch.manual_seed(5), np.random.seed(5), random.seed(5)
        b = ours[name].sample()
        assert (a == b).all()


@pytest.mark.parametrize("into", ["GlobalRNGState", "RNGState"])
def test_global_rng_state_is_restored(tmp_path: Path, into: str) -> None:
    """torchrl's ``GlobalRNGState`` loads into one, and into our ``RNGState`` (what a bound torchrl ``Trainer``
    registers: it failed with a TypeError, its layout is torchrl's); the streams continue either way."""
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1)  # Python's cached Gaussian is part of the state
    path = Checkpoint(rng=GlobalRNGState()).save(tmp_path / "ckpt")
    expected = (random.random(), np.random.rand(), torch.rand(2), random.gauss(0, 1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    tdcp.DistributedCheckpoint(rng=GlobalRNGState() if into == "GlobalRNGState" else tdcp.RNGState()).load(path)
    got = (random.random(), np.random.rand(), torch.rand(2), random.gauss(0, 1))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2]) and got[3] == expected[3]


@pytest.mark.parametrize("payload", ["directory", "archive", "consolidated"])
def test_every_tensordict_payload_format_loads(tmp_path: Path, payload: str) -> None:
    saved = _trained()["policy"]
    ckpt = Checkpoint()
    ckpt.register("policy", saved, adapter=StateDictCheckpointAdapter(payload))
    path = ckpt.save(tmp_path / "ckpt")
    target = _fresh()["policy"]
    tdcp.DistributedCheckpoint(policy=target).load(path)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), target.state_dict().values()))


@pytest.mark.parametrize("payload", ["directory", "archive", "consolidated"])
def test_tensors_of_any_size_load_from_every_payload_format(tmp_path: Path, payload: str) -> None:
    """An optimizer (its 0-d ``step``: 4 bytes, padded to 8 in a consolidated file), a bool buffer of 3 bytes and a
    buffer without elements (no file written for it): each loads as torchrl loads it (they were refused as
    damaged)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model.register_buffer("empty", torch.empty(0, 3))
    model.register_buffer("flags", torch.tensor([True, False, True]))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    ckpt = Checkpoint()
    ckpt.register("model", model, adapter=StateDictCheckpointAdapter(payload))
    ckpt.register("optim", optim, adapter=StateDictCheckpointAdapter(payload))
    path = ckpt.save(tmp_path / "ckpt")
    target = torch.nn.Linear(3, 2)
    target.register_buffer("empty", torch.ones(0, 3))
    target.register_buffer("flags", torch.zeros(3, dtype=torch.bool))
    target_optim = torch.optim.Adam(target.parameters())
    tdcp.DistributedCheckpoint(model=target, optim=target_optim).load(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    assert repr(target_optim.state_dict()) == repr(optim.state_dict())
    tdcp.verify(path)


def test_a_torch_pickle_payload_is_refused_unread(tmp_path: Path) -> None:
    ckpt = Checkpoint()
    ckpt.register("policy", _trained()["policy"], adapter=StateDictCheckpointAdapter("torch"))
    path = ckpt.save(tmp_path / "ckpt")
    target = _fresh()["policy"]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(tdcp.CheckpointFormatError, match="state.pt.*pickle"):
        tdcp.DistributedCheckpoint(policy=target).load(path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_trainer_style_components_and_a_trainer_state(tmp_path: Path) -> None:
    """What torchrl's Trainer registers (policy, optimizer, replay_buffer, trainer_state) maps by name."""

    class Counters:
        def __init__(self, n: int) -> None:
            self.n = n

        def state_dict(self) -> dict[str, int]:
            return {"collected_frames": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["collected_frames"]

    saved = _trained()
    rb = _buffers(fill=True)["prioritized"]
    path = Checkpoint(
        policy=saved["policy"], optimizer=saved["optimizer"], replay_buffer=rb, trainer_state=Counters(96)
    ).save(tmp_path / "ckpt")
    fresh = _fresh()
    counters = Counters(0)
    tdcp.DistributedCheckpoint(
        policy=fresh["policy"], optimizer=fresh["optimizer"], replay_buffer=_buffers(fill=False)["prioritized"],
        trainer_state=counters,
    ).load(path, components=["policy", "optimizer", "replay_buffer", "trainer_state"])  # fmt: skip
    assert counters.n == 96


def test_our_errors_are_torchrl_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):  # torchrl's class: code written for torchrl's checkpoints catches ours
        tdcp.DistributedCheckpoint(policy=_module()).load(tmp_path / "absent")
    assert issubclass(tdcp.CheckpointFormatError, CheckpointError)
    err = tdcp.CheckpointError("x", path="p", result="r")
    assert (err.path, err.result, err.message) == ("p", "r", "x")


def test_a_failure_while_restoring_rolls_back_what_was_restored(tmp_path: Path) -> None:
    class Refuses:  # takes its own state back (the rollback), refuses the saved one
        def __init__(self, a: int) -> None:
            self.a = a

        def state_dict(self) -> dict[str, int]:
            return {"a": self.a}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            if sd["a"] == 1:
                raise RuntimeError("refused by the object")
            self.a = sd["a"]

    saved = _trained()
    path = Checkpoint(policy=saved["policy"], zzz=Refuses(1)).save(tmp_path / "ckpt")
    target = _fresh()["policy"]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(tdcp.CheckpointError, match="refused by the object.*rolled back"):
        tdcp.DistributedCheckpoint(policy=target, zzz=Refuses(0)).load(path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_missing_and_incompatible_components_follow_strict(tmp_path: Path) -> None:
    path = Checkpoint(policy=_trained()["policy"]).save(tmp_path / "ckpt")
    with pytest.raises(tdcp.CheckpointError, match="missing"):
        tdcp.DistributedCheckpoint(policy=_module(), extra=torch.nn.Linear(1, 1)).load(path)
    with pytest.warns(tdcp.PartialLoadWarning):
        r = tdcp.DistributedCheckpoint(policy=_module(), extra=torch.nn.Linear(1, 1)).load(path, strict="warn")
    assert r.loaded == {"policy"} and r.missing == {"extra"}


def test_unsupported_buffer_parts_are_refused_naming_the_class(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(12), sampler=SliceSampler(num_slices=2), batch_size=4)
    rb.extend(TensorDict({"x": torch.randn(6, 1), "episode": torch.zeros(6, dtype=torch.long)}, [6]))
    path = Checkpoint(rb=rb).save(tmp_path / "ckpt")
    fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(12), sampler=SliceSampler(num_slices=2), batch_size=4)
    with pytest.raises(tdcp.CheckpointError, match="SliceSampler sampler cannot be imported"):
        tdcp.DistributedCheckpoint(rb=fresh).load(path)


# ---------------------------------------------------------------------- forgeries
def _forge_json(path: Path, member: str, edit) -> None:
    f = path / member
    f.write_text(json.dumps(edit(json.loads(f.read_text()))))


def _policy_ckpt(tmp_path: Path) -> Path:
    return Checkpoint(policy=_trained()["policy"]).save(tmp_path / "ckpt")


def test_a_tensor_file_of_the_wrong_size_is_refused_naming_it(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    f = next((path / "components").glob("*/state/tensor_00000000.memmap"))
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(tdcp.CheckpointIntegrityError, match="tensor_00000000.memmap"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


def test_a_foreign_tensordict_class_is_not_imported(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    member = next((path / "components").glob("*/state/meta.json")).relative_to(path).as_posix()
    _forge_json(path, member, lambda m: {**m, "_type": "<class 'os._wrap_close'>"})
    with pytest.raises(tdcp.CheckpointFormatError, match="only plain TensorDicts"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


def test_a_schema_naming_an_absent_tensor_or_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    member = next((path / "components").glob("*/state.json")).relative_to(path).as_posix()
    original = (path / member).read_text()
    _forge_json(path, member, lambda s: {**s, "items": s["items"] + [[{"kind": "value", "value": "w"}, {"kind": "tensor", "key": "tensor_99", "device": "cpu"}]]})  # fmt: skip
    with pytest.raises(tdcp.CheckpointFormatError, match="tensor_99"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)
    (path / member).write_text(original.replace('"kind":"ordered_dict"', '"kind":"global"', 1))
    with pytest.raises(tdcp.CheckpointFormatError, match="unknown schema kind 'global'"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


class _Values:
    def state_dict(self) -> dict:
        return {"a": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize(
    "node",
    [
        {"kind": "torch_device", "value": "nodev:7"},
        {"kind": "numpy_scalar", "dtype": "<i1", "value": 100000},
        {"kind": "numpy_scalar", "dtype": "<f8", "value": 10**400},
        {"kind": "dict", "items": [], "metadata": {"kind": "value", "value": 1}},
    ],
    ids=["device", "int8 overflow", "float overflow", "dict metadata"],
)
def test_a_schema_value_its_constructor_refuses_is_a_format_error_naming_the_schema(tmp_path: Path, node: dict) -> None:
    """Values torch or numpy refuse to build (a device "nodev:7", an int8 of 100000, an int past a float, metadata
    on a plain dict) raised their own RuntimeError, OverflowError or AttributeError from ``verify``, and a load's
    error named no file."""
    path = Checkpoint(s=_Values()).save(tmp_path / "c")
    member = next((path / "components").glob("*/state.json")).relative_to(path).as_posix()
    _forge_json(path, member, lambda s: {**s, "items": [[s["items"][0][0], node]]})
    for call in (lambda: tdcp.verify(path), lambda: tdcp.DistributedCheckpoint(s=_Values()).load(path)):
        with pytest.raises(tdcp.CheckpointFormatError, match=r"state\.json.*schema node is malformed"):
            call()


@pytest.mark.parametrize("bad", ["../outside", "/etc/passwd", "components/../../x"])
def test_a_member_path_out_of_the_checkpoint_is_refused(tmp_path: Path, bad: str) -> None:
    path = _policy_ckpt(tmp_path)
    _forge_json(path, "manifest.json", lambda m: {**m, "components": {"policy": {**m["components"]["policy"], "path": bad}}})  # fmt: skip
    with pytest.raises(tdcp.CheckpointFormatError, match="unsafe member name"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


def test_a_linked_tensor_file_is_refused(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    f = next((path / "components").glob("*/state/tensor_00000000.memmap"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(tdcp.CheckpointFormatError, match="not a regular file"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


class _Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_prefetch_pickle_that_would_run_code_is_refused_unread(tmp_path: Path, capsys) -> None:
    path = Checkpoint(rb=_buffers(fill=True)["prioritized"]).save(tmp_path / "ckpt")
    pkl = next((path / "components").glob("*/prefetch.pkl"))
    pkl.write_bytes(pickle.dumps({"version": 1, "capacity": 0, "queue": (_Boom(),)}))
    _forge_size(path, pkl)
    fresh = _buffers(fill=False)["prioritized"]
    with pytest.raises(tdcp.CheckpointFormatError, match="prefetch.pkl holds a .*opcode"):
        tdcp.DistributedCheckpoint(rb=fresh).load(path)
    with pytest.raises(tdcp.CheckpointFormatError, match="prefetch.pkl holds a .*opcode"):
        tdcp.verify(path)  # (it said OK: it never read the file a load refuses)
    assert "must never run" not in capsys.readouterr().out
    assert len(fresh) == 0


def _forge_size(path: Path, f: Path) -> None:
    """torchrl's manifest lists files without sizes or checksums: nothing to reseal (kept for clarity)."""
    assert f.relative_to(path)


def test_buffer_transforms_saved_as_a_pickle_are_refused(tmp_path: Path) -> None:
    path = Checkpoint(rb=_buffers(fill=True)["prioritized"]).save(tmp_path / "ckpt")
    folder = next((path / "components").glob("*-rb"))
    (folder / "transform.t").write_bytes(pickle.dumps({"x": 1}))
    _forge_json(path, "manifest.json", lambda m: {**m, "components": {"rb": {**m["components"]["rb"], "files": m["components"]["rb"]["files"] + ["transform.t"]}}})  # fmt: skip
    with pytest.raises(tdcp.CheckpointFormatError, match="transforms were saved with torch.save"):
        tdcp.DistributedCheckpoint(rb=_buffers(fill=False)["prioritized"]).load(path)
    with pytest.raises(tdcp.CheckpointFormatError, match="transforms were saved with torch.save"):
        tdcp.verify(path)


def test_a_newer_format_and_a_malformed_record_are_refused(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    _forge_json(path, "manifest.json", lambda m: {**m, "format_version": 2})
    with pytest.raises(tdcp.CheckpointFormatError, match="format version 2"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)
    _forge_json(path, "manifest.json", lambda m: {**m, "format_version": 1, "components": {"policy": {"adapter": 1}}})
    with pytest.raises(tdcp.CheckpointFormatError, match="malformed record"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


def test_an_archive_member_out_of_bounds_is_refused(tmp_path: Path) -> None:
    path = Checkpoint(policy=_trained()["policy"]).save(tmp_path / "run.torchrl", format="archive")
    forged = tmp_path / "forged.torchrl"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(forged, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("tensor_00000001.memmap"):
                data = data + b"\0" * 8
            dst.writestr(info, data)
    with pytest.raises(tdcp.CheckpointIntegrityError, match="tensor_00000001.memmap"):
        tdcp.DistributedCheckpoint(policy=_module()).load(forged)


# ---------------------------------------------------------------------- tools
def test_verify_refuses_a_torchrl_adapter_version_no_load_reads(tmp_path: Path) -> None:
    """A record saying ``adapter_version: 2``: every load refuses it ("version 2 is not read"), ``verify`` said
    intact; a step of ``true`` was shown as a step."""
    path = _policy_ckpt(tmp_path)
    _forge_json(path, "manifest.json", lambda m: {**m, "metadata": {"step": True}, "components": {
        n: {**r, "adapter_version": 2} for n, r in m["components"].items()}})  # fmt: skip
    with pytest.raises(tdcp.CheckpointFormatError, match="version 2 is not read"):
        tdcp.verify(path)
    from torchrl_dcp.torchrl_format.importer import inspect_torchrl

    assert inspect_torchrl(path)["step"] is None


def test_verify_and_inspect_read_torchrl_checkpoints(tmp_path: Path) -> None:
    path = _save(tmp_path, "directory", **_trained(), rb=_buffers(fill=True)["prioritized"])
    summary = tdcp.verify(path)
    assert summary["tensors"] > 0 and "no checksums" in summary["unchecked"][0]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    next((copy / "components").glob("*-policy/state/tensor_00000002.memmap")).write_bytes(b"")
    with pytest.raises(tdcp.CheckpointIntegrityError, match="tensor_00000002.memmap"):
        tdcp.verify(copy)


def test_the_cli_inspects_and_verifies_torchrl_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from torchrl_dcp.cli import main

    for container in ("directory", "archive"):
        path = _save(tmp_path / container, container, **_trained(), stats={"episodes": 3})
        assert main(["--json", "inspect", str(path)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["container"] == f"torchrl.checkpoint {container}" and info["step"] == 30
        assert info["components"]["policy"]["adapter"] == "torchrl.state_dict"
        assert main(["verify", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("OK ") and "not checked: torchrl.checkpoint format: no checksums" in out
    member = next((tmp_path / "directory" / "ckpt" / "components").glob("*-policy/state/tensor_00000000.memmap"))
    member.write_bytes(b"\0")
    assert main(["verify", str(tmp_path / "directory" / "ckpt")]) == 1
    assert "tensor_00000000.memmap" in capsys.readouterr().err


def test_components_no_object_is_registered_for_are_named(tmp_path: Path) -> None:
    path = Checkpoint(policy=_trained()["policy"], stats={"episodes": 1}).save(tmp_path / "ckpt")
    with pytest.warns(tdcp.UnrestoredComponentWarning, match=r"\['stats'\]"):
        result = tdcp.DistributedCheckpoint(policy=_module()).load(path)
    assert result.unrequested == {"stats"}


def test_detection_follows_no_link_and_opens_no_fifo(tmp_path: Path) -> None:
    """Telling a torchrl checkpoint apart reads a manifest.json only as a regular file inside the directory; a link
    the user names (to an archive, as to a directory) is read as what it names (it was taken for a damaged archive
    of ours: "member is in a sub-directory")."""
    import os

    from torchrl_dcp.torchrl_format import is_torchrl_checkpoint

    theirs = _policy_ckpt(tmp_path)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "manifest.json").symlink_to(theirs / "manifest.json")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "manifest.json")
    archive_link = tmp_path / "link.torchrl"
    archive_link.symlink_to(Checkpoint(p=_module()).save(tmp_path / "a.torchrl", format="archive"))
    assert is_torchrl_checkpoint(theirs) and is_torchrl_checkpoint(tmp_path / "a.torchrl")
    assert is_torchrl_checkpoint(archive_link) and is_torchrl_checkpoint(f"file://{tmp_path / 'a.torchrl'}")
    assert not any(is_torchrl_checkpoint(p) for p in (linked, fifo, "s3://bucket/run"))


def test_with_strict_warn_a_failing_component_is_skipped_as_it_was(tmp_path: Path) -> None:
    class HalfLoads:  # changes itself, then refuses
        def __init__(self, a: int) -> None:
            self.a, self.b = a, a

        def state_dict(self) -> dict[str, int]:
            return {"a": self.a, "b": self.b}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.a = sd["a"]
            if sd["b"] == 1:
                raise RuntimeError("refused half-way")
            self.b = sd["b"]

    path = Checkpoint(policy=_trained()["policy"], obj=HalfLoads(1)).save(tmp_path / "ckpt")
    obj, target = HalfLoads(0), _fresh()["policy"]
    with pytest.warns(tdcp.PartialLoadWarning, match="refused half-way"):
        result = tdcp.DistributedCheckpoint(policy=target, obj=obj).load(path, strict="warn")
    assert result.loaded == {"policy"} and "obj" in result.incompatible
    assert (obj.a, obj.b) == (0, 0)  # rolled back, not left half-loaded


def test_a_schema_dense_in_json_values_or_nested_too_deep_is_refused_naming_it(tmp_path: Path) -> None:
    path = _policy_ckpt(tmp_path)
    schema = next((path / "components").glob("*/state.json"))
    schema.write_bytes(b"[" + b"{}," * (12 << 20) + b"{}]")  # 36 MiB of empty objects: ~24x that once parsed
    with pytest.raises(tdcp.CheckpointFormatError, match="state.json.*refused before parsing"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)
    schema.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(tdcp.CheckpointFormatError, match="state.json: not valid JSON"):
        tdcp.DistributedCheckpoint(policy=_module()).load(path)


def _rezip(path: Path, compression: int, patch=lambda b: b) -> None:
    """Rewrite the ZIP at ``path`` with its members compressed as given, then ``patch`` its bytes."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=compression) as z:
        for name, data in members:
            z.writestr(name, data)
    path.write_bytes(patch(tmp.read_bytes()))
    tmp.unlink()


def _flip_after(marker: bytes, skip: int = 40, n: int = 8):
    def patch(data: bytes) -> bytes:
        at = data.index(marker) + len(marker) + skip
        return data[:at] + bytes(b ^ 0x5A for b in data[at : at + n]) + data[at + n :]

    return patch


def _set_flag(data: bytes) -> bytes:  # the "encrypted" bit of every entry, local and central
    out = bytearray(data)
    for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        i = 0
        while (i := out.find(sig, i)) >= 0:
            out[i + at] |= 1
            i += 4
    return bytes(out)


@pytest.mark.parametrize(
    "damage",
    ["tdz-deflate-stream", "tdz-encrypted", "archive-bit-flip", "archive-lzma-stream", "schema-too-deep"],
)
def test_damage_a_zip_or_a_schema_holds_is_refused_naming_the_file(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    """Whatever way a member's bytes fail to come out of a ZIP (torchrl's ``state.tdz``, a ``.torchrl`` archive: a
    CRC that does not match, a damaged deflate stream, encryption) or a schema is nested past what is decoded, ``load``,
    ``verify`` and the command line refuse it with a CheckpointError naming the file, nothing restored."""
    if damage.startswith("tdz"):
        ckpt = Checkpoint()
        ckpt.register("policy", _trained()["policy"], adapter=StateDictCheckpointAdapter("archive"))
        path = ckpt.save(tmp_path / "ckpt")
        tdz = next((path / "components").glob("*/state.tdz"))
        patch = _flip_after(b"meta.json", 2) if damage == "tdz-deflate-stream" else _set_flag
        _rezip(tdz, zipfile.ZIP_DEFLATED, patch)
        named = "state.tdz"
    elif damage == "archive-bit-flip":
        path = Checkpoint(policy=_trained()["policy"]).save(tmp_path / "run.torchrl", format="archive")
        path.write_bytes(_flip_after(b"tensor_00000000.memmap")(path.read_bytes()))
        named = "tensor_00000000.memmap"
    elif damage == "archive-lzma-stream":  # (zipfile raises lzma's own error for it: it left verify as an LZMAError)
        path = Checkpoint(policy=_trained()["policy"]).save(tmp_path / "run.torchrl", format="archive")
        _rezip(path, zipfile.ZIP_LZMA, _flip_after(b"tensor_00000000.memmap", 4))
        named = "tensor_00000000.memmap"
    else:
        path = _policy_ckpt(tmp_path)
        member = next((path / "components").glob("*/state.json"))
        deep = '{"kind":"list","items":[' * 300 + '{"kind":"value","value":1}' + "]}" * 300
        original = json.loads(member.read_text())  # wrapped with a list nested 300 deep
        member.write_text(json.dumps({"kind": "list", "items": [original, json.loads(deep)]}))
        named = "state.json"
    live = _module()
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(tdcp.CheckpointError, match=named):
        tdcp.DistributedCheckpoint(policy=live).load(path)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    with pytest.raises(tdcp.CheckpointError, match=named):
        tdcp.verify(path)
    from torchrl_dcp.cli import main

    assert main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert named in err and "please report" not in err


@pytest.mark.parametrize(
    "buffer, damaged",
    [
        ("prioritized", "storage/obs.memmap"),
        ("prioritized", "sampler/sumtree.memmap"),
        ("memmap_nested", "storage/next/x.memmap"),
    ],
)
def test_verify_checks_the_sizes_of_a_dumped_buffers_files(tmp_path: Path, buffer: str, damaged: str) -> None:
    """A dumped replay buffer has no live buffer to be read into during ``verify``: its tensor files are still
    checked against their descriptions (a truncated storage or tree passed ``verify``, only a load refused it)."""
    path = Checkpoint(rb=_buffers(fill=True)[buffer]).save(tmp_path / "ckpt")
    tdcp.verify(path)  # intact: passes
    target = next((path / "components").glob(f"*-rb/{damaged}"))
    target.write_bytes(target.read_bytes()[:8])
    with pytest.raises(tdcp.CheckpointIntegrityError, match=f"{damaged.split('/')[-1]}: holds 8 bytes"):
        tdcp.verify(path)


@pytest.mark.parametrize(
    "saved, live",
    [("prioritized", SamplerWithoutReplacement), ("plain_tensor", PrioritizedSampler), ("prioritized", RandomSampler)],
)
def test_a_dumped_buffer_into_one_of_another_sampler_is_incompatible_not_foreign(
    tmp_path: Path, saved: str, live: type
) -> None:
    """The sampler a dumped buffer had is known from the files its dump wrote: another one in the live buffer is an
    IncompatibleComponentError naming both (``strict='warn'`` skips it), not a foreign checkpoint (nor, for a
    ``RandomSampler``, a load that silently drops the priorities)."""
    buffer = _buffers(fill=True)[saved]
    path = Checkpoint(rb=buffer).save(tmp_path / "ckpt")
    rows = buffer.storage.max_size
    sampler = live(rows, 0.7, 0.5) if live is PrioritizedSampler else live()
    target = type(buffer)(storage=LazyTensorStorage(rows), sampler=sampler, batch_size=4)
    with pytest.raises(tdcp.IncompatibleComponentError, match=f"sampler was .*, the buffer has {live.__name__}"):
        tdcp.DistributedCheckpoint(rb=target).load(path)
    with pytest.warns(tdcp.PartialLoadWarning):
        result = tdcp.DistributedCheckpoint(rb=target).load(path, strict="warn")
    assert "rb" in result.incompatible and len(target) == 0


class _Actor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.full((1,), 0.5))

    def forward(self, th: torch.Tensor) -> torch.Tensor:
        return (th.unsqueeze(-1) * self.gain).clamp(-2.0, 2.0)


def _collector(policy: bool) -> Any:  # (a StepCounter: state in the env's state_dict)
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv, StepCounter, TransformedEnv

    env = TransformedEnv(PendulumEnv(), StepCounter(max_steps=20))
    env.set_seed(0)
    module = None
    if policy:
        from tensordict.nn import TensorDictModule

        module = TensorDictModule(_Actor(), in_keys=["th"], out_keys=["action"])
    return Collector(env, module, frames_per_batch=4, total_frames=-1)


@pytest.mark.parametrize("policy", [True, False])
def test_an_imported_collector_or_env_is_said_to_go_on_differently(tmp_path: Path, policy: bool) -> None:
    """torchrl.checkpoint saves a collector's (an env's) state_dict() only: the step in flight and the env's
    generators are not in it, and the import continued differently from the saved run, silently. It is now named in
    an InexactResumeWarning; a collector without policy state (``Collector(env, None)``) is loaded as our own
    format loads it (torchrl's strict load refused it: "Underlying policy does not have state_dict")."""
    collector = _collector(policy)
    next(iter(collector))
    path = Checkpoint(collector=collector, env=collector.env).save(tmp_path / "ckpt")
    fresh = _collector(policy)
    with pytest.warns(
        tdcp.InexactResumeWarning, match=r"'collector' \(importing a torchrl.checkpoint\).*step in flight"
    ):
        with pytest.warns(tdcp.InexactResumeWarning, match=r"'env' \(importing.*the env's generators"):
            result = tdcp.DistributedCheckpoint(no_dist=True, collector=fresh, env=fresh.env).load(path)
    assert result.loaded == {"collector", "env"}
    saved, loaded = collector.state_dict(), fresh.state_dict()
    assert json.dumps(sorted(saved), default=str) == json.dumps(sorted(loaded), default=str)
    collector.shutdown()
    fresh.shutdown()


@pytest.mark.parametrize("entry", [".", "..", ""])
def test_a_memmap_folder_entry_naming_no_entry_is_refused_naming_its_file(tmp_path: Path, entry: str) -> None:
    """A dumped buffer's ``storage/meta.json`` holding a nested entry named ``.``: the load read the same folder
    again without end ("RecursionError"), naming neither file nor entry, and ``verify`` said it was fine."""
    rb = _buffers(fill=True)["memmap_nested"]
    path = _save(tmp_path, "directory", rb=rb)
    meta = next((path / "components").glob("*/storage/meta.json"))
    data = json.loads(meta.read_text())
    data[entry] = {"shape": [5], "batch_size": [5], "_type": "<class 'tensordict._td.TensorDict'>"}
    meta.write_text(json.dumps(data))
    why = f"entry name {entry!r} names no entry"
    with pytest.raises(tdcp.CheckpointFormatError, match=why) as err:
        tdcp.DistributedCheckpoint(no_dist=True, rb=_buffers(fill=False)["memmap_nested"]).load(path)
    assert str(err.value.path).endswith("meta.json")
    with pytest.raises(tdcp.CheckpointFormatError, match=why):
        tdcp.verify(path)


@pytest.mark.parametrize("comment", [b"run 7", b"PK\x05\x06 inside"], ids=["plain", "holding-an-end-record-signature"])
def test_a_torchrl_archive_with_an_archive_comment(tmp_path: Path, comment: bytes) -> None:
    """A ``torchrl.checkpoint`` archive given a comment by another tool (``zip -z``): torchrl reads it, and so do
    we (one file, one reading: the end record zipfile takes, its comment filling the rest of the file). A comment
    holding an end record's signature makes zipfile take that one: refused, never read two ways."""
    policy = _trained()["policy"]
    path = Checkpoint(policy=policy).save(tmp_path / "run.torchrl", format="archive")
    with zipfile.ZipFile(path, "a") as z:
        z.comment = comment
    live = _module()
    if b"PK" in comment:
        with pytest.raises(tdcp.CheckpointError):
            tdcp.DistributedCheckpoint(policy=live).load(path)
        return
    tdcp.DistributedCheckpoint(policy=live).load(path)
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), policy.state_dict().values()))
    assert tdcp.verify(path)
