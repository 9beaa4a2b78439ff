"""Progress of ``verify``, ``convert`` and ``diff`` on stderr: a bar only when stderr is a terminal (a pseudo-terminal
here) and neither ``--json`` nor ``--quiet`` is given; stdout never changes, and nothing changes on a pipe. The
library reports bytes through a callback (``verify(progress=)``, ``to_archive(progress=)``) and never prints."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import uuid
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp import cli
from torchrl_dcp.checkpoint_diff import diff_checkpoints

pytest.importorskip("tqdm", reason="tqdm is a dependency of torchrl_dcp: pip install -e .")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("progress")
    torch.manual_seed(0)
    a = tdcp.DistributedCheckpoint(w={"x": torch.randn(600_000), "i": torch.arange(9)}).save(d / "a", step=1)
    b = tdcp.DistributedCheckpoint(w={"x": torch.randn(600_000), "i": torch.arange(9)}).save(d / "b", step=2)
    tdcp.to_archive(a, d / "a.zip")
    return a, b


def _run(args: list[str], cwd: Path, terminal: bool) -> tuple[int, str, str]:
    """Run ``python -m torchrl_dcp ARGS``: stdout a pipe; stderr a pipe, or a pseudo-terminal of 24 x 100."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torchrl_dcp", *args]
    if not terminal:
        proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (0 columns: tqdm draws nothing)
    try:
        child = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env
        )
    finally:
        os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = child.stdout.read().decode()  # type: ignore[union-attr]
    child.stdout.close()  # type: ignore[union-attr]
    return child.wait(timeout=120), out, err.decode(errors="replace")


def _same_output(out: str, name: str) -> str:
    """``out`` with convert's destination ``name`` and its time left out (they differ between runs)."""
    return re.sub(r"\d+\.\d+ s\)", "T s)", out.replace(name, "DST"))


# (arguments, the bar's label, the flags that turn it off, each run on a terminal: convert starts in milliseconds,
# verify and diff import torch)
COMMANDS = {
    "verify": (["verify", "a"], "verifying", [["--json", "--quiet"]]),
    "convert pack": (["convert", "a", "{n}.zip"], "packing", [["-q"], ["--quiet"], ["--json"]]),
    "convert unpack": (["convert", "a.zip", "{n}"], "unpacking", [["-q"], ["--quiet"], ["--json"]]),
    "diff": (["diff", "a", "b"], "comparing", []),  # (--json and --quiet: the same switch, checked above)
}


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_progress_on_a_terminal_and_nothing_on_a_pipe(pair: tuple[Path, Path], command: str) -> None:
    root = pair[0].parent
    args, label, quiet_runs = COMMANDS[command]
    names = {run: f"{uuid.uuid4().hex[:8]}-{run}" for run in ("pipe", "terminal", *range(len(quiet_runs)))}
    code, out, err = _run([x.format(n=names["pipe"]) for x in args], root, terminal=False)
    assert code == (1 if command == "diff" else 0), err
    assert err == ""  # a pipe: no progress, nothing on stderr
    expected = _same_output(out, names["pipe"])
    code_t, out_t, err_t = _run([x.format(n=names["terminal"]) for x in args], root, terminal=True)
    assert code_t == code
    assert label in err_t, err_t  # the bar, on the terminal
    assert _same_output(out_t, names["terminal"]) == expected  # stdout unchanged
    for i, flags in enumerate(quiet_runs):  # before the command (-q) or after it
        command_line = [x.format(n=names[i]) for x in args]
        command_line = [*flags, *command_line] if flags == ["-q"] else [*command_line, *flags]
        code_q, out_q, err_q = _run(command_line, root, terminal=True)
        assert code_q == code and label not in err_q, (flags, err_q)
        if "--json" not in flags:
            assert _same_output(out_q, names[i]) == expected


def test_progress_callback_only_for_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli._parser().parse_args(["verify", "x"])
    args.json, args.quiet = False, False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with cli._progress("verifying", args) as show:
        assert show is None  # a pipe: the library runs as without a callback
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    for json_, quiet in ((True, False), (False, True)):
        args.json, args.quiet = json_, quiet
        with cli._progress("verifying", args) as show:
            assert show is None
    args.json = args.quiet = False
    with cli._progress("verifying", args) as show:
        assert callable(show)
        show(0, 10)
        show(10, 10)


def _recorder() -> tuple[list[tuple[int, int]], object]:
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


def _reaches_total(calls: list[tuple[int, int]], total: int) -> None:
    assert calls, "no progress reported"
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never backwards
    assert calls[-1][0] == total


def test_verify_reports_the_bytes_it_checksums(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = pair
    files = tdcp.read_manifest(a)["files"]
    total = sum(f["size"] for f in files.values())
    for where in (a, tdcp.to_archive(a, tmp_path / "a.zip")):
        calls, record = _recorder()
        assert tdcp.verify(where, progress=record) == tdcp.verify(where)  # the same checks, the same summary
        _reaches_total(calls, total)


def test_verify_reports_progress_on_an_object_store(pair: tuple[Path, Path]) -> None:
    pytest.importorskip("fsspec", reason="fsspec is not installed: pip install -e '.[s3]'")
    url = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}/c"
    path = tdcp.DistributedCheckpoint(w={"x": torch.randn(300_000)}).save(url, step=1)
    total = sum(f["size"] for f in tdcp.read_manifest(path)["files"].values())
    calls, record = _recorder()
    assert tdcp.verify(url, progress=record)["files"] == 2
    _reaches_total(calls, total)


def test_diff_reports_the_tensor_bytes_it_reads(pair: tuple[Path, Path]) -> None:
    a, b = pair
    calls, record = _recorder()
    assert diff_checkpoints(str(a), str(b), 0.0, record) == diff_checkpoints(str(a), str(b), 0.0)
    _reaches_total(calls, 2 * (600_000 * 4 + 9 * 8))
