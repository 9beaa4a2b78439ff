"""Read a component's state out of a checkpoint without the original objects or a process group.

Used by the CLI (``diff``) and by :func:`torchrl_dcp.export_torchrl`. Reads go
through the same safe path as :meth:`DistributedCheckpoint.load` (allow-listed DCP
metadata, no byte items, checksums of the files read) on a directory or an archive.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.extract import read_component
    >>> path = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1)).save(tempfile.mkdtemp() + "/c")
    >>> sorted(read_component(path, "policy"))
    ['bias', 'weight']
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchrl_dcp.format.codec import decode, dtype_from_name, tensor_specs, xref_key, xrefs
from torchrl_dcp.load_engine import read_fresh
from torchrl_dcp.placement import is_absent_skeleton, key_prefix
from torchrl_dcp.storage.backends import open_source
from torchrl_dcp.storage.source import CheckpointSource

BATCH_BYTES = 256 << 20


def as_source(path: str | os.PathLike | CheckpointSource) -> CheckpointSource:
    """``path`` opened as a :class:`CheckpointSource` (a source is returned as it is)."""
    return path if isinstance(path, CheckpointSource) else open_source(path)


def read_tensors(
    source: str | os.PathLike | CheckpointSource,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Read the tensors ``{dcp_key: (shape, dtype)}`` into fresh CPU tensors (no process group needed).

    Args:
        verify: checksum the data files that hold them (while reading them: the tensors are fresh).
    """
    return read_fresh(as_source(source), specs, verify=verify)


def component_states(manifest: Mapping[str, Any], name: str) -> list[tuple[int, Any]]:
    """``[(rank, skeleton)]`` of a saved component: one entry, or one per saved rank (per_rank)."""
    try:
        rec = manifest["components"][name]
    except KeyError:
        raise KeyError(f"no component {name!r}; the checkpoint holds {sorted(manifest['components'])}") from None
    if rec["placement"] == "per_rank":
        return sorted(((int(r), s["state"]) for r, s in rec["ranks"].items()), key=lambda rs: rs[0])
    return [(0, rec["state"])]


def read_component(
    source: str | os.PathLike | CheckpointSource, name: str, *, rank: int | None = None, verify: bool = True
) -> Any:
    """The decoded state of component ``name`` (for per_rank components, that of ``rank``).

    Tensors come back on the CPU; the state is what the adapter's ``state()`` returned
    at save time (e.g. a module's state dict).
    """
    src = as_source(source)
    manifest = src.manifest()
    rec = manifest["components"].get(name)
    if rec is None:
        raise KeyError(f"no component {name!r}; the checkpoint holds {sorted(manifest['components'])}")
    states = dict(component_states(manifest, name))
    if rec["placement"] == "per_rank":
        if rank is None:
            raise ValueError(f"component {name!r} is per_rank (saved by {len(states)} ranks): pass rank=...")
        if rank not in states:
            raise KeyError(f"component {name!r} was saved by ranks {sorted(states)}, not {rank}")
        if is_absent_skeleton(states[rank]):
            held = sorted(r for r, s in states.items() if not is_absent_skeleton(s))
            raise KeyError(
                f"component {name!r}: rank {rank} registered none when it was saved (other ranks did: {held}); "
                "pass one of those ranks"
            )
    else:
        rank = 0
    skeleton = states[rank]
    prefix = key_prefix(rec["placement"], name, rank)
    specs = {f"{prefix}/{s.key}": (s.shape, s.dtype) for s in tensor_specs(skeleton)}
    refs = {f"{key_prefix('replicated', r, 0)}/{s.key}": (r, s) for r, s in xrefs(skeleton)}
    specs.update({k: (s.shape, s.dtype) for k, (_, s) in refs.items()})
    flat = read_tensors(src, specs, verify=verify)
    tensors = {s.key: flat[f"{prefix}/{s.key}"] for s in tensor_specs(skeleton)}
    tensors.update({xref_key(r, s.key): flat[k] for k, (r, s) in refs.items()})
    return decode(skeleton, tensors)


def iter_inventory(
    source: str | os.PathLike | CheckpointSource, name: str, *, batch_bytes: int = BATCH_BYTES, verify: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a component's inventory as ``(dcp_key, tensor)``, read in batches of about ``batch_bytes``."""
    src = as_source(source)
    inventory = src.manifest()["components"][name]["inventory"]
    batch: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    size = 0
    for key in sorted(inventory):
        dtype = dtype_from_name(inventory[key]["dtype"])
        shape = tuple(inventory[key]["shape"])
        batch[key] = (shape, dtype)
        size += torch.Size(shape).numel() * dtype.itemsize
        if size >= batch_bytes:
            yield from read_tensors(src, batch, verify=verify).items()
            batch, size = {}, 0
    if batch:
        yield from read_tensors(src, batch, verify=verify).items()
