"""Planning: which rank writes each tensor (:func:`plan_writes`), and DCP's save/load planners.

Per-rank state already carries rank-specific keys (``rank/<r>/...``) when it is
planned, so only shared state (replicated, and any other key outside ``rank/``)
appears on several ranks. A save plans locally (:func:`plan_local`): each rank writes
its own keys, and every shared tensor is given a writer by a rule every rank computes
alike from the shared tensor list, which the ranks only prove identical (a digest,
:func:`shared_digest`), never exchange. When they are not identical (or to report
which key differs), :func:`plan_writes` plans from every rank's gathered list. State our writer cannot
encode (DTensors, ...) goes through DCP's own writer, whose de-duplication balances
the same way (:class:`SavePlanner`). The load planner refuses byte items (DCP would
``torch.load(weights_only=False)`` them) and checks every destination's dtype and
shape against the saved metadata, which DCP does not do for dtypes.

Example:
    >>> from torchrl_dcp.planner import TensorInfo, plan_local, plan_writes
    >>> a = [TensorInfo("replicated/p/w", "torch.float32", (4,), 16), TensorInfo("rank/0/r/x", "torch.int64", (1,), 8)]
    >>> b = [TensorInfo("replicated/p/w", "torch.float32", (4,), 16), TensorInfo("rank/1/r/x", "torch.int64", (1,), 8)]
    >>> plan = plan_writes([a, b])
    >>> plan.backend, plan.share(0), plan.share(1)
    ('fast', ['replicated/p/w', 'rank/0/r/x'], ['rank/1/r/x'])
    >>> plan_local(b, rank=1, world_size=2).share(1)  # rank 1 alone, no exchange: the same share
    ['rank/1/r/x']
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from torchrl_dcp.chunking import chunk_file_name, chunk_ranges
from torchrl_dcp.errors import EncodingError, IncompatibleComponentError, UnsafeCheckpointError
from torchrl_dcp.format.record import can_write_fast, is_plain_tensor

WriteBackend = Literal["fast", "dcp"]


@dataclass(frozen=True)
class TensorInfo:
    """What ranks exchange about one tensor to plan the writes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def tensor_infos(flat: Mapping[str, torch.Tensor]) -> list[TensorInfo] | None:
    """This rank's tensors as :class:`TensorInfo`, or ``None`` when our writer cannot encode one of them."""
    if not all(can_write_fast(t) for t in flat.values()):
        return None
    return [TensorInfo(k, str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for k, t in flat.items()]


@dataclass(frozen=True)
class ChunkPlan:
    """Rows ``[start, start + rows)`` of a chunked tensor, written by ``owner`` into its own ``file``."""

    key: str
    start: int
    rows: int
    owner: int
    file: str


@dataclass
class WritePlan:
    """Who writes what: every shared key's writer (the same on every rank) and this rank's own keys.

    A plan from :func:`plan_writes` also holds every other rank's own keys; one from
    :func:`plan_local` only this rank's: ``share``, ``chunk_share`` and ``writes`` are
    asked for this rank alone.

    Attributes:
        backend: ``"fast"`` (our writer, :mod:`torchrl_dcp.storage.writer`) or ``"dcp"``
            (DCP's own writer, for DTensors and other tensors ours does not encode).
        owner: the rank that writes each key saved whole (``"fast"`` only).
        chunks: the chunks of each tensor cut along dim 0 (:mod:`torchrl_dcp.chunking`),
            each with its writer and file (``"fast"`` only).
        tensors: every key planned (shared keys and this rank's own) with its dtype and shape (``"fast"`` only).
    """

    backend: WriteBackend
    owner: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    chunks: dict[str, list[ChunkPlan]] = field(default_factory=dict)

    def share(self, rank: int) -> list[str]:
        """The keys ``rank`` writes whole, in the order they were planned."""
        return [k for k, r in self.owner.items() if r == rank]

    def chunk_share(self, rank: int) -> list[ChunkPlan]:
        """The chunks ``rank`` writes, in the order they were planned."""
        return [c for chunks in self.chunks.values() for c in chunks if c.owner == rank]

    def writes(self, rank: int) -> set[str]:
        """Every key ``rank`` writes all or part of."""
        return set(self.share(rank)) | {c.key for c in self.chunk_share(rank)}


def is_own_key(key: str) -> bool:
    """Whether ``key`` belongs to one rank alone (a per_rank component's ``rank/<r>/...``)."""
    return key.startswith("rank/")


def shared_digest(infos: Iterable[TensorInfo] | None, extra: Any = None) -> int:
    """A 64-bit digest of the shared tensors (key, dtype, shape) and ``extra`` (JSON-safe): equal on every rank
    exactly when :func:`plan_local` gives every rank the same writers (``None``: our writer cannot encode)."""
    h = hashlib.blake2b(digest_size=8)
    if infos is None:
        h.update(b"\x00dcp")
    else:
        for info in sorted((i for i in infos if not is_own_key(i.key)), key=lambda i: i.key):
            h.update(f"{info.key}\x00{info.dtype}\x00{info.shape}\x01".encode())
    h.update(json.dumps(extra, sort_keys=True, separators=(",", ":")).encode())
    return int.from_bytes(h.digest(), "little")


def plan_writes(per_rank: list[list[TensorInfo] | None]) -> WritePlan:
    """Plan a save from every rank's :func:`tensor_infos` (the same answer on every rank).

    Raises:
        EncodingError: a key has a different dtype or shape on two ranks (replicated
            state that is not the same everywhere).
    """
    if any(infos is None for infos in per_rank):
        return WritePlan("dcp")
    holders: dict[str, list[int]] = {}
    tensors: dict[str, TensorInfo] = {}
    for r, infos in enumerate(per_rank):
        for info in infos or ():
            seen = tensors.get(info.key)
            if seen is None:
                tensors[info.key] = info
                holders[info.key] = [r]
                continue
            if (seen.dtype, seen.shape) != (info.dtype, info.shape):
                raise EncodingError(
                    f"tensor {info.key!r} is {seen.dtype} {seen.shape} on rank {holders[info.key][0]} but "
                    f"{info.dtype} {info.shape} on rank {r}; replicated state must be the same on every rank "
                    "(register the component with placement='per_rank' if each rank has its own)"
                )
            holders[info.key].append(r)
    return _assign(tensors, holders, len(per_rank))


def plan_local(infos: list[TensorInfo] | None, rank: int, world_size: int) -> WritePlan:
    """This rank's plan from its own :func:`tensor_infos` alone, without an exchange.

    Valid when every rank holds the same shared tensors (equal :func:`shared_digest`): each
    shared key is then held by every rank, and every rank assigns it the same writer (the
    least-loaded rank by shared bytes alone: what other ranks hold of their own is not known
    here). ``None`` (a tensor our writer cannot encode, on any rank): DCP's writer.
    """
    if infos is None:
        return WritePlan("dcp")
    shared = sorted((i for i in infos if not is_own_key(i.key)), key=lambda i: i.key)
    tensors = {i.key: i for i in shared}
    holders = {i.key: list(range(world_size)) for i in shared}
    for info in infos:
        if is_own_key(info.key):
            tensors[info.key] = info
            holders[info.key] = [rank]
    return _assign(tensors, holders, world_size, count_single=False)


def _assign(
    tensors: dict[str, TensorInfo], holders: dict[str, list[int]], world_size: int, count_single: bool = True
) -> WritePlan:
    """Writers of whole keys and of chunks: single holders write their own; each key (or chunk) held by several
    goes to the least-loaded holder, largest first (ties: lowest rank). ``count_single``: a single holder's bytes
    count in its load (only when every rank's keys are known: otherwise ranks would balance differently)."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    cuts: dict[str, list[tuple[int, int, int]]] = {}  # key: [(start, rows, owner)]
    ranges = {k: chunk_ranges(t.shape, _itemsize(t)) for k, t in tensors.items()}
    for key, ranks in holders.items():  # single holders first: their bytes are fixed
        if len(ranks) == 1:
            load[ranks[0]] += tensors[key].nbytes if count_single else 0
            if ranges[key]:
                cuts[key] = [(start, rows, ranks[0]) for start, rows in ranges[key]]
            else:
                owner[key] = ranks[0]
    for key in sorted((k for k, r in holders.items() if len(r) > 1), key=lambda k: (-tensors[k].nbytes, k)):
        if not ranges[key]:
            r = min(holders[key], key=lambda h: (load[h], h))
            owner[key] = r
            load[r] += tensors[key].nbytes
            continue
        row_bytes = tensors[key].nbytes // tensors[key].shape[0]
        cuts[key] = []
        for start, rows in ranges[key]:  # a large replicated tensor is written by all its holders
            r = min(holders[key], key=lambda h: (load[h], h))
            cuts[key].append((start, rows, r))
            load[r] += rows * row_bytes
    return WritePlan("fast", {k: owner[k] for k in tensors if k in owner}, tensors, _name_chunks(tensors, cuts))


def _itemsize(info: TensorInfo) -> int:
    numel = 1
    for n in info.shape:
        numel *= n
    return info.nbytes // numel if numel else 0


def _name_chunks(
    tensors: Mapping[str, TensorInfo], cuts: dict[str, list[tuple[int, int, int]]]
) -> dict[str, list[ChunkPlan]]:
    """Chunk files numbered per writer in key order (``__<rank>_1.distcp``, ...): the same on every rank."""
    counters: dict[int, int] = {}
    out: dict[str, list[ChunkPlan]] = {}
    for key in (k for k in tensors if k in cuts):
        out[key] = []
        for start, rows, r in cuts[key]:
            counters[r] = counters.get(r, 0) + 1
            out[key].append(ChunkPlan(key, start, rows, r, chunk_file_name(r, counters[r])))
    return out


class SavePlanner(DefaultSavePlanner):
    """Our state dicts are flat ``{key: tensor}``: no flattening, balanced de-duplication."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True, dedup_save_to_lowest_rank=False)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only, into destinations whose dtype and shape match what was saved."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True, allow_partial_load=False)

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, dest in state_dict.items():
            saved = metadata.state_dict_metadata.get(key)
            if saved is None:
                raise IncompatibleComponentError(f"tensor {key!r} is not in the checkpoint's DCP metadata")
            if not isinstance(saved, TensorStorageMetadata):
                raise UnsafeCheckpointError(f"entry {key!r} is a byte item, which torchrl_dcp never loads")
            if saved.properties.dtype != dest.dtype or tuple(saved.size) != tuple(dest.shape):
                raise IncompatibleComponentError(
                    f"tensor {key!r} was saved as {saved.properties.dtype} {tuple(saved.size)}, "
                    f"the destination is {dest.dtype} {tuple(dest.shape)}"
                )

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, built directly for plain tensors saved whole (one chunk at the origin).

        DCP's generic planning (protocol ``isinstance`` checks, chunk overlap sweeps) and
        lookups took 1.16 s for 5,000 tensors here, this 0.47 s; the read items are identical.
        DTensors, sharded or chunked entries, and anything else go through DCP.
        """
        items: list[ReadItem] = []
        saved_md = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = saved_md.get(fqn)
            if is_plain_tensor(obj) and isinstance(md, TensorStorageMetadata) and len(md.chunks) == 1:
                chunk, size = md.chunks[0], obj.size()
                if chunk.sizes == size == md.size and not any(chunk.offsets):
                    if obj.numel():  # DCP plans no read for an empty tensor
                        zeros = torch.Size([0] * len(size))
                        items.append(
                            ReadItem(
                                type=LoadItemType.TENSOR,
                                dest_index=MetadataIndex(fqn, zeros, 0),
                                dest_offsets=zeros,
                                storage_index=MetadataIndex(fqn, chunk.offsets, 0),
                                storage_offsets=zeros,
                                lengths=size,
                            )
                        )
                    continue
            items += create_default_local_load_plan({fqn: obj}, self.metadata, not self.allow_partial_load).items
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if is_plain_tensor(obj) and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn!r} is a byte item, which torchrl_dcp never loads")
