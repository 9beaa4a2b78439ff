"""Loads of a checkpoint cut into many chunk files: read by one thread, the next files are announced to the kernel
before their reads (``POSIX_FADV_WILLNEED``), at most ``READ_AHEAD`` bytes ahead, each file once
(``TDCP_READ_AHEAD=0`` turns it off); read by several threads, each takes the next file in order. Neither changes
what is read: the loaded tensors are the saved ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp import chunking
from torchrl_dcp.storage import copying


@pytest.mark.parametrize("ahead", [0, 1, 3 * 4096, 1 << 30])
@pytest.mark.parametrize("kind", ["dict", "module"])
def test_next_chunk_files_are_announced_within_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: int, kind: str
) -> None:
    monkeypatch.setenv("TDCP_READ_THREADS", "1")
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    torch.manual_seed(0)
    saved = torch.randn(64, 256)  # 64 KiB: 16 chunk files of 4 KiB
    if kind == "module":
        obj: object = torch.nn.Module()
        obj.register_buffer("w", saved.clone())  # type: ignore[attr-defined]
    else:
        obj = {"w": saved.clone()}
    path = tdcp.DistributedCheckpoint(state=obj).save(tmp_path / "ck")
    chunk_files = sorted(p.name for p in path.glob("__0_*.distcp"))
    assert len(chunk_files) >= 16

    announced: list[tuple[int, int]] = []  # (inode, bytes) in the order announced
    reads: list[tuple[int, int]] = []  # (how many were announced, inode) when a file's first read starts
    real_pread = os.preadv

    def will_need(fd: int, offset: int, size: int) -> None:
        announced.append((os.fstat(fd).st_ino, size))

    def preadv(fd: int, buffers: list, offset: int) -> int:
        ino = os.fstat(fd).st_ino
        if not any(i == ino for _, i in reads):
            reads.append((len(announced), ino))
        return real_pread(fd, buffers, offset)

    from torchrl_dcp.storage.reader import InPlaceFileSystemReader

    real_read_items = InPlaceFileSystemReader.read_items

    def read_items(self: InPlaceFileSystemReader, *args: object) -> None:
        reads.clear()  # the reads that count: the load's (a module's files were checksummed before, unannounced)
        real_read_items(self, *args)

    monkeypatch.setattr(InPlaceFileSystemReader, "read_items", read_items)
    monkeypatch.setattr(copying, "READ_AHEAD", ahead)
    monkeypatch.setattr(copying, "will_need", will_need)
    monkeypatch.setattr(os, "preadv", preadv)
    if kind == "module":
        with torch.no_grad():
            obj.w.zero_()  # type: ignore[attr-defined]
        tdcp.DistributedCheckpoint(state=obj).load(path)
        assert torch.equal(obj.w, saved)  # type: ignore[attr-defined]
    else:
        target: dict = {"w": torch.zeros(64, 256)}
        tdcp.DistributedCheckpoint(state=target).load(path)
        assert torch.equal(target["w"], saved)
    inodes = [i for i, _ in announced]
    assert len(inodes) == len(set(inodes))  # each file once
    chunk_inodes = {os.stat(path / name).st_ino for name in chunk_files}
    if ahead == 0:
        assert announced == []
        return
    assert chunk_inodes <= set(inodes)  # every chunk file announced
    for count, ino in reads:  # a chunk file is announced before its first read, never further ahead than the window
        if ino not in chunk_inodes:
            continue
        assert ino in inodes[:count]
        beyond = announced[inodes.index(ino) + 1 : count]
        assert sum(size for _, size in beyond) < max(ahead, 1) + 4096 * 2


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("verify", [True, False])
def test_chunk_files_are_read_by_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, verify: bool
) -> None:
    import threading

    from torchrl_dcp import load_plan

    monkeypatch.setenv("TDCP_READ_THREADS", str(threads))
    monkeypatch.setattr(load_plan, "PREFETCH_MAX", 0)  # "b" read in place too, with the chunk files
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    torch.manual_seed(1)
    saved = {"w": torch.randn(256, 64), "b": torch.randn(3)}  # 16 chunk files and a small tensor
    path = tdcp.DistributedCheckpoint(state=saved).save(tmp_path / "ck")
    chunk_inodes = {p.stat().st_ino for p in path.glob("__0_*.distcp")}
    first_reads: list[tuple[int, int]] = []  # (inode, thread) of each file's first read, in time order
    real_pread = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        ino = os.fstat(fd).st_ino
        if ino in chunk_inodes and all(i != ino for i, _ in first_reads):
            first_reads.append((ino, threading.get_ident()))
        return real_pread(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    from torchrl_dcp.storage.reader import InPlaceFileSystemReader

    together = threading.Barrier(threads, timeout=10)  # the first files are read at the same time, or this breaks
    real_read_file = InPlaceFileSystemReader._read_file
    calls = []

    def read_file(self: InPlaceFileSystemReader, *args: object) -> None:
        calls.append(threading.get_ident())
        if len(calls) <= threads:
            together.wait()
        real_read_file(self, *args)

    monkeypatch.setattr(InPlaceFileSystemReader, "_read_file", read_file)
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(3)}
    tdcp.DistributedCheckpoint(state=target).load(path, verify=verify)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    assert {i for i, _ in first_reads} == chunk_inodes  # every chunk file read
    assert len(set(calls[:threads])) == threads  # the first files by as many threads at once


def test_a_damaged_chunk_file_read_by_another_thread_is_refused_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDCP_READ_THREADS", "2")
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    saved = {"w": torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)}
    path = tdcp.DistributedCheckpoint(state=saved).save(tmp_path / "ck")
    victim = sorted(path.glob("__0_*.distcp"), key=lambda p: p.name)[7]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    target = {"w": torch.full((256, 64), -1.0)}
    live = target["w"]
    with pytest.raises(tdcp.CheckpointError, match=victim.name):
        tdcp.DistributedCheckpoint(state=target).load(path)
    assert target["w"] is live and bool((live == -1.0).all())


@pytest.mark.parametrize("container", ["directory", "archive"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["dict", "module"])
def test_chunked_loads_are_exact_in_every_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, container: str, threads: int, verify: bool, kind: str
) -> None:
    """Chunk files, small records and a 0-d tensor, from a directory or a ZIP archive, by one or two reader threads,
    verified or not, into fresh buffers or a module's own tensors: the saved values, bit for bit."""
    monkeypatch.setenv("TDCP_READ_THREADS", str(threads))
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    torch.manual_seed(2)
    saved = {
        "big": torch.randn(200, 33),  # 26 KiB: 7 chunk files, the last one short
        "ints": torch.randint(0, 1 << 30, (5000,), dtype=torch.int64),  # 40 KiB
        "small": torch.randn(7),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "halves": torch.randn(3, 4).half(),
    }
    if kind == "module":
        obj: object = torch.nn.Module()
        for k, v in saved.items():
            obj.register_buffer(k, v.clone())  # type: ignore[attr-defined]
    else:
        obj = {k: v.clone() for k, v in saved.items()}
    path = tdcp.DistributedCheckpoint(state=obj).save(tmp_path / "ck")
    if container == "archive":
        path = tdcp.to_archive(path, tmp_path / "ck.zip")
    if kind == "module":
        target: object = torch.nn.Module()
        for k, v in saved.items():
            target.register_buffer(k, torch.zeros_like(v))  # type: ignore[attr-defined]
        live = dict(target.named_buffers())  # type: ignore[attr-defined]
        tdcp.DistributedCheckpoint(state=target).load(path, verify=verify)
        got = dict(target.named_buffers())  # type: ignore[attr-defined]
        assert all(got[k] is live[k] for k in saved)  # read in place
    else:
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        tdcp.DistributedCheckpoint(state=target).load(path, verify=verify)
        got = target  # type: ignore[assignment]
    for k, v in saved.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("verify", [True, False])
def test_a_file_of_large_records_and_chunk_files_load_exactly_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, verify: bool
) -> None:
    """Files read by several threads while one of them splits its large records between threads too."""
    monkeypatch.setenv("TDCP_READ_THREADS", str(threads))
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 4 << 20)
    torch.manual_seed(3)
    saved = {f"layer{i}": torch.randn(3 << 17) for i in range(4)}  # 1.5 MiB records: one file, split between threads
    saved["emb"] = torch.randn(5 << 18)  # 5 MiB: 5 chunk files
    saved["bias"] = torch.randn(10)
    path = tdcp.DistributedCheckpoint(state=dict(saved)).save(tmp_path / "ck")
    assert len(list(path.glob("__0_*.distcp"))) >= 6
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    tdcp.DistributedCheckpoint(state=target).load(path, verify=verify)
    assert all(torch.equal(target[k], v) for k, v in saved.items())


def _virtio(root: Path, name: str, device: int, features: str) -> None:
    dev = root / name
    dev.mkdir()
    (dev / "device").write_text(f"0x{device:04x}\n")
    (dev / "features").write_text(features + "0" * 64 + "\n")


def test_huge_pages_are_asked_for_unless_free_memory_is_reported_to_a_hypervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TDCP_READ_HUGEPAGES=auto`` leaves huge pages out where a virtio balloon reports free pages (feature bit 5):
    a machine without one, or a balloon without the feature, keeps them; ``1`` and ``0`` decide either way."""
    from torchrl_dcp.storage import readitems

    assert not readitems.reports_free_pages(tmp_path / "absent")
    _virtio(tmp_path, "virtio0", 2, "01100101")  # a block device: its bit 5 means something else
    _virtio(tmp_path, "virtio1", 5, "01100001")  # a balloon without free page reporting
    assert not readitems.reports_free_pages(tmp_path)
    _virtio(tmp_path, "virtio2", 5, "01100101")  # with it (as on this project's VMs)
    assert readitems.reports_free_pages(tmp_path)

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[madvise]" not in thp.read_text():
        pytest.skip("transparent huge pages are not granted on request (madvise) here")
    for reporting, value, wanted in [
        (True, None, False),
        (False, None, True),
        (True, "1", True),
        (False, "0", False),
    ]:
        monkeypatch.setattr(readitems, "reports_free_pages", lambda r=reporting: r)
        if value is None:
            monkeypatch.delenv("TDCP_READ_HUGEPAGES", raising=False)
        else:
            monkeypatch.setenv("TDCP_READ_HUGEPAGES", value)
        readitems._hugepages_wanted.cache_clear()
        try:
            assert readitems._hugepages_wanted() is wanted, (reporting, value)
        finally:
            readitems._hugepages_wanted.cache_clear()
