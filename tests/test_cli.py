from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import torchrl_dcp as tdcp
from torchrl_dcp.cli import main


def test_inspect_and_verify(tmp_path: Path, capsys) -> None:
    path = tdcp.DistributedCheckpoint(model=torch.nn.Linear(3, 2), stats={"n": 1}).save(tmp_path / "c", step=4)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "model" in out and "replicated" in out
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["components"]["model"]["tensors"] == 2 and info["components"]["model"]["bytes"] == 32
    assert main(["verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["file"].endswith("__0_0.distcp")


def test_console_script_is_installed(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torchrl_dcp.cli", "verify", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "no manifest.json" in proc.stderr
