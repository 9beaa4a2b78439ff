"""Every ``torchrl-dcp`` command, on directories and archives, human and ``--json`` output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.cli import main


def save(path: Path, scale: float = 1.0, step: int = 4) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.mul_(scale)
    ckpt = tdcp.DistributedCheckpoint(model=model, stats={"n": 1})
    ckpt.register("rng", tdcp.RNGState())
    return ckpt.save(path, step=step, metadata={"reward": 1.5})


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_inspect_directory_and_archive(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save(tmp_path / "c")
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "model" in out and "replicated" in out and "per_rank" in out and "reward" in out
    for target, container in ((path, "directory"), (archive, "archive")):
        code, info = run_json(capsys, "inspect", str(target))
        assert code == 0 and info["container"] == container
        assert info["components"]["model"] == {
            "adapter": "torchrl_dcp.module", "adapter_version": 1, "placement": "replicated",
            "ranks": None, "tensors": 2, "bytes": 32,
        }
        assert info["components"]["rng"]["ranks"] == [0] and info["components"]["rng"]["tensors"] >= 1
        assert info["versions"]["torch"] == torch.__version__ and info["metadata"] == {"reward": 1.5}
        assert info["format_version"] == 3 and info["world_size"] == 1


def test_verify_reports_the_damaged_file_with_exit_code_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save(tmp_path / "c")
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    assert main(["verify", str(path)]) == 0 and "OK" in capsys.readouterr().out
    code, info = run_json(capsys, "verify", str(archive))
    assert code == 0 and info["ok"] and info["tensors"] >= 3
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    code, report = run_json(capsys, "verify", str(path))
    assert code == 1 and report["ok"] is False and report["file"].endswith("__0_0.distcp")
    tdcp.to_directory(archive, tmp_path / "d")  # the archive is still intact
    member_raw = bytearray(archive.read_bytes())
    from torchrl_dcp.storage.archive import read_index

    m = read_index(archive)["__0_0.distcp"]
    member_raw[m.data_offset + 100] ^= 1
    archive.write_bytes(bytes(member_raw))
    assert main(["verify", str(archive)]) == 1
    assert "c.zip::__0_0.distcp" in capsys.readouterr().err


def test_convert_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save(tmp_path / "c")
    code, info = run_json(capsys, "convert", str(path), str(tmp_path / "c.zip"))
    assert code == 0 and info["container"] == "archive" and Path(info["destination"]).is_file()
    assert main(["convert", str(tmp_path / "c.zip"), str(tmp_path / "back")]) == 0
    assert "wrote directory" in capsys.readouterr().out
    assert all((tmp_path / "back" / f.name).read_bytes() == f.read_bytes() for f in path.iterdir())
    assert main(["convert", str(path), str(tmp_path / "c.zip")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(path), str(tmp_path / "c.zip"), "--overwrite"]) == 0


def test_ls_rotation_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step, reward in ((1, 5.0), (2, 1.0)):
        rotation.save(tdcp.DistributedCheckpoint(w={"x": torch.ones(4) * step}), step=step, metadata={"reward": reward})
    tdcp.CheckpointRotation(tmp_path, keep_last=3, archive=True).save(
        tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}), step=3, metadata={"reward": 2.0}
    )
    (tmp_path / "step-000000000009").mkdir()  # an entry that never committed
    code, info = run_json(capsys, "ls", str(tmp_path), "--metric", "reward")
    assert code == 0
    assert [(r["step"], r["container"], r["committed"]) for r in info["entries"]] == [
        (1, "directory", True), (2, "directory", True), (3, "archive", True), (9, "directory", False),
    ]
    assert info["latest"] == "step-000000000003.zip" and info["best"] == "step-000000000001"
    assert info["entries"][0]["reward"] == 5.0 and all(r["bytes"] > 0 for r in info["entries"][:3])
    assert main(["ls", str(tmp_path), "--metric", "reward", "--mode", "min"]) == 0
    out = capsys.readouterr().out
    assert "NOT COMMITTED" in out and "best step-000000000002" in out


def test_diff_components_and_tensors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = save(tmp_path / "a")
    b = save(tmp_path / "b")
    archive = tdcp.to_archive(b, tmp_path / "b.zip")
    assert main(["diff", str(a), str(archive)]) == 0 and "identical" in capsys.readouterr().out
    c = save(tmp_path / "c", scale=1.5)
    code, info = run_json(capsys, "diff", str(a), str(c))
    assert code == 1 and not info["identical"]
    assert set(info["components"]) == {"model"}
    tensors = info["components"]["model"]["tensors"]
    assert set(tensors) == {"replicated/model/weight"}
    torch.manual_seed(0)
    w = torch.nn.Linear(3, 2).weight.detach()
    assert tensors["replicated/model/weight"]["max_abs_diff"] == pytest.approx(float((w * 0.5).abs().max()), rel=1e-5)
    code, info = run_json(capsys, "diff", str(a), str(c), "--atol", "10")
    assert code == 0 and info["identical"]
    other = tdcp.DistributedCheckpoint(model=torch.nn.Linear(3, 2), stats={"n": 2}).save(tmp_path / "d")
    code, info = run_json(capsys, "diff", str(a), str(other))
    assert code == 1 and info["only_in_a"] == ["rng"] and info["components"]["stats"]["state_differs"]
    assert main(["diff", str(a), str(other)]) == 1
    assert "only in a: rng" in capsys.readouterr().out


def test_console_script_runs_without_torch_for_inspect(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torchrl_dcp.cli", "verify", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "no manifest.json" in proc.stderr
    path = save(tmp_path / "c")
    code = (
        "import sys; from torchrl_dcp.cli import main; rc = main(['inspect', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "model" in proc.stdout, proc.stderr[-2000:]
