"""Start real ranks as separate processes, like ``torchrun`` does, and collect what they did.

Each rank is its own process running ``tests_distributed.worker`` with ``<module:function>
<args-json>``, ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set (a free port per
launch), a gloo process group, and a timeout. When a rank fails, the others are stopped (as
torchrun does) and the failed ranks' output is shown in the assertion message.

Ranks are forked from a server that has imported torch, tensordict and torchrl once
(``multiprocessing``'s forkserver with preloaded modules), so a launch does not pay ~5 s
of imports per rank; torchrl_dcp itself (which reads ``TDCP_*`` variables at import) and
the scenario modules are imported by each rank after its environment is set.
``TDCP_LAUNCH_EXEC=1`` starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    value: Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "numpy", "tensordict", "torchrl", "torchrl.data", "torchrl.envs",
           "torchrl.collectors", "torchrl.modules", "torchrl.objectives"]  # fmt: skip


@functools.cache
def _forkserver() -> multiprocessing.context.BaseContext | None:
    """The forkserver context with torch & co. imported in the server (started once per test process)."""
    if os.environ.get("TDCP_LAUNCH_EXEC") == "1" or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "RL_WARNINGS")}
    os.environ.update(OMP_NUM_THREADS="1", RL_WARNINGS="False")  # read when the server imports torch / torchrl
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


class _Rank:
    """One rank: a forked process (``multiprocessing``) or a fresh interpreter (``subprocess``), one interface."""

    def __init__(self, target: str, args_json: str, env: dict[str, str], log: Path) -> None:
        ctx = _forkserver()
        self.log = open(log, "w+") if ctx is None else None
        if ctx is None:
            cmd = [sys.executable, "-m", "tests_distributed.worker", target, args_json]
            self.proc: Any = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        else:
            from tests_distributed.worker import run_rank

            self.proc = ctx.Process(
                target=run_rank, args=(target, args_json, {**env, "TDCP_ROOT": str(ROOT)}, str(log))
            )
            self.proc.start()
        self.path = log

    def poll(self) -> int | None:
        return self.proc.poll() if self.log is not None else self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> int:
        if self.log is not None:
            return self.proc.wait()
        self.proc.join()
        return self.proc.exitcode

    def output(self) -> str:
        if self.log is not None:
            self.log.close()
        return self.path.read_text(errors="replace") if self.path.exists() else ""


def launch(
    target: str,
    world_size: int,
    *args: Any,
    timeout: float = 120,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``target`` (``"module:function"``) on ``world_size`` ranks; return every rank's result.

    The function receives ``*args`` (JSON values) and returns a JSON value. Unless
    ``expect_failure``, any rank that fails or a timeout fails the test with output.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tdcp-launch-") as tmp:
        procs = []
        for rank in range(world_size):
            out_file = Path(tmp) / f"rank{rank}.json"
            rank_env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1",
                "TDCP_RESULT": str(out_file),
                **(env or {}),
            }
            procs.append((_Rank(target, json.dumps(list(args)), rank_env, Path(tmp) / f"rank{rank}.log"), out_file))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(1.0)  # give the others a moment to fail on their own, then stop them
                break
            time.sleep(0.05)
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        results = []
        for rank, (p, out_file) in enumerate(procs):
            code = p.wait()
            value = json.loads(out_file.read_text()) if out_file.exists() else None
            results.append(RankResult(rank, code, p.output(), value))
    failed = [r for r in results if r.returncode != 0]
    if timed_out and not expect_failure:
        raise AssertionError(f"{target} timed out after {timeout}s\n" + _outputs(results))
    if failed and not expect_failure:
        raise AssertionError(f"{target}: ranks {[r.rank for r in failed]} failed\n" + _outputs(failed))
    return results


def run_main(module: str, *argv: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``module.main(argv)`` on ``nproc`` forked ranks: what ``torchrun -m module`` runs, without its start-up cost.

    Returns a completed process whose ``stdout`` is every rank's output in rank order (``stderr`` empty) and whose
    return code is the first non-zero rank's (0 when all succeeded)."""
    results = launch("tests_distributed.worker:call_main", nproc, module, *argv, timeout=timeout, expect_failure=True)
    code = next((r.returncode for r in results if r.returncode != 0), 0)
    return subprocess.CompletedProcess([module, *argv], code, "".join(r.output for r in results), "")


def _outputs(results: list[RankResult]) -> str:
    return "\n".join(f"----- rank {r.rank} (exit {r.returncode}) -----\n{r.output[-4000:]}" for r in results)


def torchrun_module(
    module: str, *args: str, nproc: int = 2, timeout: float = 300, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` under ``torchrun`` (c10d rendezvous on a free local port), as users do."""
    cmd, env = torchrun_command(module, *args, nproc=nproc, max_restarts=max_restarts)
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def torchrun_command(
    module: str, *args: str, nproc: int = 2, max_restarts: int = 0
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment :func:`torchrun_module` runs (for tests that signal the agent)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *args,
    ]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RL_WARNINGS": "False"}


def torchrun_nodes(
    module: str,
    *args: str,
    nodes: int = 2,
    nproc: int = 2,
    root: Path,
    timeout: float = 300,
    private_tmp: Path | None = None,
    max_restarts: int = 0,
) -> list[subprocess.CompletedProcess]:
    """Run ``module`` as ``nodes`` separate ``torchrun --nnodes N`` agents (one per "node") on this machine.

    The agents meet through a c10d rendezvous on 127.0.0.1; each "node" has a private
    ``TMPDIR`` (``root/node<i>/tmp``) and its own working directory, so nothing may rely on
    a node-local path being visible elsewhere. Returns each agent's completed process.

    With ``private_tmp=SHARED`` each agent runs in its own mount namespace with a fresh
    tmpfs on ``/tmp`` (its ``TMPDIR``), where only the directory ``SHARED`` stays visible
    (see ``nodens.py``; check :func:`private_tmp_unavailable` first); what a node left in
    its ``/tmp`` is listed in ``root/node<i>/tmp-listing.json``. ``max_restarts``: how often each agent
    restarts its workers after one failed (``torchrun --max-restarts``).
    """
    port = free_port()
    procs = []
    for node in range(nodes):
        home = root / f"node{node}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=nodes-{port}",
            f"--max-restarts={max_restarts}",
            "-m",
            module,
            *args,
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "RL_WARNINGS": "False",
            "TMPDIR": str(home / "tmp"),
        }
        if private_tmp is not None:
            nodens = [
                sys.executable,
                "-m",
                "tests_distributed.nodens",
                str(private_tmp),
                str(home / "tmp-listing.json"),
            ]
            cmd = ["unshare", "-m", "--propagation", "private", *nodens, "--", *cmd]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=home,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a timeout kills the agent and its workers (a killed agent orphans them)
            )
        )
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@functools.cache
def private_tmp_unavailable() -> str | None:
    """Why a "node" cannot get its own mount namespace with a private ``/tmp`` here (``None``: it can)."""
    if not sys.platform.startswith("linux"):
        return f"mount namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "mounting a private /tmp needs root (unshare -m + mount -t tmpfs)"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux) on this machine"
    cmd = ["unshare", "-m", "--propagation", "private", sys.executable, "-m", "tests_distributed.nodens", "--probe"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    if probe.returncode != 0:
        return f"unshare -m / mount -t tmpfs /tmp failed here (e.g. no CAP_SYS_ADMIN): {probe.stderr.strip()[-300:]}"
    return None
