"""Async saves (content, failures, atomicity, buffer reuse) and the fast writer's DCP compatibility."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp.async_save import AsyncSaver, SaveHandle
from torchrl_dcp.format import record as R
from torchrl_dcp.storage import writer as W
from torchrl_dcp.storage.filesums import file_checksum


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(600_000, generator=g),  # > 1 MiB: split into chunks, written by several threads
        "small": torch.randn(3, 4, generator=g),
        "ints": torch.arange(10),
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(5, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "view": torch.arange(40.0).reshape(4, 10)[:, 3],  # non-contiguous view of a larger storage
    }


def _load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    tdcp.DistributedCheckpoint(state=target).load(path)
    return target


# ---------------------------------------------------------------------- writer
@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.float32, (2, 3)),
        (torch.int64, ()),
        (torch.bool, (5,)),
        (torch.bfloat16, (3, 0, 2)),
        (torch.uint8, (70_000,)),
    ],
)
def test_blob_is_what_torch_save_writes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1) % 7).to(dtype).reshape(shape)
    ref = io.BytesIO()
    torch.save(t, ref)
    assert zipfile.ZipFile(io.BytesIO(ref.getvalue())).read("archive/data.pkl") == R.data_pickle(
        dtype, shape, t.numel()
    )
    data = R.tensor_bytes(t)
    head, tail = R.template(dtype, shape).parts(zlib.crc32(data))
    blob = head + bytes(data) + tail
    assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None  # every record's CRC is right
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)


def test_crc32_combine_matches_zlib_with_and_without_libz(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrl_dcp.format import checksums

    a, b = b"abc" * 100, bytes(range(256)) * 50
    assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    monkeypatch.setattr(checksums, "_COMBINE", None)
    assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("threads", [1, 3])
def test_files_load_with_plain_dcp_and_inline_checksums_match(tmp_path: Path, threads: int) -> None:
    flat = _state()
    out = W.write_state(flat, tmp_path, threads=threads)
    for name, record in out.files.items():
        assert record == {"size": (tmp_path / name).stat().st_size, "checksum": file_checksum(tmp_path / name)}
    dest = {k: torch.empty_like(v) for k, v in flat.items()}
    dcp.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in flat.items():
        assert torch.equal(dest[k], v), k


def test_writeback_is_started_for_every_written_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrl_dcp.storage import writeback as WB

    if WB._SYNC_FILE_RANGE is None:
        pytest.skip("sync_file_range is not available here")
    started: list[tuple[int, int]] = []
    lock = threading.Lock()
    original = WB.start_writeback

    def record(fd: int, offset: int, length: int) -> bool:
        with lock:
            started.append((offset, length))
        return original(fd, offset, length)

    monkeypatch.setattr(WB, "start_writeback", record)
    monkeypatch.setattr(WB, "EVERY", 1 << 20)
    flat = {"big": torch.randn(3_000_000), "small": torch.randn(10)}
    out = W.write_state(flat, tmp_path, threads=2)
    size = out.files["__0_0.distcp"]["size"]
    covered = sorted(started)
    # the data chunks (all but the deferred blob header and tail) are handed to the kernel, none twice
    assert all(a + n <= b for (a, n), (b, _) in zip(covered, covered[1:]))
    assert sum(n for _, n in covered) >= 12_000_000 and covered[-1][0] + covered[-1][1] <= size
    assert len(covered) >= 6 and all(n <= 2 << 20 for _, n in covered)  # batched, not one call for the whole file
    dest = {k: torch.empty_like(v) for k, v in flat.items()}
    dcp.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(dest[k], v) for k, v in flat.items())


def test_writeback_that_the_file_system_refuses_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrl_dcp.storage import writeback as WB

    calls: list[int] = []
    monkeypatch.setattr(WB, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append(n) or -1)
    wb = WB.Writeback(fd=0, every=10)
    wb.written(0, 10)
    wb.written(10, 10)
    wb.flush()
    assert calls == [10]  # refused once, then disabled


def test_plan_writes_balances_shared_keys_and_refuses_mismatches() -> None:
    from torchrl_dcp.planner import TensorInfo, plan_writes

    per_rank = [[TensorInfo(f"rank/{r}/x", "torch.float32", (4,), 16)] for r in range(2)]
    shared = [TensorInfo(f"replicated/w{i}", "torch.float32", (100,), 400) for i in range(6)]
    owner = plan_writes([per_rank[0] + shared, per_rank[1] + shared]).owner
    assert owner["rank/0/x"] == 0 and owner["rank/1/x"] == 1
    assert sorted(owner[t.key] for t in shared) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(tdcp.CheckpointError, match="replicated/w0"):
        plan_writes([shared, [TensorInfo("replicated/w0", "torch.float64", (100,), 800)]])


def test_plan_local_gives_every_rank_the_plan_gathered_planning_would_for_its_own_writes() -> None:
    """Each rank plans alone from its own tensors: the shared writers agree across ranks whatever each rank holds
    of its own, every shared key and chunk has exactly one writer, and every rank writes all of its own keys."""
    from torchrl_dcp.planner import TensorInfo, plan_local, shared_digest

    mib = 1 << 20
    shared = [TensorInfo(f"replicated/w{i}", "torch.float32", (256 * (i + 1),), 1024 * (i + 1)) for i in range(7)]
    shared.append(TensorInfo("replicated/big", "torch.float32", (64, mib // 4), 64 * mib))  # chunked: 8 chunks
    own = [  # very different per-rank sizes: must not change who writes the shared keys
        [TensorInfo("rank/0/b/x", "torch.float32", (4,), 16)],
        [
            TensorInfo("rank/1/b/x", "torch.float32", (8, mib), 32 * mib),
            TensorInfo("rank/1/b/y", "torch.int64", (1,), 8),
        ],
        [],
    ]
    plans = [plan_local(own[r] + shared, r, 3) for r in range(3)]
    assert len({shared_digest(own[r] + shared) for r in range(3)}) == 1  # own keys are not in the digest
    whole = [{k: p.owner[k] for k in p.owner if k.startswith("replicated/")} for p in plans]
    assert whole[0] == whole[1] == whole[2] and set(whole[0]) == {t.key for t in shared[:-1]}
    chunks = [[(c.start, c.rows, c.owner) for c in p.chunks["replicated/big"]] for p in plans]
    assert chunks[0] == chunks[1] == chunks[2] and len(chunks[0]) == 8
    assert sorted({owner for _, _, owner in chunks[0]}) == [0, 1, 2]  # a large replicated tensor is spread
    for r, p in enumerate(plans):
        mine = p.writes(r)
        assert {t.key for t in own[r]} <= mine and not any(k.startswith("rank/") and f"/{r}/" not in k for k in mine)
        files = [c.file for c in p.chunk_share(r)]
        assert len(files) == len(set(files)) and all(f.startswith(f"__{r}_") for f in files)
    assert plan_local(None, 0, 3).backend == "dcp"
    assert shared_digest(shared) != shared_digest(shared[:-1]) != shared_digest(None)


# ---------------------------------------------------------------------- async save
def test_async_content_is_identical_to_a_sync_save(tmp_path: Path) -> None:
    state = _state()
    ckpt = tdcp.DistributedCheckpoint(state=state, stats={"episodes": 3})
    sync = ckpt.save(tmp_path / "sync", step=1)
    handle = ckpt.async_save(tmp_path / "async", step=1)
    assert isinstance(handle, SaveHandle)
    assert handle.wait() == tmp_path / "async" and handle.done()
    for name in tdcp.read_manifest(sync)["files"]:
        if name != ".metadata":  # metadata differs only by checkpoint path and save id; data files by their trailer
            assert (sync / name).read_bytes()[:-64] == (tmp_path / "async" / name).read_bytes()[:-64], name
    tdcp.verify(tmp_path / "async")
    loaded = _load(tmp_path / "async", state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_async_save_holds_the_state_at_the_call(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = tdcp.DistributedCheckpoint(model=model)
    handle = ckpt.async_save(tmp_path / "c", step=1)
    with torch.no_grad():  # the training loop moves on while the save is written
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    fresh = torch.nn.Linear(64, 64)
    tdcp.DistributedCheckpoint(model=fresh).load(tmp_path / "c")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k])


def test_the_background_write_leaves_the_training_threads_their_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async save writes with this rank's CPUs less torch's intra-op threads (at least one); a sync save, the caller
    waiting, with all of them; ``TDCP_WRITE_THREADS`` wins over both."""
    from torchrl_dcp.storage import copying

    used: list[int] = []
    original = W.write_file
    monkeypatch.setattr(W, "write_file", lambda *a, **k: used.append(k["threads"]) or original(*a, **k))
    monkeypatch.setattr(copying, "node_cpus_per_rank", lambda: 8)
    monkeypatch.delenv("TDCP_WRITE_THREADS", raising=False)
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(4, 4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(6)
        ckpt.save(tmp_path / "sync")
        ckpt.async_save(tmp_path / "six").wait()
        torch.set_num_threads(7)
        ckpt.async_save(tmp_path / "seven").wait()
        torch.set_num_threads(2)
        ckpt.async_save(tmp_path / "two").wait()
        monkeypatch.setenv("TDCP_WRITE_THREADS", "3")
        ckpt.async_save(tmp_path / "set").wait()
    finally:
        torch.set_num_threads(threads)
    assert used == [4, 2, 1, 4, 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_the_background_write_runs_at_the_niceness_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TDCP_ASYNC_NICE``: the background thread and the write threads it starts run that nice; the caller (the
    training loop) keeps its priority; 0 (the default) changes nothing; a value out of range fails the call."""
    seen: list[tuple[int, bool]] = []
    original = W.write_file

    def spy(*a: Any, **k: Any) -> Any:
        def record(part: Any) -> None:  # a write thread of the file, started by the background thread
            seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), True))

        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), False))
        W.run_split([0, 1], [1, 1], 2, record)
        return original(*a, **k)

    monkeypatch.setattr(W, "write_file", spy)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(4, 4))
    ckpt.async_save(tmp_path / "default").wait()
    assert {nice for nice, _ in seen} == {caller}
    seen.clear()
    monkeypatch.setenv("TDCP_ASYNC_NICE", str(min(19, caller + 7)))
    ckpt.async_save(tmp_path / "nice").wait()
    assert {nice for nice, _ in seen} == {min(19, caller + 7)} and any(worker for _, worker in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    monkeypatch.setenv("TDCP_ASYNC_NICE", "20")
    with pytest.raises(ValueError, match="TDCP_ASYNC_NICE=20 is out of range"):
        ckpt.async_save(tmp_path / "bad")
    ckpt.close()


def test_staging_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    ckpt.async_save(tmp_path / "a").wait()
    ptrs = {k: b.data_ptr() for k, b in ckpt._async._buffers.items()}
    assert len(ptrs) == 2 and all(p != state[k.split("/")[-1]].data_ptr() for k, p in ptrs.items())
    state["w"].add_(1)
    ckpt.async_save(tmp_path / "b").wait()
    assert {k: b.data_ptr() for k, b in ckpt._async._buffers.items()} == ptrs
    assert torch.equal(_load(tmp_path / "b", state)["w"], state["w"])


def test_memmap_tensors_are_written_in_place_without_staging(tmp_path: Path) -> None:
    from tensordict import MemoryMappedTensor

    mm = MemoryMappedTensor.from_tensor(torch.arange(1000.0), filename=tmp_path / "buf.memmap")
    ram = torch.arange(10.0)
    staged, _ = AsyncSaver().stage({"mm": mm, "ram": ram})
    assert staged["mm"].data_ptr() == mm.data_ptr()
    assert staged["ram"].data_ptr() != ram.data_ptr()
    copied, _ = AsyncSaver().stage({"mm": mm}, stage_memmap=True)
    assert copied["mm"].data_ptr() != mm.data_ptr()
    ckpt = tdcp.DistributedCheckpoint(state={"mm": mm})
    ckpt.async_save(tmp_path / "c").wait()
    assert torch.equal(_load(tmp_path / "c", {"mm": torch.zeros(1000)})["mm"], torch.arange(1000.0))


def _failing_write(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(W, "write_share", fail)


def test_background_failure_raises_at_wait_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.ones(100)}
    ckpt = tdcp.DistributedCheckpoint(state=state)
    path = ckpt.save(tmp_path / "c", step=1)
    before = (path / "manifest.json").read_bytes()
    _failing_write(monkeypatch)
    state["w"].add_(1)
    handle = ckpt.async_save(path, step=2)
    with pytest.raises(tdcp.CheckpointError, match="No space left"):
        handle.wait()
    assert isinstance(handle.exception(), tdcp.CheckpointError)
    assert (path / "manifest.json").read_bytes() == before  # commit is atomic: the old one stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # staging removed
    monkeypatch.undo()
    assert torch.equal(_load(path, state)["w"], torch.ones(100))
    ckpt.async_save(path, step=3).wait()  # the failure was reported once; saving works again
    assert tdcp.read_manifest(path)["step"] == 3


def test_background_failure_raises_at_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tdcp.DistributedCheckpoint(state={"w": torch.ones(3)})
    _failing_write(monkeypatch)
    ckpt.async_save(tmp_path / "a")  # never waited on
    with pytest.raises(tdcp.CheckpointError, match="No space left"):
        ckpt.save(tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    _failing_write(monkeypatch)
    ckpt.async_save(tmp_path / "a")
    with pytest.raises(tdcp.CheckpointError, match="No space left"):
        ckpt.async_save(tmp_path / "b")


@pytest.mark.parametrize("spelt", ["as saved", "through a link"])
def test_another_checkpoints_load_of_a_path_being_saved_waits_for_that_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelt: str
) -> None:
    """A checkpoint without a process group loaded the path another checkpoint's async save was replacing without
    waiting for it: it restored the checkpoint being replaced, silently (docs: a load waits for a save in flight, of
    this checkpoint or of another in the process). It now waits for a save in flight to the path it loads, however
    it is spelt (probe t1: ``ckpts -> scratch``, the load of ``ckpts/P`` did not wait for the save to ``scratch/P``)."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "ckpts").symlink_to(tmp_path / "scratch")
    loaded = tmp_path / ("scratch" if spelt == "as saved" else "ckpts") / "P"
    writer = tdcp.DistributedCheckpoint(no_dist=True, state={"w": torch.zeros(3)})
    writer.save(tmp_path / "scratch" / "P", step=0)
    release = threading.Event()
    original = W.write_share

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(W, "write_share", slow)
    writer.components["state"]["w"].fill_(5.0)
    handle = writer.async_save(tmp_path / "scratch" / "P", step=1)
    threading.Timer(0.3, release.set).start()
    live = {"w": torch.ones(3)}
    result = tdcp.DistributedCheckpoint(no_dist=True, state=live).load(loaded)
    assert handle.done() and result.step == 1 and torch.equal(live["w"], torch.full((3,), 5.0))


def test_one_save_in_flight_the_next_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, order = threading.Event(), []
    original = W.write_share

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        order.append(args[2].name)
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(W, "write_share", slow)
    ckpt = tdcp.DistributedCheckpoint(state={"w": torch.ones(3)})
    first = ckpt.async_save(tmp_path / "a")
    assert not first.done()
    threading.Timer(0.2, release.set).start()
    second = ckpt.async_save(tmp_path / "b")  # blocks until the first committed
    assert first.done() and first.wait() == tmp_path / "a"
    second.wait()
    assert len(order) == 2 and order[0].startswith(".a.") and order[1].startswith(".b.")
    with pytest.raises(TimeoutError):
        release.clear()
        ckpt.async_save(tmp_path / "c").wait(timeout=0.01)
    release.set()
    ckpt.load(tmp_path / "b")  # a load waits for the save in flight too
    assert (tmp_path / "c" / "manifest.json").exists()


def test_a_checkpoint_waits_only_for_background_saves_on_its_own_group() -> None:
    """Another checkpoint's background save is waited for before a collective call on the same group, never by a
    checkpoint without one (a local tier's single-process saves) or on another group."""
    import threading

    from torchrl_dcp.async_save import AsyncSaver

    release = threading.Event()
    other, mine, group = AsyncSaver(), AsyncSaver(), object()
    other.group = group
    other.submit(Path("x"), None, lambda: (release.wait(5), Path("x"))[1])
    try:
        started = time.monotonic()
        mine.wait_for_others(None)
        mine.wait_for_others(object())
        assert time.monotonic() - started < 1 and not other.pending.done()
        threading.Timer(0.2, release.set).start()
        mine.wait_for_others(group)
        assert other.pending.done()
    finally:
        release.set()
        other.shutdown()


def test_an_async_save_that_failed_unreported_is_said_at_exit(tmp_path: Path) -> None:
    """A job that exits with an async save in flight that fails (its process group destroyed, here a write error)
    and never waits for it: the save was lost without a word (the failure is raised by the next call or ``wait()``,
    and there was none). It is said on stderr at exit, once, with what to call; a save waited for is not. So it is in
    a process started by multiprocessing's ``fork`` (Python's default on Linux), which ends without ``atexit``."""
    import subprocess
    import textwrap

    script = textwrap.dedent(
        """
        import multiprocessing, sys, torch, torchrl_dcp as tdcp
        from torchrl_dcp.storage import writer as W

        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")

        def body(root, case):
            W.write_share = fail
            ckpt = tdcp.DistributedCheckpoint(w={"x": torch.arange(3.0)})
            handle = ckpt.async_save(root + "/step-3", step=3)
            if case == "waited":
                try:
                    handle.wait()
                except tdcp.CheckpointError:
                    pass

        if sys.argv[2] == "forked":
            child = multiprocessing.get_context("fork").Process(target=body, args=(sys.argv[1], "unreported"))
            child.start()
            child.join()
        else:
            body(sys.argv[1], sys.argv[2])
        """
    )
    said = {}
    for case in ("unreported", "waited", "forked"):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / case), case], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[case] = proc.stderr
    for case in ("unreported", "forked"):
        assert said[case].count("the async save of step 3") == 1, said[case]
        assert "No space left on device" in said[case], said[case]
    assert "rotation.close()" in said["unreported"] and "the async save" not in said["waited"], said
    assert not (tmp_path / "unreported" / "step-3").exists()


def test_two_checkpoints_of_one_process_saving_into_one_rotation_commit_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process group: checkpoint A's async save of step 1 was still in flight when checkpoint B saved step 2
    into the same rotation. B's save did not wait for A's (only checkpoints of one group did), both took commit
    sequence 1, step 1 committed last and counted as the newest, and ``keep_last=1`` deleted step 2."""
    from torchrl_dcp.storage import directory

    release = threading.Event()
    real_publish = directory.publish

    def slow_first(staging: Any, destination: Any, **kwargs: Any) -> Any:
        if Path(destination).name.endswith("1"):
            release.wait(timeout=30)  # step 1 commits once the main thread moved on (or has waited for it)
        return real_publish(staging, destination, **kwargs)

    monkeypatch.setattr(directory, "publish", slow_first)
    first = tdcp.DistributedCheckpoint(no_dist=True, a={"w": torch.ones(8)})
    second = tdcp.DistributedCheckpoint(no_dist=True, b={"w": torch.zeros(8)})
    rotation = tdcp.CheckpointRotation(tmp_path, every_steps=1, async_saves=True, keep_last=1)
    rotation.maybe_save(first, 1)
    threading.Timer(0.5, release.set).start()
    rotation.maybe_save(second, 2)
    for c in (rotation, first, second):
        c.close()
    assert [(e.step, e.sequence) for e in rotation.entries()] == [(2, 2)]
    assert rotation.latest() == tmp_path / "step-000000000002"
