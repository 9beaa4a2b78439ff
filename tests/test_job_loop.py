"""The job loop in one process: save policies (a generated matrix), preemption signals, async rotations, and the
checkpoint's lifetime (``wait``/``close``, a context manager, argument checks)."""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp import rotation as rotation_module
from torchrl_dcp import save_decision

STEPS = range(1, 25)


class Clock:
    """A monotonic clock advanced by hand (one second per training step below)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def expected(every_steps, every_seconds, keep_last, keep_every, keep_best, metric) -> tuple[list[int], list[int]]:
    """What the policies promise, computed independently of the library: (saved steps, kept steps)."""
    saved: list[int] = []
    last_step, last_time = 0, 0.0  # the clock below starts with the rotation, at 0 s
    for step in STEPS:
        now = float(step)
        by_steps = every_steps is not None and step // every_steps > last_step // every_steps
        by_time = every_seconds is not None and now - last_time >= every_seconds
        if by_steps or by_time:
            saved.append(step)
            last_step, last_time = step, now
    kept = set(saved if keep_last is None else saved[-keep_last:])
    if keep_every is not None:
        kept |= {s for s in saved if s % keep_every == 0}
    if keep_best is not None:
        key, mode, n = keep_best
        ranked = sorted(saved, key=lambda s: (metric(s) if mode == "max" else -metric(s), s), reverse=True)
        kept |= set(ranked[:n])
    if saved:
        kept.add(saved[-1])
    return saved, sorted(kept)


MATRIX = [
    case
    for case in itertools.product(
        (None, 3, 5),  # every_steps
        (None, 4.0),  # every_seconds
        (None, 1, 2),  # keep_last
        (None, 6),  # keep_every
        (None, ("reward", "max", 2)),  # keep_best with N
    )
    if case[0] is not None or case[1] is not None
]


@pytest.mark.parametrize(("every_steps", "every_seconds", "keep_last", "keep_every", "keep_best"), MATRIX)
def test_policies_save_and_keep_what_they_promise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every_steps, every_seconds, keep_last, keep_every, keep_best
) -> None:
    clock = Clock()
    for module in (rotation_module, save_decision):  # (the save's time; the decision's clock)
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    clock.now = 0.0
    rotation = tdcp.CheckpointRotation(
        tmp_path,
        every_steps=every_steps,
        every_seconds=every_seconds,
        keep_last=keep_last,
        keep_every=keep_every,
        keep_best=keep_best,
        incremental=False,
    )
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.zeros(2)})

    def metric(step: int) -> float:
        return float((step * 7) % 11)  # not monotonic in the step: the best entries are old ones too

    saved = []
    for step in STEPS:
        clock.now = float(step)
        if rotation.maybe_save(ckpt, step, {"reward": metric(step)}) is not None:
            saved.append(step)
    want_saved, want_kept = expected(every_steps, every_seconds, keep_last, keep_every, keep_best, metric)
    assert saved == want_saved
    assert [e.step for e in rotation.entries()] == want_kept


def test_every_steps_counts_from_the_resumed_step_and_force_saves(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.zeros(2)})
    first = tdcp.CheckpointRotation(tmp_path, every_steps=100)
    assert first.maybe_save(ckpt, 0) is None and first.maybe_save(ckpt, 99) is None
    assert first.maybe_save(ckpt, 130) is not None  # frames jump: the first step past 100
    assert first.maybe_save(ckpt, 170, force=True) is not None  # the end of training
    again = tdcp.CheckpointRotation(tmp_path, every_steps=100)
    assert again.resume(ckpt).step == 170
    assert again.maybe_save(ckpt, 190) is None and again.maybe_save(ckpt, 210) is not None
    explicit = tdcp.CheckpointRotation(tmp_path / "explicit", every_steps=10)  # an explicit save counts as one
    explicit.save(ckpt, step=25)  # (the next maybe_save in its interval saved again)
    assert explicit.maybe_save(ckpt, 26) is None and explicit.maybe_save(ckpt, 30) is not None


def test_keep_best_accepts_a_count_and_a_yaml_list(tmp_path: Path) -> None:
    assert tdcp.CheckpointRotation(tmp_path, keep_best=["loss", "min", 3]).retention.keep_best == ("loss", "min", 3)
    assert tdcp.CheckpointRotation(tmp_path, keep_best=("loss", "min")).keep_best == ("loss", "min")
    for bad in (("loss", "down"), ("loss", "min", 0), ("", "max"), "loss", ("loss", "max", True)):
        with pytest.raises(ValueError, match="keep_best"):
            tdcp.CheckpointRotation(tmp_path, keep_best=bad)
    for name in ("keep_last", "keep_every", "every_steps"):
        with pytest.raises(ValueError, match=name):
            tdcp.CheckpointRotation(tmp_path, **{name: 0})
    with pytest.raises(ValueError, match="every_seconds"):
        tdcp.CheckpointRotation(tmp_path, every_seconds=float("nan"))


# ---------------------------------------------------------------------- preemption
def test_a_preemption_signal_saves_at_the_next_call_and_chains_the_previous_handler(tmp_path: Path) -> None:
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        rotation = tdcp.CheckpointRotation(tmp_path, every_steps=1000, preemption_signals=("SIGUSR1",))
        ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)})
        assert rotation.maybe_save(ckpt, 1) is None and not rotation.preempted
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler installed before still runs
        path = rotation.maybe_save(ckpt, 2)
        assert rotation.preempted and Path(path).name == "step-000000000002"
        assert [e.step for e in rotation.entries()] == [2]
        assert rotation.maybe_save(ckpt, 3) is None  # one preemption save, not one per later call
        rotation.close()
        assert signal.getsignal(signal.SIGUSR1) is not rotation._watcher._handle  # restored
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_preemption_save_is_made_after_an_async_save_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async save before the signal failed in the background: the preemption's maybe_save raised that failure
    and made no save, and a job without a try around it died without its last save. The save is made, the earlier
    failure said in a warning."""
    from torchrl_dcp.storage import writer as W

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        rotation = tdcp.CheckpointRotation(tmp_path, every_steps=2, async_saves=True, preemption_signals=("SIGUSR1",))
        ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)})
        monkeypatch.setattr(W, "write_share", fail)
        handle = rotation.maybe_save(ckpt, 2)
        while not handle.done():
            time.sleep(0.01)
        monkeypatch.undo()
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.warns(tdcp.TorchrlDcpWarning, match="previous async save failed .*No space left.*step 3"):
            path = rotation.maybe_save(ckpt, 3)
        assert rotation.preempted and Path(path).name == "step-000000000003"
        assert [e.step for e in rotation.entries()] == [3]
        rotation.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_preemption_save_is_made_when_the_keep_best_metric_is_not_a_number(tmp_path: Path) -> None:
    """keep_best's metric NaN (rank 0's mean over no finished episode) at a preemption signal: every rank raised the
    refused metric's ValueError, nothing was saved and the job lost its last save. The preemption save is made, the
    metric recorded as null (the entry kept as one of the last, not ranked), with a warning; a scheduled save still
    refuses it (the step stays due)."""
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        rotation = tdcp.CheckpointRotation(
            tmp_path, every_steps=1, keep_last=2, keep_best=("r", "max"), preemption_signals=("SIGUSR1",)
        )
        ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)})
        rotation.maybe_save(ckpt, 1, {"r": 1.0})
        with pytest.raises(ValueError, match="keep_best needs a finite number"):
            rotation.maybe_save(ckpt, 2, {"r": float("nan")})
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.warns(tdcp.TorchrlDcpWarning, match=r"metadata\['r'\], got nan: the preemption save records it"):
            path = rotation.maybe_save(ckpt, 3, {"r": float("nan")})
        assert rotation.preempted and Path(path).name == "step-000000000003"
        assert [(e.step, e.metric) for e in rotation.entries()] == [(1, 1.0), (3, None)]
        assert tdcp.read_manifest(path)["metadata"] == {"r": None}
        rotation.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("order", ["built", "reverse"])
def test_watching_rotations_closed_in_any_order_leave_the_handler_they_found(tmp_path: Path, order) -> None:
    """Two rotations watching one signal (a subgroup's and a world-wide one): once both are closed, whatever the
    order, the handler installed before them is back (closed first, the older one used to stay installed and
    swallow the signal for good), and a closed watcher still passes signals on while a newer one chains to it."""
    seen = []

    def user_handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR1, user_handler)
    try:
        a = tdcp.CheckpointRotation(tmp_path / "a", preemption_signals=("SIGUSR1",))
        b = tdcp.CheckpointRotation(tmp_path / "b", preemption_signals=("SIGUSR1",))
        first, second = (a, b) if order == "built" else (b, a)
        first.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # through the open watcher, and the closed one, to the user's handler
        assert second._watcher.signalled == "SIGUSR1" and first._watcher.signalled is None
        second.close()
        assert signal.getsignal(signal.SIGUSR1) is user_handler
        first.close()  # idempotent: changes nothing
        assert signal.getsignal(signal.SIGUSR1) is user_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_preemption_save_is_synchronous_and_waits_for_the_async_save_in_flight(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(
        tmp_path, every_steps=2, keep_last=1, async_saves=True, preemption_signals=(signal.SIGUSR2,)
    )
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.randn(1000)})
    try:
        handle = rotation.maybe_save(ckpt, 2)
        assert isinstance(handle, tdcp.SaveHandle)
        os.kill(os.getpid(), signal.SIGUSR2)
        path = rotation.maybe_save(ckpt, 3)
        assert isinstance(path, Path) and handle.done() and rotation.preempted
        assert [e.step for e in rotation.entries()] == [3]
    finally:
        rotation.close()


def test_preemption_signals_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        tdcp.CheckpointRotation(tmp_path, preemption_signals=(signal.SIGKILL,))
    with pytest.raises(ValueError, match="not a signal"):
        tdcp.CheckpointRotation(tmp_path, preemption_signals=("SIGNOPE",))
    errors = []

    def build() -> None:
        try:
            tdcp.CheckpointRotation(tmp_path, preemption_signals=(signal.SIGUSR1,))
        except ValueError as err:
            errors.append(str(err))

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


_CLOSED_FROM_A_THREAD = """
import os, signal, sys, threading
import torchrl_dcp as tdcp
rotation = tdcp.CheckpointRotation(sys.argv[1], preemption_signals=("SIGTERM", "SIGINT"))
errors = []
def close():
    try:
        rotation.close()
    except Exception as err:
        errors.append(repr(err))
thread = threading.Thread(target=close)
thread.start()
thread.join()
print("errors", errors, flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)  # (Python's own handler again: a KeyboardInterrupt)
except KeyboardInterrupt:
    print("interrupted", flush=True)
if sys.argv[2] == "main":
    rotation.close()  # a later close from the main thread puts the handlers back at once
    print("restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("survived SIGTERM", flush=True)
"""


@pytest.mark.parametrize("then", ["signal", "main"])
def test_a_rotation_closed_from_another_thread_leaves_the_signals_default_actions(tmp_path: Path, then: str) -> None:
    """``close()`` from a cleanup thread raised ``ValueError`` (signal.signal outside the main thread) after marking
    the watcher closed: its handler stayed installed, passing SIGTERM on to nothing, and a later close from the main
    thread did nothing: the process survived SIGTERM for good. The handlers are now put back at the next signal (and
    it is delivered as before the watcher) or at a later close from the main thread."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _CLOSED_FROM_A_THREAD, str(tmp_path), then],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "errors []" in run.stdout and "interrupted" in run.stdout, run.stdout + run.stderr
    assert run.returncode == -signal.SIGTERM and "survived" not in run.stdout, run.stdout + run.stderr
    if then == "main":
        assert "restored True" in run.stdout


# ---------------------------------------------------------------------- async rotations and the checkpoint's lifetime
def test_async_rotation_prunes_after_each_commit_and_close_flushes(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=1, keep_last=2, async_saves=True)
    weights = torch.zeros(256)
    ckpt = tdcp.DistributedCheckpoint(w={"x": weights})
    for step in range(1, 6):
        weights.fill_(step)
        handle = rotation.maybe_save(ckpt, step)
        assert isinstance(handle, tdcp.SaveHandle)
    rotation.close()
    assert handle.done() and handle.wait() == rotation.path_for(5)
    assert [e.step for e in rotation.entries()] == [4, 5]
    loaded = {"x": torch.empty(256)}
    tdcp.DistributedCheckpoint(w=loaded).load(rotation.path_for(5))
    assert torch.equal(loaded["x"], torch.full((256,), 5.0))


def test_async_archives_are_converted_in_the_background(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=1, keep_last=1, async_saves=True, archive=True)
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)})
    rotation.maybe_save(ckpt, 1)
    handle = rotation.maybe_save(ckpt, 2)
    assert handle.path == rotation.path_for(2)  # the archive it commits, not the directory it converts (then gone)
    assert rotation.wait() == rotation.path_for(2) == handle.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000002.zip"]


def test_checkpoint_wait_close_and_context_manager(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.ones(8)})
    assert ckpt.wait() is None
    ckpt.async_save(tmp_path / "a", step=1)
    assert ckpt.wait() == tmp_path / "a"
    with tdcp.DistributedCheckpoint(w={"x": torch.ones(8)}) as scoped:
        handle = scoped.async_save(tmp_path / "b", step=2)
    assert handle.done() and tdcp.read_manifest(tmp_path / "b")["step"] == 2
    scoped.close()  # idempotent; a later save starts the writer again
    assert scoped.async_save(tmp_path / "c", step=3).wait() == tmp_path / "c"


def test_checkpoint_arguments_are_checked_when_it_is_built() -> None:
    assert tdcp.DistributedCheckpoint(timeout=60).timeout == datetime.timedelta(seconds=60)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of seconds"):
        tdcp.DistributedCheckpoint(timeout="60")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        tdcp.DistributedCheckpoint(timeout=0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        tdcp.DistributedCheckpoint(timeout=datetime.timedelta(0))
    with pytest.raises(TypeError, match="storage_options"):
        tdcp.DistributedCheckpoint(storage_options="key=x")
    with pytest.raises(ValueError, match="process_group"):
        tdcp.DistributedCheckpoint(process_group=object())  # no process group is initialised here
    with pytest.raises(ValueError, match="no_dist=True takes no process_group"):
        tdcp.DistributedCheckpoint(no_dist=True, process_group=object())


def test_no_dist_outside_a_job_is_a_world_of_one(tmp_path: Path) -> None:
    ckpt = tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.arange(4.0)})
    assert (ckpt.rank, ckpt.world_size) == (0, 1)
    path = ckpt.save(tmp_path / "c", step=1)
    target = {"x": torch.zeros(4)}
    tdcp.DistributedCheckpoint(no_dist=True, w=target).load(path)
    assert torch.equal(target["x"], torch.arange(4.0))
