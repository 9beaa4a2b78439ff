"""Replicated means replicated: every rank's copy of a replicated component is compared before a save is written.

A replicated component is written once (by whichever rank the plan picks), so ranks
that disagree would otherwise commit a state that never existed (one rank's
``weight``, another's ``bias``), or every rank would resume with one rank's values of
what was really per-rank state (a plain dict registered without ``placement=``).
Before anything is written, each rank computes a digest of its replicated
components; a hash of them enters the save's one agreement
(:func:`torchrl_dcp._dist.agree`, a fixed-size ``all_reduce``). Only when the hashes
differ are the digests gathered and compared, the same way on every rank, so every
rank raises the same :class:`~torchrl_dcp.errors.EncodingError` naming the component,
the key and the ranks.

Modes (``DistributedCheckpoint(replica_check=...)``, or per component at ``register``):

- ``"sample"`` (default): the JSON values are compared whole; each tensor by a CRC-32
  of its dtype, shape and up to 64 evenly spaced 1 KiB slices of its bytes (all of
  them below 64 KiB). Cheap at any size; a difference confined to unsampled bytes of
  a large tensor goes unnoticed.
- ``"full"``: every byte of every tensor (CRC-32, about 14 GB/s per core here).
- ``"off"``: not compared.

Example:
    >>> import torch
    >>> from torchrl_dcp.replicas import fingerprint
    >>> fingerprint(torch.zeros(4), "full") == fingerprint(torch.zeros(4), "sample")
    True
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch

from torchrl_dcp import _dist
from torchrl_dcp.errors import EncodingError
from torchrl_dcp.format.checksums import crc32
from torchrl_dcp.format.codec import is_dtensor
from torchrl_dcp.format.manifest_depth import MAPPING_NODES
from torchrl_dcp.format.record import byte_view, host_bytes, plain_tensor

ReplicaCheck = Literal["sample", "full", "off"]
REPLICA_CHECKS: tuple[str, ...] = get_args(ReplicaCheck)
SLICE = 1 << 10
SLICES = 64
WHOLE_ON_HOST = 1 << 20  # "full": device tensors below this are copied to the host together


def check_mode(mode: str) -> ReplicaCheck:
    if mode not in REPLICA_CHECKS:
        raise ValueError(f"replica_check must be one of {REPLICA_CHECKS}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return byte_view(plain_tensor(t))


def fingerprint(t: torch.Tensor, mode: ReplicaCheck, data: Any = None) -> str:
    """A short fingerprint of a tensor's dtype, shape and bytes (all of them, or evenly spaced slices); ``data``:
    its bytes in host memory when the caller has them (:func:`~torchrl_dcp.format.record.host_bytes`)."""
    head = f"{t.dtype}:{tuple(t.shape)}:"
    n = t.numel() * t.element_size()
    if n == 0:
        return head
    if mode == "full" or n <= SLICES * SLICE:
        return head + f"{crc32(_host_bytes(t) if data is None else data):08x}"
    flat = _byte_view(t)
    step = (n - SLICE) // (SLICES - 1)
    data = torch.cat([flat[i * step : i * step + SLICE] for i in range(SLICES)])
    return head + f"{crc32(data.cpu().numpy()):08x}"


def _host_bytes(t: torch.Tensor) -> Any:
    """The tensor's bytes as a host buffer: zero-copy for contiguous CPU tensors numpy can view."""
    if t.device.type == "cpu" and t.is_contiguous() and type(t) in (torch.Tensor, torch.nn.Parameter):
        try:
            return t.detach().numpy()
        except (TypeError, RuntimeError):  # bfloat16 & co.: numpy has no such dtype
            pass
    return _byte_view(t).cpu().numpy()


def _without_devices(node: Any) -> Any:
    """A skeleton with tensor devices left out (ranks hold replicas on their own devices)."""
    if isinstance(node, dict):
        return {k: _without_devices(v) for k, v in node.items() if k != "device"}
    if isinstance(node, list):
        return [_without_devices(v) for v in node]
    return node


def digest(
    records: Mapping[str, Any], flat: Mapping[str, torch.Tensor], modes: Mapping[str, ReplicaCheck]
) -> dict[str, tuple[str, dict[str, str]]]:
    """``{component: (state digest, {dcp_key: tensor fingerprint})}`` of this rank's replicated components, and of
    the sharded ones' values and plain tensors (DCP writes those once, as replicated: a sharded component's
    ``{"w": DTensor, "step": tensor, "count": 3}`` differing in ``step`` or ``count`` loaded one rank's on every
    rank). The digest of a sharded component starts with :data:`SHARDED`."""
    out: dict[str, tuple[str, dict[str, str]]] = {}
    for name, rec in records.items():
        mode = modes.get(name, "sample")
        if rec.placement not in ("replicated", "sharded") or mode == "off":
            continue
        state = json.dumps(_without_devices(rec.state), sort_keys=True, separators=(",", ":")).encode()
        keys = list(rec.inventory)
        if rec.placement == "sharded":
            keys = [key for key in keys if not is_dtensor(flat[key])]  # (each rank's shard: its own by design)
        tensors = [flat[key] for key in keys]
        # the bytes hashed whole, of small tensors on a device, copied to the host together (not one copy each)
        on_host = host_bytes(tensors, SLICES * SLICE + 1 if mode == "sample" else WHOLE_ON_HOST)
        prints = {key: fingerprint(t, mode, on_host.get(i)) for i, (key, t) in enumerate(zip(keys, tensors))}
        if rec.placement == "sharded":
            prints.update(_replicated_shards(rec.inventory, flat, mode))
        out[name] = (f"{SHARDED if rec.placement == 'sharded' else ''}{crc32(state):08x}", prints)
    return out


#: the prefix of a DTensor's local shard fingerprint, compared among the ranks that hold the same shard
REPLICA_OF = "replica of "


def _replicated_shards(keys: Any, flat: Mapping[str, torch.Tensor], mode: ReplicaCheck) -> dict[str, str]:
    """``{"replica of <key> at offsets <o>": fingerprint}`` of each DTensor's local shard, by its place in the whole
    tensor: DCP writes one copy of each place (the write items of one key and offsets, deduplicated), so the ranks
    holding one place must hold the same bytes. Those are the copies along a ``Replicate()`` mesh dimension (HSDP's
    ``(Replicate(), Shard(0))``) and on the data-parallel copies of a tensor-parallel submesh (``mesh["tp"]``): a
    copy that drifted was written once and loaded everywhere."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, str] = {}
    for key in keys:
        t = flat[key]
        if not is_dtensor(t) or t.device_mesh.get_coordinate() is None:  # (this rank holds no part of it)
            continue
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if not math.prod(sizes):
            continue
        out[f"{REPLICA_OF}{key} at offsets {list(offsets)}"] = fingerprint(t.to_local(), mode)
    return out


SHARDED = "sharded:"  #: the prefix of a sharded component's digest (its error says what is compared)

MAX_VALUE_PATHS = 4096  #: non-tensor values of one component digested one by one to name the one that differs


def with_value_paths(
    records: Mapping[str, Any], digests: dict[str, tuple[str, dict[str, str]]]
) -> dict[str, tuple[str, dict[str, str], dict[str, str]]]:
    """``digests`` with, per component, a digest of each of its non-tensor values by path (``['opt']['lr']``; at most
    :data:`MAX_VALUE_PATHS`): computed only once the ranks disagree, to name the value that differs."""
    out = {}
    for name, (state, tensors) in digests.items():
        paths: dict[str, str] = {}
        _value_paths(records[name].state, "", paths)
        out[name] = (state, tensors, paths)
    return out


def _value_paths(node: Any, path: str, out: dict[str, str]) -> None:
    if len(out) >= MAX_VALUE_PATHS:
        return
    if isinstance(node, dict) and node.get("t") in MAPPING_NODES and isinstance(node.get("items"), list):
        for item in node["items"]:
            key = item[0] if isinstance(item, list) and len(item) == 2 else None
            shown = repr(key) if isinstance(key, (str, int, float, bool, type(None))) else "<key>"
            _value_paths(item[1] if isinstance(item, list) and len(item) == 2 else item, f"{path}[{shown}]", out)
        return
    if isinstance(node, dict) and node.get("t") in ("list", "tuple") and isinstance(node.get("items"), list):
        for i, item in enumerate(node["items"]):
            _value_paths(item, f"{path}[{i}]", out)
        return
    if isinstance(node, dict) and node.get("t") in ("tensor", "dtensor", "xref", "alias"):
        return  # (tensors are compared by their fingerprints)
    text = json.dumps(node, sort_keys=True, separators=(",", ":")).encode()
    out[path or "value (the whole state)"] = f"{crc32(text):08x}"


def compare(per_rank: list[dict[str, tuple[Any, ...]]], group: Any = None) -> None:
    """Raise :class:`EncodingError` naming the first replicated component that differs between ranks (and in it the
    tensor, or the non-tensor value when :func:`with_value_paths` gave their digests; the ranks with their global
    ranks when ``group`` is a subgroup)."""
    if len(per_rank) < 2:
        return
    _compare_replicated_shards(per_rank, group)
    first = per_rank[0]
    for name, (state, tensors, *_) in first.items():
        for r, other in enumerate(per_rank[1:], start=1):
            if name not in other:
                continue  # not saved (or not checked) there: the encode step reports real mismatches
            other_state, other_tensors = other[name][:2]
            differ = [
                k
                for k in {**tensors, **other_tensors}
                if other_tensors.get(k) != tensors.get(k) and not k.startswith(REPLICA_OF)
            ]
            if not differ and other_state == state:
                continue
            what = f"tensor {differ[0]!r}" if differ else "its non-tensor values (JSON state)"
            if not differ and len(first[name]) > 2 and len(other[name]) > 2:
                paths, other_paths = first[name][2], other[name][2]
                values = [p for p in {**paths, **other_paths} if paths.get(p) != other_paths.get(p)]
                if values:
                    where = values[0]
                    what = f"its non-tensor value at {name}{where}" if where[0] == "[" else f"its non-tensor {where}"
                else:  # every value alike, by path: what holds them is not
                    what = (
                        "its structure, its values alike (a dict's key order, or a tensor's kind or layout: a "
                        "Parameter on one rank, another stride)"
                    )
            if state.startswith(SHARDED):
                raise EncodingError(
                    f"sharded component {name!r} differs between rank {_named(group, 0)} and rank "
                    f"{_named(group, r)} outside its DTensors: {what}. Its plain tensors and values are written "
                    "once, as DCP writes them, so the checkpoint would hold a state that never existed; nothing was "
                    "written. Make them identical on every rank (or DTensors), or register each rank's own values "
                    "as a per_rank component (replica_check='off' skips this check for it)"
                )
            raise EncodingError(
                f"replicated component {name!r} differs between rank {_named(group, 0)} and rank {_named(group, r)}: "
                f"{what}. A replicated "
                "component is written once, so the checkpoint would hold a state that never existed; nothing "
                "was written. Make it identical on every rank, or register it with placement='per_rank' if "
                "each rank has its own (replica_check='off' skips this check for it)"
            )


def _compare_replicated_shards(per_rank: list[dict[str, tuple[Any, ...]]], group: Any) -> None:
    """Every copy of a DTensor's replicated shard (:func:`_replicated_shards`) alike, among the ranks holding it."""
    held: dict[tuple[str, str], tuple[int, str]] = {}
    for r, digests in enumerate(per_rank):
        for name, (_, tensors, *_) in digests.items():
            for key, value in tensors.items():
                if not key.startswith(REPLICA_OF):
                    continue
                first = held.setdefault((name, key), (r, value))
                if first[1] != value:
                    raise EncodingError(
                        f"sharded component {name!r}: the {key} (a place of a DTensor several ranks hold: along a "
                        f"Replicate() mesh dimension, or on data-parallel copies of a submesh) differs between rank {_named(group, first[0])} and rank {_named(group, r)}: DCP "
                        "writes one copy, so the checkpoint would hold one rank's for every rank; nothing was "
                        "written. Make the copies identical (a broadcast, or the same updates on every replica), or "
                        "register it with replica_check='off' to skip this check"
                    )


def _named(group: Any, rank: int) -> str:
    return str(rank) if group is None else _dist.ranks_named(group, str(rank))
