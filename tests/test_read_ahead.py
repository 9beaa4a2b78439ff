"""Loads of a checkpoint cut into many chunk files announce the next files to the kernel before reading them
(``POSIX_FADV_WILLNEED``), at most ``READ_AHEAD`` bytes ahead, each file once; ``TDCP_READ_AHEAD=0`` turns it off.
The hint never changes what is read: the loaded tensors are the saved ones, with or without it."""

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
