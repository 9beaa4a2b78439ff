"""Every ``torchrl-dcp`` command, on directories and archives, human and ``--json`` output."""

from __future__ import annotations

import json
import re
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
            "adapter": "torchrl_dcp.module",
            "adapter_version": 1,
            "placement": "replicated",
            "ranks": None,
            "tensors": 2,
            "bytes": 32,
            "shared": {},
        }
        # (format 5: the per-rank component's ranks and inventory are read from its manifest shard)
        assert info["components"]["rng"]["ranks"] == [0] and info["components"]["rng"]["tensors"] >= 1
        assert info["versions"]["torch"] == torch.__version__ and info["metadata"] == {"reward": 1.5}
        assert info["format_version"] == 8 and info["world_size"] == 1


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


def test_convert_takes_file_urls_and_keeps_user_files(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save(tmp_path / "c")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, info = run_json(capsys, "convert", f"file://{path}", f"file://localhost{tmp_path}/c.zip")
    assert code == 0 and info["destination"] == str(tmp_path / "c.zip") and (tmp_path / "c.zip").is_file()
    assert main(["convert", f"file://{tmp_path}/c.zip", f"file://{tmp_path}/back"]) == 0
    assert (tmp_path / "back" / "manifest.json").read_bytes() == (path / "manifest.json").read_bytes()
    assert list(cwd.iterdir()) == []  # nothing under ./file:/...
    (path / "eval_results.txt").write_text("mine")
    assert main(["convert", str(tmp_path / "c.zip"), str(path), "--overwrite"]) == 1
    assert "eval_results.txt" in capsys.readouterr().err and (path / "eval_results.txt").read_text() == "mine"
    assert main(["convert", str(path), f"file://elsewhere{tmp_path}/d.zip"]) == 1
    assert "not host 'elsewhere'" in capsys.readouterr().err and list(cwd.iterdir()) == []


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
        (1, "directory", True),
        (2, "directory", True),
        (3, "archive", True),
        (9, "directory", False),
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
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_dcp.cli", "verify", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1 and "no manifest.json" in proc.stderr
    path = save(tmp_path / "c")
    code = (
        "import sys; from torchrl_dcp.cli import main; rc = main(['inspect', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "model" in proc.stdout, proc.stderr[-2000:]
    # the package itself and its torch-free tools, as the docs use them (a module-level import of the adapters
    # anywhere on this path brought torch in: ~0.5 GB of RSS for a conversion)
    code = (
        "import sys; import torchrl_dcp as tdcp; from torchrl_dcp.cli import main; src, out = sys.argv[1:3]; "
        "tdcp.to_archive(src, out + '/c.zip'); tdcp.to_directory(out + '/c.zip', out + '/back'); "
        "tdcp.read_manifest(out + '/back'); tdcp.CheckpointRotation(out).entries(); assert main(['ls', out]) == 0; "
        "assert 'torch' not in sys.modules, 'the torch-free tools imported torch'"
    )
    (tmp_path / "tools").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "tools")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------- hostile inputs: one error line, exit 1 (diff: 2)
def _hostile(tmp_path: Path, kind: str) -> Path:
    import os

    target = tmp_path / f"bad-{kind.replace(' ', '-')}"
    if kind == "absent":
        pass
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "plain file":
        target.write_bytes(b"not a checkpoint")
    elif kind == "empty directory":
        target.mkdir()
    elif kind in ("manifest not JSON", "deeply nested manifest", "manifest a fifo"):
        target.mkdir()
        manifest = target / "manifest.json"
        if kind == "manifest a fifo":
            os.mkfifo(manifest)
        else:
            manifest.write_text("{'format'" if kind == "manifest not JSON" else "[" * 100_000 + "]" * 100_000)
    elif kind == "deeply nested state":
        path = save(target)
        m = json.loads((path / "manifest.json").read_text())
        node: object = 1
        for _ in range(400):  # parses as JSON; far deeper than any walker or decoder accepts
            node = {"t": "list", "items": [node]}
        m["components"]["stats"]["state"] = node
        (path / "manifest.json").write_text(json.dumps(m))
    else:
        raise ValueError(kind)
    return target


HOSTILE = ["absent", "fifo", "plain file", "empty directory", "manifest not JSON", "deeply nested manifest",
           "manifest a fifo"]  # fmt: skip


def _expect_error(capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    code = 2 if argv[0] == "diff" else 1  # diff: 0 identical, 1 different, 2 an error (as diff(1))
    assert main(argv) == code
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert main([*argv, "--json"]) == code
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["error"] and "Traceback" not in report["error"]


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "diff", "ls"])
def test_every_command_reports_hostile_input_as_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: str, kind: str
) -> None:
    bad = _hostile(tmp_path, kind)
    if command == "ls":
        if kind in ("empty directory", "manifest not JSON", "deeply nested manifest", "manifest a fifo"):
            assert main(["ls", str(bad)]) == 0  # a directory that holds no step-N entries: an empty listing
            capsys.readouterr()
            return
        argv = ["ls", str(bad)]
    elif command == "convert":
        argv = ["convert", str(bad), str(tmp_path / "out.zip")]
    elif command == "diff":
        argv = ["diff", str(bad), str(save(tmp_path / "good"))]
    else:
        argv = [command, str(bad)]
    _expect_error(capsys, argv)


def test_deeply_nested_state_is_an_error_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = _hostile(tmp_path, "deeply nested state")  # verify checks files and tensors, not JSON states: it passes
    _expect_error(capsys, ["diff", str(bad), str(save(tmp_path / "good"))])


def test_convert_to_a_too_long_name_is_an_error_line(tmp_path: Path) -> None:
    path = save(tmp_path / "c")
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_dcp.cli", "convert", str(path), str(tmp_path / ("n" * 300 + ".zip"))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert "too long" in proc.stderr


def test_ls_survives_broken_entries_and_reads_each_manifest_once(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from torchrl_dcp.format import manifest as manifest_module

    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=5)
    for step in (1, 2):
        rotation.save(tdcp.DistributedCheckpoint(w={"x": torch.ones(2) * step}), step=step)
    os.mkfifo(tmp_path / "step-000000000003")  # not a directory: skipped
    (tmp_path / "step-000000000004").mkdir()
    (tmp_path / "step-000000000004" / "manifest.json").write_text("[" * 100_000)
    (tmp_path / "step-000000000005").mkdir()
    os.mkfifo(tmp_path / "step-000000000005" / "manifest.json")
    (tmp_path / "step-000000000006.zip").write_bytes(b"PK\x05\x06 damaged")
    calls: list[str] = []
    original = manifest_module.loads_manifest
    monkeypatch.setattr(manifest_module, "loads_manifest", lambda d, s: calls.append(str(s)) or original(d, s))
    code, info = run_json(capsys, "ls", str(tmp_path))
    assert code == 0 and info["latest"] == "step-000000000002"
    rows = {r["step"]: r for r in info["entries"]}
    assert sorted(rows) == [1, 2, 4, 5, 6]
    assert rows[1]["committed"] and rows[2]["committed"] and "error" not in rows[1]
    assert all(not rows[s]["committed"] and rows[s]["error"] for s in (4, 5, 6))
    assert len([c for c in calls if "step-000000000001" in c or "step-000000000002" in c]) == 2  # once each
    assert main(["ls", str(tmp_path)]) == 0
    assert "NOT COMMITTED" in capsys.readouterr().out


def test_inspect_names_where_shared_tensors_are_stored(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A tensor stored by another component (xref): inspect gives the DCP key a plain reader finds it under."""
    import torch.distributed.checkpoint as dcp

    policy = torch.nn.Linear(3, 2)
    path = tdcp.DistributedCheckpoint(policy=policy, actor={"w": policy.weight}).save(tmp_path / "c")
    code, info = run_json(capsys, "inspect", str(path))
    assert code == 0 and info["components"]["actor"]["shared"] == {"w": "replicated/policy/weight"}
    assert info["components"]["actor"]["tensors"] == 0
    dest = {"replicated/policy/weight": torch.empty(2, 3)}
    dcp.load(dest, checkpoint_id=str(path), no_dist=True)  # plain DCP resolves it with that key
    assert torch.equal(dest["replicated/policy/weight"], policy.weight)


@pytest.mark.parametrize("kind", [[], {}, 3])
def test_inspect_of_a_node_whose_kind_is_no_name_never_crashes(
    tmp_path: Path, capsys: pytest.CaptureFixture, kind: object
) -> None:
    """Probe t2: a resealed state node with ``"t": []`` (which ``read_manifest`` leaves to a load to refuse) made
    ``inspect`` crash with "unexpected TypeError: unhashable type" naming no file."""
    from tests import forging

    path = tdcp.DistributedCheckpoint(stats={"n": {"m": 1}}).save(tmp_path / "c")

    def forge(m: dict) -> None:
        m["components"]["stats"]["state"]["items"][0][1]["t"] = kind

    forging.edit(path, forge)
    code, info = run_json(capsys, "inspect", str(path))
    assert code == 0 and info["components"]["stats"]["shared"] == {}, info
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(stats={"n": {"m": 0}}).load(path)  # a load refuses it


# ---------------------------------------------------------------------- conventions of a command-line tool
def test_version_module_entry_and_global_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"torchrl-dcp {tdcp.__version__}"
    proc = subprocess.run([sys.executable, "-m", "torchrl_dcp", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"torchrl-dcp {tdcp.__version__}"
    path = save(tmp_path / "c")
    assert main(["--json", "inspect", str(path)]) == 0  # a global option before the command, as after it
    assert json.loads(capsys.readouterr().out)["step"] == 4


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``torchrl-dcp ls ckpts | head``: the reader leaves before the output is written; no traceback."""
    for step in range(1, 4):
        save(tmp_path / f"step-{step:012d}", step=step)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrl_dcp", "ls", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def test_diff_exit_codes_json_bools_nan_and_named_values(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def write(name: str, flags: list[bool], x: float, label: str) -> Path:
        state = {"flags": torch.tensor(flags), "x": torch.tensor([x, 1.0]), "label": label, "n": 3}
        return tdcp.DistributedCheckpoint(stats=state).save(tmp_path / name)

    a = write("a", [True, False, True], 1.0, "run-a")
    assert main(["diff", str(a), str(write("same", [True, False, True], 1.0, "run-a"))]) == 0
    assert "identical" in capsys.readouterr().out
    b = write("b", [False, False, False], float("nan"), "run-b")
    code = main(["diff", str(a), str(b), "--json"])
    text = capsys.readouterr().out
    info = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert code == 1
    entry = info["components"]["stats"]
    flags, x = entry["tensors"]["replicated/stats/flags"], entry["tensors"]["replicated/stats/x"]
    assert flags == {"status": "values differ", "differing": 2}  # bools: how many differ, no "max abs diff nan"
    assert x["differing"] == 1 and x["max_abs_diff"] is None  # only a NaN against a number: no finite difference
    assert entry["state_differs"] and any("label" in v and "run-a" in v and "run-b" in v for v in entry["values"])
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "nan" not in out and "2 elements" in out and "value /label" in out
    assert main(["diff", str(a), str(tmp_path / "absent")]) == 2  # an error is not a difference


@pytest.mark.parametrize(
    "a, b",
    [
        ({"seed": torch.tensor([2**62])}, {"seed": torch.tensor([2**62 + 1])}),  # (equal once made float64)
        ({"v": True}, {"v": 1}),  # (equal in Python, restored as different values)
        ({"v": 1}, {"v": 1.0}),
    ],
)
def test_diff_tells_apart_values_that_compare_equal_loosely(
    tmp_path: Path, capsys: pytest.CaptureFixture, a, b
) -> None:  # type: ignore[no-untyped-def]
    """``diff`` said "identical" (exit 0) for int64 tensors past 2**53 that differ by 1 (compared as float64) and
    for JSON values ``True``/``1``/``1.0`` (Python's ``==``), which loads restore as different values."""
    left = tdcp.DistributedCheckpoint(app=a).save(tmp_path / "a")
    right = tdcp.DistributedCheckpoint(app=b).save(tmp_path / "b")
    assert main(["diff", str(left), str(right)]) == 1, capsys.readouterr().out


def test_ls_refuses_a_torchrl_checkpoint_and_names_torchrl_entries_of_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``ls`` of a ``torchrl.checkpoint`` checkpoint said "0 entries" (exit 0); of a directory of torchrl's
    ``checkpoint-<step>`` entries, "0 entries" and nothing of them. It refuses the one (as for ours) and names the
    others."""
    from torchrl.checkpoint import Checkpoint

    theirs = Checkpoint(stats={"x": 1}).save(tmp_path / "run" / "checkpoint-000000000010")
    assert main(["ls", str(theirs)]) == 1
    assert "is a checkpoint, not a rotation directory" in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "0 entries" in out and "1 torchrl.checkpoint checkpoint (checkpoint-000000000010)" in out
    code, info = run_json(capsys, "ls", str(tmp_path / "run"))
    assert code == 0 and info["torchrl_entries"] == ["checkpoint-000000000010"]


def test_ls_refuses_a_checkpoint_and_an_unknown_metric_and_shows_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = save(tmp_path / "step-000000000004")
    assert main(["ls", str(path)]) == 1
    err = capsys.readouterr().err
    assert "is a checkpoint, not a rotation directory" in err and "torchrl-dcp inspect" in err
    assert main(["ls", str(tmp_path), "--metric", "nope"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    leftover = tmp_path / (
        ".step-000000000008.tdcp-staging-" + "abc0" * 8
    )  # what a killed save leaves (the next save sweeps it)
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 5000)
    code, info = run_json(capsys, "ls", str(tmp_path))
    assert code == 0 and info["leftovers"] == [{"name": leftover.name, "owner": "step-000000000008", "bytes": 5000}]
    assert main(["ls", str(tmp_path)]) == 0
    assert "left by a killed save" in capsys.readouterr().out


def test_inspect_and_ls_count_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save(tmp_path / "step-000000000004")
    archive = tdcp.to_archive(path, tmp_path / "step-000000000005.zip")
    _, listed = run_json(capsys, "ls", str(tmp_path))
    sizes = {row["name"]: row["bytes"] for row in listed["entries"]}
    for target in (path, archive):
        _, info = run_json(capsys, "inspect", str(target))
        assert info["bytes"] == sizes[target.name] and 0 < info["data_bytes"] <= info["bytes"]


@pytest.mark.parametrize("atol", ["-1", "nan", "inf", "x"])
def test_diff_refuses_a_tolerance_that_would_hide_or_invent_differences(
    tmp_path: Path, capsys: pytest.CaptureFixture, atol: str
) -> None:
    a = tdcp.DistributedCheckpoint(m={"w": torch.zeros(2)}).save(tmp_path / "a")
    with pytest.raises(SystemExit) as exit_:
        main(["diff", str(a), str(a), "--atol", atol])
    assert exit_.value.code == 2 and "--atol" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_command_given_a_rotation_directory_says_to_use_ls(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: str
) -> None:
    """``ls`` on a checkpoint says to use ``inspect``; ``inspect``/``verify`` on a rotation directory only said "no
    manifest.json"."""
    tdcp.CheckpointRotation(tmp_path).save(tdcp.DistributedCheckpoint(x=torch.ones(1)), step=3)
    assert main([command, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"torchrl-dcp ls {tmp_path}" in err and "step-000000000003" in err, err


def test_diff_of_a_checkpoint_with_a_forged_file_size_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A resealed manifest recording a data file of 10**150 bytes: ``verify`` named the size, ``diff`` crashed in
    the identity check ("unexpected OverflowError ... please report"): the identity check refuses a recorded size
    past the file before it reads or hints at it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from forging import read_parts, write_parts

    a, b = save(tmp_path / "a"), save(tmp_path / "b")
    m = read_parts(b)
    data = next(n for n in m["files"] if n.endswith(".distcp"))
    m["files"][data]["size"] = 10**150
    write_parts(b, m)
    assert main(["diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert data in err and "forged size" in err and "please report" not in err, err


def test_the_tools_read_through_links_as_the_library_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``ckpts -> real`` (a rotation directory) and ``latest -> real/step-...`` (a checkpoint): the library reads
    through both; ``ls`` said "not a directory", ``convert`` "is a directory, not an archive" and ``inspect`` counted
    the link's own length as the checkpoint's bytes."""
    real = tmp_path / "real"
    entry = tdcp.CheckpointRotation(real).save(tdcp.DistributedCheckpoint(w={"x": torch.ones(64)}), step=1)
    (tmp_path / "ckpts").symlink_to(real)
    (tmp_path / "latest").symlink_to(entry)
    code, listed = run_json(capsys, "ls", str(tmp_path / "ckpts"))
    assert code == 0 and [r["step"] for r in listed["entries"]] == [1]
    code, through_link = run_json(capsys, "inspect", str(tmp_path / "latest"))
    assert code == 0
    assert through_link["bytes"] == run_json(capsys, "inspect", str(entry))[1]["bytes"] > 256
    code, converted = run_json(capsys, "convert", str(tmp_path / "latest"), str(tmp_path / "x.zip"))
    assert code == 0 and converted["container"] == "archive"
    tdcp.verify(tmp_path / "x.zip")


@pytest.mark.parametrize("version", [1, 4, 5, 6])
def test_inspect_shows_the_format_version_a_checkpoint_was_written_with(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, version: int
) -> None:
    """The manifest a reader holds is migrated to the current format: inspect said v7 of every old checkpoint,
    where archive.md promises a converted archive keeps its format_version."""
    fixture = Path(__file__).parent / "fixtures" / f"v{version}_checkpoint"
    for path in (fixture, tdcp.to_archive(fixture, tmp_path / "c.zip")):
        assert main(["inspect", "--json", str(path)]) == 0
        assert json.loads(capsys.readouterr().out)["format_version"] == version
        assert main(["inspect", str(path)]) == 0
        assert f"format v{version}," in capsys.readouterr().out


def test_a_link_loop_or_a_dangling_link_is_said_as_such(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A link loop was "not a checkpoint directory" (inspect, verify) or "the path does not exist" (convert): the
    path is there, and the user was not told it is a link going nowhere."""
    import os

    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "moved-away", tmp_path / "latest")
    for argv in (["inspect"], ["verify"], ["convert"]):
        for name, said in (("a", "is a symbolic link that loops"), ("latest", "moved-away.*does not exist")):
            extra = [str(tmp_path / "out.zip")] if argv == ["convert"] else []
            assert main([*argv, str(tmp_path / name), *extra]) == 1
            err = capsys.readouterr().err
            assert re.search(f"no checkpoint here: the path {said}", err) or re.search(said, err), (argv, err)
            assert "Traceback" not in err
    with pytest.raises(tdcp.CheckpointNotFoundError, match="symbolic link that loops"):
        tdcp.verify(tmp_path / "a")


def test_an_empty_path_is_refused_never_taken_for_the_current_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``convert run.zip "$OUT" --overwrite`` with ``OUT`` unset replaced the checkpoint the user stood in."""
    here = save(tmp_path / "here", step=1)
    archive = tdcp.to_archive(save(tmp_path / "other", step=2), tmp_path / "other.zip")
    monkeypatch.chdir(here)
    for argv in (["convert", str(archive), "", "--overwrite"], ["inspect", ""], ["verify", ""], ["ls", ""]):
        assert main(argv) == 1, argv
        assert "an empty path names no checkpoint" in capsys.readouterr().err, argv
    assert main(["--json", "inspect", ""]) == 1  # (probe g2: "file" was the path quoted, "''")
    assert json.loads(capsys.readouterr().out)["file"] == ""
    assert tdcp.read_manifest(here)["step"] == 1
    with pytest.raises(tdcp.CheckpointError, match="an empty path"):
        tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save("")


def test_links_named_with_a_trailing_slash_or_as_file_urls_are_read_as_what_they_name(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``ls runs/`` said "not a directory", ``convert latest/ a.zip`` "is a directory, not an archive", and
    ``inspect latest/`` gave the link's own size; a link to a torchrl export, or one named as a ``file://`` URL, was
    read as a damaged archive of ours ("member is in a sub-directory")."""
    from torchrl.checkpoint import Checkpoint

    rotation = tdcp.CheckpointRotation(tmp_path / "runs-real", keep_last=2)
    entry = rotation.save(tdcp.DistributedCheckpoint(w={"x": torch.ones(4)}), step=3)
    (tmp_path / "runs").symlink_to(tmp_path / "runs-real")
    (tmp_path / "latest").symlink_to(entry)
    exported = Checkpoint(policy=torch.nn.Linear(2, 2)).save(tmp_path / "p.torchrl")
    (tmp_path / "latest.torchrl").symlink_to(exported)
    assert main(["ls", f"{tmp_path}/runs/"]) == 0 and "step-000000000003" in capsys.readouterr().out
    assert main(["ls", f"file://{tmp_path}/runs"]) == 0 and "step-000000000003" in capsys.readouterr().out
    code, info = run_json(capsys, "inspect", f"{tmp_path}/latest/")
    assert code == 0 and info["bytes"] == run_json(capsys, "inspect", str(entry))[1]["bytes"]
    assert main(["convert", f"{tmp_path}/latest/", str(tmp_path / "a.zip")]) == 0
    for target in (tmp_path / "latest.torchrl", f"file://{exported}"):
        assert main(["verify", str(target)]) == 0, capsys.readouterr().err
        assert main(["inspect", str(target)]) == 0 and "torchrl.checkpoint" in capsys.readouterr().out
        assert tdcp.verify(target)["tensors"] == 2


def test_ls_names_torchrl_checkpoints_once_and_says_what_a_path_is(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A torchrl ``step-N`` was listed twice (a NOT COMMITTED entry and a torchrl entry); a missing path and an
    archive were "not a directory", and ``--metric ''`` was ignored."""
    from torchrl.checkpoint import Checkpoint

    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=3)
    rotation.save(tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}), step=1)
    Checkpoint(policy=torch.nn.Linear(2, 2)).save(tmp_path / "run" / "step-000000000005", format="directory")
    code, info = run_json(capsys, "ls", str(tmp_path / "run"))
    assert code == 0 and [e["name"] for e in info["entries"]] == ["step-000000000001"]
    assert info["torchrl_entries"] == ["step-000000000005"]
    archive = tdcp.to_archive(tmp_path / "run" / "step-000000000001", tmp_path / "one.zip")
    for path, says in (
        (tmp_path / "nope", "no rotation directory here: the path does not exist"),
        (archive, "is an archive of a checkpoint, not a rotation directory of checkpoints: use `torchrl-dcp inspect"),
    ):
        assert main(["ls", str(path)]) == 1 and says in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "run"), "--metric", ""]) == 1 and "keep_best" in capsys.readouterr().err


def test_a_failed_write_of_the_output_is_not_blamed_on_reading(tmp_path: Path) -> None:
    """``verify ck > /dev/full`` said "error: reading failed: No space left on device", the checkpoint verified."""
    path = save(tmp_path / "c")
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "torchrl_dcp", "verify", str(path)], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert done.returncode == 1 and "writing the output to stdout failed" in done.stderr
    assert "reading failed" not in done.stderr and "verify itself succeeded" in done.stderr


def test_an_archive_unpacks_into_an_empty_directory_as_a_save_writes_into_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``convert run.zip out`` into an existing empty ``out`` was refused even with ``--overwrite`` ("exists and is
    not a torchrl_dcp checkpoint"), while a save into ``out`` works. An archive never replaces a directory."""
    archive = tdcp.to_archive(save(tmp_path / "c"), tmp_path / "c.zip")
    (tmp_path / "out").mkdir()
    assert main(["convert", str(archive), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert tdcp.verify(tmp_path / "out")["tensors"] > 0
    (tmp_path / "empty.zip").mkdir()
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "empty.zip"), "--overwrite"]) == 1
    assert (tmp_path / "empty.zip").is_dir()


def test_diff_says_a_value_held_in_a_node_whole_never_by_the_nodes_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A JSON ``-nan`` against ``-inf`` was shown as ``value /z/bits (only in a)``: a field of the NaN's node, no
    path of the user's state."""
    a = tdcp.DistributedCheckpoint(vals={"z": -float("nan"), "k": 1}, no_dist=True).save(tmp_path / "a")
    b = tdcp.DistributedCheckpoint(vals={"z": -float("inf"), "k": 1}, no_dist=True).save(tmp_path / "b")
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "/z/bits" not in out and "value /z:" in out and "-inf" in out


def test_an_argument_refused_with_json_is_said_as_json(capsys: pytest.CaptureFixture) -> None:
    """With ``--json``, an argument argparse refuses (``--atol nan``) printed its usage on stderr and nothing on stdout:
    a caller parsing stdout got no JSON."""
    assert main(["diff", "a", "b", "--atol", "nan", "--json"]) == 2
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert info["ok"] is False and "--atol: must be a finite number" in info["error"] and not captured.err
    with pytest.raises(SystemExit) as exit_info:  # without --json: argparse's own usage and exit 2
        main(["diff", "a", "b", "--atol", "nan"])
    assert exit_info.value.code == 2 and "must be a finite number" in capsys.readouterr().err
