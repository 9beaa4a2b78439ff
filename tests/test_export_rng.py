"""export_torchrl: a per-rank RNGState component becomes torchrl.checkpoint's own GlobalRNGState format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrl.checkpoint import Checkpoint, GlobalRNGState

import torchrl_dcp as tdcp


def draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


@pytest.mark.parametrize("fmt", ["archive", "directory"])
def test_rng_state_exports_into_torchrl_checkpoint(tmp_path: Path, fmt: str) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # a cached gaussian in NumPy's legacy state
    policy = torch.nn.Linear(2, 1)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    expected = draws()

    out = tdcp.export_torchrl(path, tmp_path / "export", ["policy", "rng"], format=fmt)  # rank 0's streams
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    result = Checkpoint(policy=torch.nn.Linear(2, 1), rng=GlobalRNGState()).load(out)
    assert "rng" in result.loaded
    assert draws() == expected


def test_other_per_rank_components_still_need_a_rank(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("stats", {"episodes": 3}, placement="per_rank")
    path = ckpt.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="per_rank"):
        tdcp.export_torchrl(path, tmp_path / "stats.torchrl", ["stats"])
    assert tdcp.export_torchrl(path, tmp_path / "stats.torchrl", ["stats"], rank=0).exists()


def test_an_unknown_export_format_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """``format="zip"`` reached torchrl's Checkpoint after every component was read, as its ValueError."""
    with pytest.raises(ValueError, match="format must be 'archive'"):
        tdcp.export_torchrl(tmp_path / "nothing-here", tmp_path / "out", format="zip")


def test_diff_and_convert_say_a_torchrl_checkpoint_is_torchrls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrl.checkpoint export was read as a damaged archive of ours ("member is in a sub-directory")."""
    from torchrl_dcp.cli import main

    path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2)).save(tmp_path / "c", step=1)
    export = tdcp.export_torchrl(path, tmp_path / "policy.torchrl", ["policy"])
    for argv in (["diff", str(export), str(path)], ["convert", str(export), str(tmp_path / "out")]):
        assert main(argv) != 0
        said = capsys.readouterr().err
        assert "is a torchrl.checkpoint checkpoint" in said and "`inspect` and `verify` read" in said, said
    assert not (tmp_path / "out").exists()
    monkeypatch.chdir(tmp_path)  # (probe g2: --json named the path as typed, every other error the absolute one)
    assert main(["--json", "diff", "policy.torchrl", str(path)]) != 0
    assert json.loads(capsys.readouterr().out)["file"] == str(export)
