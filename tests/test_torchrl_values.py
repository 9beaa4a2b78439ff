"""torchrl's own objects and values as users hand them over: GlobalRNGState, numpy/tensor scalars, mappings, tensors."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchrl.checkpoint import GlobalRNGState

import torchrl_dcp as tdcp


def test_torchrls_global_rng_state_is_per_rank_and_resumes_its_streams(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(rng=GlobalRNGState())
    assert ckpt.placement("rng") == "per_rank"  # each rank's own streams (a replicated placement failed on 2 ranks)
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    path = ckpt.save(tmp_path / "c")
    expected = (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    tdcp.DistributedCheckpoint(rng=GlobalRNGState()).load(path)
    assert (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()) == expected


def test_numpy_and_tensor_scalars_in_metadata_and_the_keep_best_metric(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    ckpt = tdcp.DistributedCheckpoint(model=model)
    meta = {"reward": np.float32(1.5), "loss": torch.tensor(0.25), "steps": [np.int64(3)], "ok": np.bool_(True)}
    path = ckpt.save(tmp_path / "c", metadata=meta)
    assert tdcp.read_manifest(path)["metadata"] == {"reward": 1.5, "loss": 0.25, "steps": [3], "ok": True}
    with pytest.raises(tdcp.EncodingError, match="metadata"):
        ckpt.save(tmp_path / "d", metadata={"vector": torch.ones(2)})  # not a scalar: refused, named
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=1, keep_best=("reward", "max"))
    for step, reward in enumerate([torch.tensor(5.0), np.float64(9.0), torch.tensor(1.0)], start=1):
        rotation.save(ckpt, step=step, metadata={"reward": reward})  # a Trainer's metadata callback may return these
    assert [e.step for e in rotation.entries()] == [2, 3]  # the best (9.0) and the newest


class Store(MutableMapping):
    """A mapping that is not a dict (as Hydra's DictConfig is not)."""

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_mappings_of_any_kind_and_bare_tensors_are_components(tmp_path: Path) -> None:
    counts = torch.arange(4.0)
    ckpt = tdcp.DistributedCheckpoint(
        ordered=OrderedDict([("b", torch.ones(2)), ("a", 1)]),
        config=Store(lr=0.1, nested=Store(depth=2)),
        counts=counts,
    )
    path = ckpt.save(tmp_path / "c")
    ordered, config, fresh_counts = OrderedDict(), Store(), torch.zeros(4)
    alias = fresh_counts  # every reference sees the restored values: loaded in place
    result = tdcp.DistributedCheckpoint(ordered=ordered, config=config, counts=fresh_counts).load(path)
    assert list(ordered) == ["b", "a"] and torch.equal(ordered["b"], torch.ones(2)) and ordered["a"] == 1
    assert dict(config) == {"lr": 0.1, "nested": {"depth": 2}} and result.values["config"]["lr"] == 0.1
    assert torch.equal(alias, counts)
    with pytest.raises(tdcp.IncompatibleComponentError, match="register a tensor of the saved shape"):
        tdcp.DistributedCheckpoint(ordered=OrderedDict(), config=Store(), counts=torch.zeros(5)).load(path)


def test_hydra_configs_are_components_in_their_container_form(tmp_path: Path) -> None:
    """A DictConfig (nested ListConfigs, interpolations) saves as plain values and loads back into a DictConfig in
    place; a ListConfig too."""
    omegaconf = pytest.importorskip("omegaconf", reason="Hydra's omegaconf: pip install -e '.[hydra]'")
    cfg = omegaconf.OmegaConf.create({"lr": 0.1, "net": {"cells": [64, 64]}, "name": "sac", "run": "${name}-1"})
    layers = omegaconf.OmegaConf.create([1, {"a": [2]}])
    path = tdcp.DistributedCheckpoint(config=cfg, layers=layers).save(tmp_path / "c")
    fresh, fresh_layers = omegaconf.OmegaConf.create({"stale": 1}), omegaconf.OmegaConf.create([])
    result = tdcp.DistributedCheckpoint(config=fresh, layers=fresh_layers).load(path)
    assert isinstance(fresh, omegaconf.DictConfig) and omegaconf.OmegaConf.to_container(fresh) == {
        "lr": 0.1, "net": {"cells": [64, 64]}, "name": "sac", "run": "sac-1"
    }  # fmt: skip
    assert omegaconf.OmegaConf.to_container(fresh_layers) == [1, {"a": [2]}]
    assert result.values["config"]["net"] == {"cells": [64, 64]}
