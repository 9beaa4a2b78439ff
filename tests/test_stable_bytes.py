"""What a writer checksums is what it writes: live memory is copied first, a save's own staging buffers are not."""

from __future__ import annotations

import gc

import numpy
import torch

from torchrl_dcp.storage.stable_bytes import own, owned, stable_piece


def _address(view: memoryview) -> int:
    return numpy.frombuffer(view, numpy.uint8).__array_interface__["data"][0]


def test_live_memory_is_copied_and_the_copy_holds_the_bytes_of_the_call() -> None:
    live = torch.arange(1 << 18, dtype=torch.int32)
    view = memoryview(live.numpy()).cast("B")
    piece = stable_piece(view)
    assert _address(piece) != live.data_ptr()
    expected = bytes(view)
    live.add_(1)  # a collector's thread writes the rows after the copy: the piece keeps the bytes it had
    assert bytes(piece) == expected


def test_a_saves_own_buffer_is_written_from_in_place() -> None:
    staged = torch.zeros(4096, dtype=torch.uint8)
    own(staged)
    view = memoryview(staged.numpy())
    assert _address(stable_piece(view[1024:2048])) == staged.data_ptr() + 1024
    assert owned(staged.data_ptr(), 4096) and not owned(staged.data_ptr() + 1, 4096)  # a range reaching past it


def test_ownership_ends_with_the_buffer() -> None:
    staged = torch.zeros(4096, dtype=torch.uint8)
    own(staged)
    start = staged.data_ptr()
    assert owned(start, 4096)
    del staged
    gc.collect()
    assert not owned(start, 4096)  # memory freed, maybe reused by a live tensor: copied again


def test_memory_mapped_rows_written_in_place_by_an_async_save_are_copied(tmp_path) -> None:
    from tensordict import MemoryMappedTensor

    rows = MemoryMappedTensor.zeros(256, 64, filename=str(tmp_path / "rows.memmap"))
    view = memoryview(rows.numpy()).cast("B")
    assert _address(stable_piece(view)) != rows.data_ptr()


def test_an_async_saves_staging_buffers_are_its_own(tmp_path) -> None:
    import torchrl_dcp as tdcp

    big = torch.randn(1 << 16)  # staged into a buffer of its own
    ckpt = tdcp.DistributedCheckpoint(state={"big": big, "a": torch.ones(3), "b": torch.zeros(5)})
    ckpt.async_save(tmp_path / "step-1", step=1).wait()
    saver = ckpt._async
    buffers = list(saver._buffers.values())  # (small CUDA tensors share one, owned alike: _stage_together)
    assert len(buffers) == 3 and all(owned(b.data_ptr(), b.numel() * b.element_size()) for b in buffers)
    assert not owned(big.data_ptr(), big.numel() * 4)  # the live tensor is not
    ckpt.load(tmp_path / "step-1")
