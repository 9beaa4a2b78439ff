"""``populate`` maps a destination's pages before the reads (what object-store loads do while their first requests
are in flight): afterwards the memory is resident, its contents untouched."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from torchrl_dcp.storage.readitems import populate


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
@pytest.mark.parametrize("mib", [4, 16])
def test_populate_makes_fresh_memory_resident_without_changing_it(mib: int) -> None:
    size = mib << 20
    region = mmap.mmap(-1, size)  # anonymous, never touched: not resident yet
    view = memoryview(region)
    before = _resident_bytes()
    done = populate(view)
    if not done:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _resident_bytes() - before >= size - (1 << 20)
    assert ctypes.string_at(ctypes.addressof(ctypes.c_char.from_buffer(region)), 64) == bytes(64)
    view.release()
    region.close()


def test_populate_of_nothing_is_a_no_op() -> None:
    assert populate(memoryview(bytearray(0))) is False
