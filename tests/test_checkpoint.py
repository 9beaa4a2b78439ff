"""DistributedCheckpoint in one process (a world of one, no process group)."""

from __future__ import annotations

import datetime
import json
import random
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import torchrl_dcp as tdcp
from torchrl_dcp.adapters import Adapter
from torchrl_dcp.format import rank_table
from torchrl_dcp.format.manifest import seal


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, 3)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        optim.step()
        sched.step()
    return model, optim, sched


def fresh(seed: int = 1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, 7)


def test_round_trip_into_fresh_objects_continues_identically(tmp_path: Path) -> None:
    model, optim, sched = trained()
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optim, scheduler=sched)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "c", step=2, metadata={"note": "x"})
    expected_draws = (torch.rand(2), random.random(), np.random.rand())
    x = torch.randn(5, 3)
    optim.zero_grad()
    model(x).sum().backward()
    optim.step()
    sched.step()

    m2, o2, s2 = fresh()
    ck2 = tdcp.DistributedCheckpoint(model=m2, optimizer=o2, scheduler=s2)
    ck2.register("rng", tdcp.RNGState())
    result = ck2.load(path)
    assert result.loaded == {"model", "optimizer", "scheduler", "rng"} and result.step == 2
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == (
        expected_draws[0].tolist(),
        *expected_draws[1:],
    )
    assert torch.equal(torch.randn(5, 3), x)
    o2.zero_grad()
    m2(x).sum().backward()
    o2.step()
    s2.step()
    for a, b in zip(model.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert sched.state_dict() == s2.state_dict()
    assert result.manifest["metadata"] == {"note": "x"}


def test_layout_and_manifest(tmp_path: Path) -> None:
    model, optim, _ = trained()
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optim)
    ckpt.register("stats", {"episodes": 3}, placement="per_rank")
    path = ckpt.save(tmp_path / "c", step=5)
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_shared.distcp", "manifest-0.json", "manifest.json"]
    m = json.loads((path / "manifest.json").read_text())  # the root
    assert m["format"] == "torchrl_dcp" and m["format_version"] == 8 and m["world_size"] == 1
    assert m["sharded"] is True
    assert set(m["versions"]) == {"torch", "tensordict", "torchrl", "torchrl_dcp"}
    assert m["components"]["model"]["placement"] == "replicated"
    assert m["components"]["stats"]["placement"] == "per_rank"
    assert "ranks" not in m["components"]["stats"] and "inventory" not in m["components"]["stats"]
    assert set(m["files"]) == {".metadata", "__0_shared.distcp"}  # replicated tensors only (the shard: rank_table)
    assert all(f["checksum"].startswith("crc32:") for f in m["files"].values())
    replicated = {k for name in ("model", "optimizer") for k in m["components"][name]["inventory"]}
    assert {e[0] for e in m["index"]["entries"]} == replicated  # where the root's tensors' records are
    assert all(e[1] == "__0_shared.distcp" and e[2] >= 0 and e[3] > 0 for e in m["index"]["entries"])
    shard = json.loads((path / "manifest-0.json").read_text())  # rank 0's per-rank states
    assert shard["format"] == "torchrl_dcp.shard" and shard["format_version"] == 7
    shard_bytes = (path / "manifest-0.json").read_bytes()
    assert shard["files"] == {} and rank_table.rows(m) == [  # its per-rank state holds no tensor
        rank_table.RankRow(len(shard_bytes), zlib.crc32(shard_bytes), 0, 0)
    ]
    assert m["rank_table"]["shard_version"] == 7
    assert shard["rank"] == 0 and shard["save_id"] == m["save_id"]
    assert shard["components"]["stats"] == {"state": {"t": "dict", "items": [["episodes", 3]]}, "inventory": {}}
    assert tdcp.read_manifest(path)["components"]["stats"]["ranks"]["0"]["state"]["items"] == [["episodes", 3]]


def test_replicated_and_per_rank_tensors_are_in_files_of_their_own(tmp_path: Path) -> None:
    """Format 6: a rank's per-rank tensors are in ``__<rank>_0.distcp``, the replicated ones it writes in
    ``__<rank>_shared.distcp`` (every rank reads those, and none reads another rank's per-rank bytes); plain
    ``dcp.load`` still reads every key from both."""
    import torch.distributed.checkpoint as dcp

    policy = torch.nn.Linear(3, 2)
    own = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("own", own, placement="per_rank")
    path = ckpt.save(tmp_path / "c")
    m = tdcp.read_manifest(path)
    where = {e[0]: e[1] for e in m["index"]["entries"]}  # the root's and the shard's storage entries
    assert where == {
        "replicated/policy/weight": "__0_shared.distcp",
        "replicated/policy/bias": "__0_shared.distcp",
        "rank/0/own/a": "__0_0.distcp",
        "rank/0/own/b": "__0_0.distcp",
    }
    flat = {k: torch.zeros(t["shape"]) for c in m["components"].values() for k, t in c["inventory"].items()}
    dcp.load(flat, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(flat["replicated/policy/weight"], policy.weight) and torch.equal(flat["rank/0/own/a"], own["a"])
    assert tdcp.verify(path)["files"] == 4  # .metadata, both data files, the shard


def test_plain_dcp_load_finds_tensors_under_documented_keys(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _, _ = trained()
    path = tdcp.DistributedCheckpoint(model=model).save(tmp_path / "c")
    target = {"replicated/model/0.weight": torch.empty(8, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(target["replicated/model/0.weight"], model[0].weight)


def test_partial_load_and_unrequested(tmp_path: Path) -> None:
    model, optim, _ = trained()
    path = tdcp.DistributedCheckpoint(model=model, optimizer=optim).save(tmp_path / "c")
    m2, o2, _ = fresh()
    before = dict(o2.state_dict()["param_groups"][0])
    result = tdcp.DistributedCheckpoint(model=m2, optimizer=o2).load(path, components=["model"])
    assert result.loaded == {"model"} and result.unrequested == {"optimizer"}
    assert torch.equal(m2[0].weight, model[0].weight)
    assert o2.state_dict()["param_groups"][0]["lr"] == before["lr"]


def test_strictness_modes(tmp_path: Path) -> None:
    model, _, _ = trained()
    path = tdcp.DistributedCheckpoint(model=model).save(tmp_path / "c")
    other = torch.nn.Linear(2, 2)
    before = other.weight.clone()
    ck = tdcp.DistributedCheckpoint(model=torch.nn.Linear(3, 3), extra={"a": 1})
    ck.unregister("model")
    ck.register("model", other)
    with pytest.raises(tdcp.IncompatibleComponentError, match="extra") as info:
        ck.load(path)
    assert info.value.result.missing == {"extra"}
    assert torch.equal(other.weight, before)  # nothing changed
    with pytest.warns(UserWarning, match="missing"):
        result = ck.load(path, strict="warn", components=["extra"])
    assert result.missing == {"extra"} and not result.loaded
    result = ck.load(path, strict="ignore")
    assert result.missing == {"extra"} and "model" in result.incompatible
    assert torch.equal(other.weight, before)
    with pytest.raises(ValueError):
        ck.load(path, strict="maybe")  # type: ignore[arg-type]


def test_shape_change_is_incompatible_and_leaves_object_unchanged(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(w={"x": torch.ones(3)}).save(tmp_path / "c")
    m = torch.nn.Linear(3, 2)
    path2 = tdcp.DistributedCheckpoint(m=m).save(tmp_path / "d")
    target = torch.nn.Linear(4, 2)
    before = target.weight.clone()
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(m=target).load(path2)
    assert torch.equal(target.weight, before)
    assert tdcp.DistributedCheckpoint(w={}).load(path).values["w"]["x"].tolist() == [1, 1, 1]


def test_json_values_and_tensordict(tmp_path: Path) -> None:
    stats = {"episodes": 3, "names": ["a", "b"], "best": None}
    td = TensorDict({"obs": torch.randn(4, 3), "nested": {"r": torch.ones(4, 1)}}, batch_size=[4])
    td.set_non_tensor("tag", "hello")
    path = tdcp.DistributedCheckpoint(stats=stats, td=td, counter=7).save(tmp_path / "c")
    stats2, td2 = {}, TensorDict({"old": torch.zeros(2)}, batch_size=[2])
    result = tdcp.DistributedCheckpoint(stats=stats2, td=td2, counter=0).load(path)
    assert stats2 == stats and result.values["counter"] == 7
    assert td2.batch_size == (4,) and "old" not in td2.keys()
    assert torch.equal(td2["obs"], td["obs"]) and torch.equal(td2["nested", "r"], td["nested", "r"])
    assert td2.get_non_tensor("tag") == "hello"


def test_a_json_none_is_a_value_of_the_load_result(tmp_path: Path) -> None:
    """A component holding ``None`` (a best score not set yet) is loaded and its value is in ``result.values`` like
    any JSON value (it was listed as loaded but missing from ``values``: ``KeyError``)."""
    path = tdcp.DistributedCheckpoint(best=None, count=5).save(tmp_path / "c")
    result = tdcp.DistributedCheckpoint(best=1.5, count=0).load(path)
    assert result.loaded == {"best", "count"} and result.values == {"best": None, "count": 5}


def test_save_components_and_options(tmp_path: Path) -> None:
    calls = []

    class Thing:
        def state_dict(self, *args, **kwargs):
            calls.append(("save", args, kwargs))
            return {"v": torch.ones(1)}

        def load_state_dict(self, state, *args, **kwargs):
            calls.append(("load", args, kwargs))

    ck = tdcp.DistributedCheckpoint(save_components=["thing"], thing=Thing(), big={"x": torch.zeros(10)})
    ck.register("opt", Thing(), options=tdcp.CheckpointOptions(save_kwargs={"a": 1}))
    path = ck.save(tmp_path / "c")
    assert set(tdcp.read_manifest(path)["components"]) == {"thing"}
    path = ck.save(
        tmp_path / "d", components=["opt"], component_options={"opt": tdcp.CheckpointOptions(save_kwargs={"b": 2})}
    )
    assert calls[-1] == ("save", (), {"a": 1, "b": 2})
    ck.load(path, components=["opt"], component_options={"opt": tdcp.CheckpointOptions(load_args=(True,))})
    assert calls[-1] == ("load", (True,), {})
    with pytest.raises(KeyError):
        ck.save(tmp_path / "e", components=["nope"])


def test_custom_adapter_per_instance_and_explicit(tmp_path: Path) -> None:
    class Counter:
        def __init__(self, n: int = 0) -> None:
            self.n = n

    class CounterAdapter(Adapter):
        adapter_id = "test.counter"
        default_placement = "per_rank"

        def state(self, obj, ctx):
            return {"n": obj.n}

        def restore(self, obj, state, ctx):
            obj.n = state["n"]

    ck = tdcp.DistributedCheckpoint()
    ck.register_adapter(Counter, CounterAdapter())
    ck.register("c", Counter(5))
    assert ck.placement("c") == "per_rank"
    path = ck.save(tmp_path / "c")
    target = Counter()
    ck2 = tdcp.DistributedCheckpoint()
    ck2.register("c", target, adapter=CounterAdapter())
    ck2.load(path)
    assert target.n == 5
    with pytest.raises(tdcp.CheckpointError, match="no adapter"):
        tdcp.DistributedCheckpoint(c=Counter()).save(tmp_path / "d")


def test_map_location_and_version_skew(tmp_path: Path, caplog) -> None:
    path = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}).save(tmp_path / "c")
    m = json.loads((path / "manifest.json").read_text())
    m["versions"]["torchrl"] = "0.0.1"
    (path / "manifest.json").write_text(json.dumps(seal(m)))
    with caplog.at_level("WARNING", logger="torchrl_dcp"):
        result = tdcp.DistributedCheckpoint(w={}).load(path, map_location="cpu")
    assert result.version_skew and result.comparison["versions"]["torchrl"]["checkpoint"] == "0.0.1"
    assert "torchrl 0.0.1" in caplog.text
    assert result.values["w"]["x"].device.type == "cpu"


@pytest.mark.parametrize(
    "map_location", ["meta", {"cpu": "meta"}, lambda saved: "meta"], ids=["device", "mapping", "callable"]
)
def test_a_load_onto_the_meta_device_is_refused_restoring_nothing(tmp_path: Path, map_location) -> None:
    """``map_location="meta"``: a dict "loaded" tensors that hold no data (reported loaded), an optimizer's load
    called the checkpoint damaged or forged. Refused, naming map_location, every object left as it was."""
    from tensordict import TensorDict

    policy = torch.nn.Linear(2, 2)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.ones(2)).sum().backward()
    optim.step()
    path = tdcp.DistributedCheckpoint(stats={"x": torch.ones(2)}, td=TensorDict(a=torch.ones(3)), opt=optim).save(
        tmp_path / "c"
    )
    stats, td = {"x": torch.zeros(2)}, TensorDict(a=torch.zeros(3))
    optim2 = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    for name, obj in (("stats", stats), ("td", td), ("opt", optim2)):
        with pytest.raises(tdcp.IncompatibleComponentError, match="map_location.*meta device, which holds no data"):
            tdcp.DistributedCheckpoint(**{name: obj}).load(path, map_location=map_location)
    assert torch.equal(stats["x"], torch.zeros(2)) and torch.equal(td["a"], torch.zeros(3)) and not optim2.state


def test_encoding_error_at_save_names_component_and_key(tmp_path: Path) -> None:
    with pytest.raises(tdcp.EncodingError, match=r"stats/bad"):
        tdcp.DistributedCheckpoint(stats={"bad": object()}).save(tmp_path / "c")
    with pytest.raises(tdcp.EncodingError, match="metadata"):
        tdcp.DistributedCheckpoint(w={"x": 1}).save(tmp_path / "c", metadata={"x": object()})
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())


def test_an_optimizer_state_holding_one_tensor_twice_is_refused_at_save(tmp_path: Path) -> None:
    """Optimizer states never share tensors (a load refuses one that does: a forgery), so a save of one that does
    is refused with what to do, instead of writing a checkpoint that can never load; tied module weights still save
    and load tied."""
    policy = torch.nn.Linear(3, 3)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.ones(3)).sum().backward()
    optim.step()
    state = optim.state[policy.weight]
    state["exp_avg_sq"] = state["exp_avg"]
    with pytest.raises(tdcp.EncodingError, match=r"'optim' holds one tensor twice.*clone"):
        tdcp.DistributedCheckpoint(policy=policy, optim=optim).save(tmp_path / "c")
    assert not list(tmp_path.iterdir())
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(2, 2)
    tied.b = torch.nn.Linear(2, 2)
    tied.b.weight = tied.a.weight
    path = tdcp.DistributedCheckpoint(m=tied).save(tmp_path / "tied")
    fresh = torch.nn.Module()
    fresh.a, fresh.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    fresh.b.weight = fresh.a.weight
    tdcp.DistributedCheckpoint(m=fresh).load(path)
    assert torch.equal(fresh.b.weight, tied.a.weight) and fresh.b.weight is fresh.a.weight


def test_overwrite_is_atomic_and_foreign_directories_are_kept(tmp_path: Path) -> None:
    ck = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)})
    path = ck.save(tmp_path / "c", step=1)
    ck.save(path, step=2)
    assert tdcp.read_manifest(path)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(tdcp.CheckpointError, match="not a torchrl_dcp checkpoint"):
        ck.save(foreign)
    assert (foreign / "notes.txt").read_text() == "precious"


def test_stale_staging_is_removed_by_next_save(tmp_path: Path) -> None:
    stale = tmp_path / (".c.tdcp-staging-" + "dead" * 8)
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    tdcp.DistributedCheckpoint(w={"x": 1}).save(tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_register_validation() -> None:
    ck = tdcp.DistributedCheckpoint(a=1)
    with pytest.raises(KeyError):
        ck.register("a", 2)
    for bad in ["", "a/b", "../x", ".hidden"]:
        with pytest.raises(ValueError):
            ck.register(bad, 1)
    with pytest.raises(ValueError):
        ck.register("b", 1, placement="everywhere")  # type: ignore[arg-type]
    assert "a" in ck and ck.components["a"] == 1


def test_the_garbage_collector_is_paused_during_save_and_load_and_restored(tmp_path: Path) -> None:
    import gc

    from torchrl_dcp import _gc

    seen: list[bool] = []

    class Probe:
        def state_dict(self) -> dict:
            seen.append(gc.isenabled())
            return {"w": torch.ones(2)}

        def load_state_dict(self, sd: dict) -> None:
            seen.append(gc.isenabled())

    assert gc.isenabled()
    ckpt = tdcp.DistributedCheckpoint(p=Probe())
    path = ckpt.save(tmp_path / "c")
    ckpt.load(path)
    # save, planning (twice: its own tensors or copies, which are also the rollback snapshot), load
    assert seen == [False, False, False, False] and gc.isenabled()
    with pytest.raises(tdcp.CheckpointError):
        ckpt.load(tmp_path / "absent")
    assert gc.isenabled()  # restored after a failure too
    gc.disable()
    try:
        ckpt.save(tmp_path / "c")
        assert not gc.isenabled()  # a collector the user turned off stays off
    finally:
        gc.enable()
    with _gc.gc_paused():
        with _gc.gc_paused():
            pass
        assert not gc.isenabled()  # nested: still paused until the outer block ends
    assert gc.isenabled()


@pytest.mark.parametrize("layout", ["directory", "archive"])
def test_bool_tensors_of_unset_memory_save_as_loadable_bools(tmp_path: Path, layout: str) -> None:
    """A state_dict may hold bool tensors of memory ``torch.empty`` left unset (bytes other than 0 and 1, e.g. the
    unwritten rows of a storage saved through its own ``state_dict``). Loads refuse such bytes as damage, so the save
    writes 0 and 1 (true where the byte is not 0) instead of a checkpoint that can never load."""

    class Mask:
        def __init__(self, mask: torch.Tensor) -> None:
            self.mask = mask

        def state_dict(self) -> dict:
            return {"mask": self.mask}

        def load_state_dict(self, state: dict) -> None:
            self.mask.copy_(state["mask"])

    unset = torch.tensor([0, 1, 255, 2, 0, 17], dtype=torch.uint8).view(torch.bool)
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("mask", Mask(unset))
    path = ckpt.save(tmp_path / "ckpt")
    if layout == "archive":
        path = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    assert unset.view(torch.uint8).tolist() == [0, 1, 255, 2, 0, 17]  # the saved object is left as it was
    fresh = Mask(torch.zeros(6, dtype=torch.bool))
    restored = tdcp.DistributedCheckpoint()
    restored.register("mask", fresh)
    restored.load(path)
    assert fresh.mask.view(torch.uint8).tolist() == [0, 1, 1, 1, 0, 1]
    tdcp.verify(path)


@pytest.mark.parametrize("step", [200.0, True, "7", torch.tensor(1.5)], ids=["float", "bool", "str", "float-tensor"])
def test_a_step_that_is_no_integer_is_refused_before_anything_is_written(tmp_path: Path, step: object) -> None:
    """The manifest records an integer step: anything else is refused at the call, the checkpoint already at the
    path untouched (it once committed a manifest no load could read, in place of the good one)."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2))
    path = ckpt.save(tmp_path / "latest", step=100)
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TypeError, match="step must be an integer"):
        ckpt.save(path, step=step)
    assert ckpt.load(path).step == 100 and sorted(p.name for p in tmp_path.iterdir()) == listing


def test_integer_steps_of_numpy_and_torch_are_recorded_as_integers(tmp_path: Path) -> None:
    import numpy as np

    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2))
    assert ckpt.load(ckpt.save(tmp_path / "a", step=np.int64(3))).step == 3
    assert ckpt.load(ckpt.save(tmp_path / "b", step=torch.tensor(4))).step == 4
    assert ckpt.load(ckpt.save(tmp_path / "c", metadata={"step": 5})).step == 5


def test_a_metadata_value_json_refuses_is_named_by_its_path(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2))
    with pytest.raises(tdcp.EncodingError, match=r"metadata\['cfg'\]\['deep'\]\[1\] must be JSON-safe"):
        ckpt.save(tmp_path / "a", metadata={"cfg": {"ok": 1, "deep": [2, object()]}})
    # keys of two kinds in one mapping: the manifest sorts them, so the commit failed after every file was written,
    # naming neither the metadata nor the key
    with pytest.raises(tdcp.EncodingError, match=r"metadata\['v'\] must be JSON-safe"):
        ckpt.save(tmp_path / "a", metadata={"v": {1: "a", "b": 2}})
    # a key of one other kind: JSON wrote it as a string, and another key came back ({None: 1} as {"null": 1})
    for key, at in ((None, ""), (1.5, r"\['cfg'\]"), (0, r"\['runs'\]\[0\]")):
        metadata = {None: {key: 1}, 1.5: {"cfg": {key: 1}}, 0: {"runs": [{key: 1}]}}[key]
        with pytest.raises(tdcp.EncodingError, match=rf"metadata{at} must be JSON-safe: key {key!r} is of type"):
            ckpt.save(tmp_path / "a", metadata=metadata)
    assert not (tmp_path / "a").exists()


def test_metadata_that_holds_itself_or_is_no_mapping_is_refused_clearly(tmp_path: Path) -> None:
    """A metadata dict that holds itself failed with a bare ``RecursionError``, and ``metadata=[1, 2]`` with
    "cannot convert dictionary update sequence element": now an ``EncodingError`` and a ``TypeError`` saying what
    is expected, for saves and the rotation's saves alike; nothing is written."""
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2))
    looped: dict = {"cfg": {}}
    looped["cfg"]["self"] = looped
    rotation = tdcp.CheckpointRotation(tmp_path / "run")
    for save in (lambda m: ckpt.save(tmp_path / "a", metadata=m), lambda m: rotation.save(ckpt, step=1, metadata=m)):
        with pytest.raises(tdcp.EncodingError, match="metadata must be JSON-safe: it holds itself"):
            save(looped)
        with pytest.raises(TypeError, match="metadata must be a mapping of JSON values .* got list"):
            save([1, 2])
    assert not (tmp_path / "a").exists() and rotation.entries() == []


@pytest.mark.parametrize(
    "saved, live", [({"a": 1}, [1, 2]), ([1, 2], {"x": 1})], ids=["dict-into-list", "list-into-dict"]
)
def test_a_value_of_another_container_kind_is_refused_not_reported_restored(
    tmp_path: Path, saved: object, live: object
) -> None:
    """A registered dict or list is updated in place; a checkpoint holding the other kind for it is refused (it was
    reported loaded while the object stayed as it was)."""
    path = tdcp.DistributedCheckpoint(stats=saved).save(tmp_path / "c")
    before = repr(live)
    with pytest.raises(tdcp.IncompatibleComponentError, match="updated in place by a load"):
        tdcp.DistributedCheckpoint(stats=live).load(path)
    assert repr(live) == before


def test_component_options_are_checked_at_the_call(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2))
    path = ckpt.save(tmp_path / "c")
    for call in (ckpt.save, ckpt.load):
        target = tmp_path / "d" if call is ckpt.save else path
        with pytest.raises(TypeError, match="pass CheckpointOptions"):
            call(target, component_options={"model": {"save_args": {}}})
        with pytest.raises(KeyError, match="not (saved|loaded): \\['other'\\]"):
            call(target, component_options={"other": tdcp.CheckpointOptions()})
    assert not (tmp_path / "d").exists()


def test_a_sharded_component_without_a_dtensor_is_refused_at_save(tmp_path: Path) -> None:
    """``placement='sharded'`` on plain tensors saved as if sharded: DCP writes a plain tensor that every rank holds
    under one key once, so the other ranks' values were lost silently. Refused, saying which placement to use."""
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("weights", {"w": torch.ones(2)}, placement="sharded")
    with pytest.raises(tdcp.EncodingError, match="registered as sharded but holds no DTensor.*'per_rank'"):
        ckpt.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_component_named_like_a_misspelt_option_is_warned_about() -> None:
    """``DistributedCheckpoint(stric="warn")`` registered a component ``stric`` and left ``strict`` at its default,
    without a word; it still registers it (a name is the user's), with a warning naming the option."""
    with pytest.warns(tdcp.TorchrlDcpWarning, match="'stric'.*the option 'strict'"):
        ckpt = tdcp.DistributedCheckpoint(stric="warn", model=torch.nn.Linear(2, 2))
    assert "stric" in ckpt.components and ckpt.strict == "error"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.TorchrlDcpWarning)
        tdcp.DistributedCheckpoint(stats={"n": 1}, state={"x": 1}, policy=torch.nn.Linear(2, 2))  # no near miss


@pytest.mark.parametrize(
    "name, value, option",
    [
        ("save_componnets", ["policy"], "save_components"),
        ("save_component", ("policy",), "save_components"),
        ("timout", datetime.timedelta(seconds=30), "timeout"),
    ],
)
def test_misspelt_options_holding_lists_or_timedeltas_are_warned_about(name, value, option) -> None:
    """What ``save_components`` and ``timeout`` take (a list or tuple of names, a ``timedelta``) counted as no option
    value: the misspelt option was registered as a component without a word, and the saves took everything."""
    with pytest.warns(tdcp.TorchrlDcpWarning, match=f"'{name}'.*the option '{option}'"):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), **{name: value})


def test_save_components_given_one_name_saves_that_component(tmp_path: Path) -> None:
    """``save_components="policy"`` was split into letters (``save()`` then failed: "not registered: ['c', 'i',
    ...]"), where ``save(components="policy")`` takes one name."""
    ckpt = tdcp.DistributedCheckpoint(save_components="policy", policy=torch.nn.Linear(2, 2), other={"a": 1})
    assert ckpt.save_components == {"policy"}
    assert set(tdcp.read_manifest(ckpt.save(tmp_path / "c"))["components"]) == {"policy"}


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 1e30, -1, 0, np.float64("nan")])
def test_a_timeout_out_of_range_is_refused_naming_the_option(timeout) -> None:
    """A NaN, infinite or huge timeout raised Python's own conversion errors ("cannot convert float NaN to integer",
    "Python int too large to convert to C int"), naming no option."""
    with pytest.raises(ValueError, match="timeout must be"):
        tdcp.DistributedCheckpoint(timeout=timeout)
    assert tdcp.DistributedCheckpoint(timeout=np.int64(30)).timeout == datetime.timedelta(seconds=30)


def test_an_object_whose_state_fails_is_refused_naming_the_component_and_what_to_do(tmp_path: Path) -> None:
    """A component's own code failing while the save asks for its state (a ``state_dict`` that raises) said only
    "encoding the state failed: TypeError: boom", naming no component; nothing is written."""

    class Broken:
        def state_dict(self):
            raise TypeError("boom")

        def load_state_dict(self, state):
            pass

    with pytest.raises(tdcp.EncodingError, match=r"component 'thing' \(Broken, adapter .*TypeError: boom.*adapter="):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), thing=Broken()).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()
