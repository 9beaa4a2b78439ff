"""The threaded range copier under archives and conversions: content, CRCs, short sources, errors in threads."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from torchrl_dcp.storage import copying
from torchrl_dcp.storage.copying import CopyRange, copy_ranges, run_split


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ranges_are_copied_with_their_crcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(copying, "MIN_PIECE", 7)  # many pieces, split over the threads
    data = os.urandom(5000)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    spans = [(0, 1000, 3000), (1000, 0, 0), (1000, 2500, 100), (4000, 1000, 4000)]  # (src_offset, size, dst_offset)
    done: list[int] = []
    try:
        ranges = [CopyRange(src, a, n, dst, b, "src") for a, n, b in spans]
        crcs = copy_ranges(ranges, threads=threads, buffer_size=64, progress=done.append)
        checks = copy_ranges(
            [CopyRange(src, a, n, None, 0, "src") for a, n, _ in spans], threads=threads, buffer_size=64
        )
    finally:
        os.close(src)
        os.close(dst)
    assert crcs == checks == [zlib.crc32(data[a : a + n]) for a, n, _ in spans]
    out = (tmp_path / "dst").read_bytes()
    assert out[3000:4000] == data[:1000] and out[100:2600] == data[1000:3500] and out[4000:] == data[4000:]
    assert out[:100] == b"\0" * 100
    assert sum(done) == 4500


def test_a_short_source_is_an_integrity_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 100)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with pytest.raises(tdcp.CheckpointIntegrityError, match=r"src: file ended 50 bytes early"):
            copy_ranges([CopyRange(src, 0, 150, None, 0, str(tmp_path / "src"))])
    finally:
        os.close(src)


def test_run_split_balances_runs_and_reraises_from_any_thread() -> None:
    seen: list[list[int]] = []
    run_split(list(range(10)), [1] * 10, 2, seen.append)
    assert sorted(seen) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]

    def fail_on_second(part: list[int]) -> None:
        if 9 in part:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_split(list(range(10)), [1] * 10, 2, fail_on_second)


@pytest.mark.parametrize(
    "cpus, local, world, write, read",
    [(16, "8", "16", 2, 3), (16, "2", "64", 4, 3), (2, "2", "4", 1, 2), (3, "4", "8", 1, 2), (6, None, "12", 4, 3)],
)
def test_thread_counts_share_this_nodes_cpus_among_its_ranks(
    monkeypatch: pytest.MonkeyPatch, cpus: int, local: str | None, world: str, write: int, read: int
) -> None:
    """CPUs of this node // LOCAL_WORLD_SIZE (ranks on this node), never WORLD_SIZE (ranks of every node); readers
    one more (one read more in flight than CPUs)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.delenv("TDCP_WRITE_THREADS", raising=False)
    monkeypatch.delenv("TDCP_READ_THREADS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", world)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert (copying.default_threads(), copying.read_threads()) == (write, read)
    monkeypatch.setenv("TDCP_WRITE_THREADS", "3")
    monkeypatch.setenv("TDCP_READ_THREADS", "5")
    assert (copying.default_threads(), copying.read_threads()) == (3, 5)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * (1 << 20) + 5])
def test_every_range_is_read_front_to_back_starting_with_one_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A first read of one page, then whole pieces: the kernel reads cold files ahead as sequential streams."""
    data = os.urandom(size)
    (tmp_path / "src").write_bytes(data)
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        reads.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        (crc,) = copy_ranges([CopyRange(src, 0, size, None, 0, "src")], threads=1, buffer_size=1 << 20)
    finally:
        os.close(src)
    assert crc == zlib.crc32(data)
    if size:
        assert reads[0] == (0, min(size, 4096))
        assert [o for o, _ in reads] == sorted(o for o, _ in reads)  # front to back
        assert sum(n for _, n in reads) == size
    else:
        assert reads == []
