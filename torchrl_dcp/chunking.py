"""How large tensors are cut into chunk files along their first dimension.

A tensor of at least :data:`MIN_CHUNKED_BYTES` with two or more rows is saved as
consecutive row ranges of about :data:`CHUNK_BYTES` each, every range a DCP chunk (its
own ``ChunkStorageMetadata``, so a plain ``dcp.load`` assembles the tensor) stored in a
file of its own. The cut depends only on the tensor's shape and dtype, so two saves of
the same buffer cut it the same way and an incremental save (:mod:`torchrl_dcp.incremental`)
can keep every chunk file whose rows did not change. Chunks of a replicated tensor are
spread over the ranks that hold it, so one large tensor is written by all of them.

The chunk size trades per-file costs against what an incremental save rewrites: a
contiguous write of ``n`` bytes since the last save touches at most
``n / CHUNK_BYTES + 2`` chunks (``benchmarks/incremental.py`` measures the trade-off;
docs/incremental.md has the figures).

Example:
    >>> from torchrl_dcp.chunking import chunk_ranges
    >>> chunk_ranges((10,), 4, chunk_bytes=16, min_bytes=32)
    [(0, 4), (4, 4), (8, 2)]
    >>> chunk_ranges((3,), 4, chunk_bytes=16, min_bytes=32)  # too small: one record
    []
"""

from __future__ import annotations

import math

from torchrl_dcp.settings import setting_at_import

CHUNK_BYTES = setting_at_import("TDCP_CHUNK_BYTES")
MIN_CHUNKED_BYTES = setting_at_import("TDCP_MIN_CHUNKED_BYTES") or 2 * CHUNK_BYTES


def chunk_ranges(
    shape: tuple[int, ...],
    itemsize: int,
    *,
    chunk_bytes: int | None = None,
    min_bytes: int | None = None,
) -> list[tuple[int, int]]:
    """``[(first_row, rows), ...]`` covering dim 0 of a tensor, or ``[]`` when it is saved whole."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    min_bytes = MIN_CHUNKED_BYTES if min_bytes is None else min_bytes
    if not shape or shape[0] < 2 or chunk_bytes <= 0:
        return []
    row_bytes = math.prod(shape[1:]) * itemsize
    if row_bytes == 0 or row_bytes * shape[0] < min_bytes:
        return []
    per_chunk = max(1, chunk_bytes // row_bytes)
    if per_chunk >= shape[0]:
        return []
    return [(start, min(per_chunk, shape[0] - start)) for start in range(0, shape[0], per_chunk)]


def chunk_file_name(rank: int, index: int) -> str:
    """The name of the ``index``-th chunk file (from 1) written by ``rank``; DCP's own pattern, ``__<rank>_<n>``."""
    return f"__{rank}_{index}.distcp"
