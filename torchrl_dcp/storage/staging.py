"""Reads into tensors on another device (CUDA, ...) through small host windows instead of ``torch.load``.

A record read for a destination off the CPU cannot be ``readinto`` its memory. DCP's
path (``torch.load`` of the whole record, then a copy) holds the record in host
memory three times (read buffer, ``bytes``, the loaded tensor) and copies from
pageable memory. Here the tensor's bytes are read in pieces of at most
``READ_PIECE`` into a window per reading thread (page-locked when the destination is
on CUDA, so the copy runs at the bus's speed), checksummed, and copied into the
destination's bytes (a flat ``uint8`` view of it) before the window is reused: host
memory stays at one window per thread whatever the tensor's size. Copies are
synchronous, so a window is never overwritten while a copy reads it. Small records
(batched reads) bound for CUDA are copied together (:func:`copy_batch`): the batch once
into a page-locked buffer, one asynchronous copy per record, one wait for the stream
before the buffer is reused (a copy from pageable memory waits for itself: on an H200,
5,000 records of 1 KiB took 70 µs each that way). An object store's responses go
through a window (:func:`copy_into`).

Example:
    >>> import torch
    >>> dest = torch.zeros(3)  # on CUDA in use; the CPU reads in place instead, but the code is the same
    >>> data = bytearray(torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
    >>> _ = read_staged(lambda o, v: v.__setitem__(slice(None), data[o : o + len(v)]), 0, dest.view(torch.uint8), False, 1)
    >>> dest.tolist()
    [1.0, 2.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchrl_dcp.format.checksums import crc32
from torchrl_dcp.storage.copying import run_split
from torchrl_dcp.storage.readitems import READ_PIECE


def host_window(size: int, device: torch.device) -> torch.Tensor:
    """``size`` bytes of host memory to read into, page-locked for a CUDA destination where that is possible."""
    if device.type == "cuda":
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: pageable memory works, more slowly
            pass
    return torch.empty(size, dtype=torch.uint8)


def read_staged(
    read_at: Callable[[int, memoryview], None],
    offset: int,
    dest: torch.Tensor,
    crc: bool,
    threads: int,
) -> list[tuple[int, int, int]]:
    """Read ``dest.numel()`` bytes at ``offset`` into ``dest`` (flat ``uint8``: ``readitems.device_bytes``) through
    host windows.

    ``read_at(offset, view)`` fills ``view`` from the file. Pieces are dealt to ``threads`` threads in turn (the
    file is read front to back); returns ``(offset, length, crc32)`` of every piece read when ``crc``.
    """
    n = dest.numel()
    starts = list(range(0, n, READ_PIECE))
    threads = max(1, min(threads, len(starts)))
    results: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]

    def run(part: list[int]) -> None:
        window = host_window(min(READ_PIECE, n), dest.device)
        view = memoryview(window.numpy())
        for k in part:
            for a in starts[k::threads]:
                m = min(READ_PIECE, n - a)
                read_at(offset + a, view[:m])
                if crc:
                    results[k].append((offset + a, m, crc32(view[:m])))
                dest[a : a + m].copy_(window[:m])  # synchronous: the window is free again when it returns

    run_split(list(range(threads)), [1] * threads, threads, run)
    return [p for r in results for p in r]


def copy_record(dest: torch.Tensor, record: Any, at: int, non_blocking: bool = False) -> None:
    """Copy ``dest.numel()`` bytes at ``at`` of ``record`` (a writable bytes-like batch buffer, or a flat ``uint8``
    tensor) into ``dest``; ``non_blocking`` only from page-locked memory the caller waits for."""
    if isinstance(record, torch.Tensor):
        dest.copy_(record[at : at + dest.numel()], non_blocking=non_blocking)
    else:
        dest.copy_(torch.frombuffer(record, dtype=torch.uint8, count=dest.numel(), offset=at))


def copy_batch(
    copies: list[tuple[torch.Tensor, int]], batch: memoryview, window: Callable[[int, torch.device], torch.Tensor]
) -> None:
    """Copy the small records of one batch read (``(dest, offset in batch)``, ``dest`` flat ``uint8``) into their
    device tensors, all copied when it returns.

    ``batch`` is copied once into ``window(size, device)`` (the caller's buffer, page-locked for CUDA) and each record
    from there; with every destination on CUDA and the window page-locked, those copies are asynchronous and the
    streams are waited for once, before the window can be reused.
    """
    if len(copies) == 1:
        dest, at = copies[0]
        copy_record(dest, batch, at)
        return
    devices = {dest.device for dest, _ in copies}
    cuda = all(d.type == "cuda" for d in devices)
    staged = window(len(batch), next(iter(devices)) if cuda else torch.device("cpu"))
    staged[: len(batch)].copy_(torch.frombuffer(batch, dtype=torch.uint8))
    asynchronous = cuda and staged.is_pinned()
    for dest, at in copies:
        copy_record(dest, staged, at, non_blocking=asynchronous)
    if asynchronous:
        for device in devices:
            torch.cuda.current_stream(device).synchronize()  # the window is reused for the next batch


def copy_into(dest: torch.Tensor, data: Any) -> None:
    """Copy the bytes of ``data`` (read-only ones too: an object store's response) into ``dest`` (flat ``uint8``),
    through a host window of at most ``READ_PIECE`` bytes (:func:`read_staged`, reading from memory)."""
    src = memoryview(data).cast("B")
    if len(src) != dest.numel():
        raise ValueError(f"{len(src)} bytes for a destination of {dest.numel()}")
    read_staged(lambda o, view: view.__setitem__(slice(None), src[o : o + len(view)]), 0, dest, False, 1)
