"""Upgrades of older checkpoints: the format migrations (one registered step per version) and the adapters' payload
migrations, with the helpers steps use on state skeletons.

:func:`~torchrl_dcp.format.manifest.parse_manifest` runs the chain on a copy of an older manifest, step by step,
then validates the result as the current format; a load runs :func:`migrate_component` on each saved state whose
adapter is newer than the one that saved it. Each step is written against the layout as it was (docs/migrations.md).
Users register theirs through :mod:`torchrl_dcp.manifest`.

Example:
    >>> from torchrl_dcp.format.migrations import MIGRATIONS
    >>> sorted(MIGRATIONS)[:3]  # from format 1, 2, 3 ... to the next
    [1, 2, 3]
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointVersionError
from torchrl_dcp.format.manifest_depth import MAPPING_NODES, check_depth


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


Migration = Callable[[dict[str, Any]], dict[str, Any]]
PayloadMigration = Callable[[Any], Any]
MIGRATIONS: dict[int, Migration] = {}
ADAPTER_MIGRATIONS: dict[tuple[str, int], PayloadMigration] = {}


def register_migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register ``fn(manifest) -> manifest`` that upgrades ``from_version`` to ``from_version + 1``.

    The function receives a deep copy (it may edit it in place) and must return the
    manifest with ``format_version == from_version + 1``.

    Example:
        >>> from torchrl_dcp.format.migrations import register_migration
        >>> @register_migration(2)  # doctest: +SKIP
        ... def _v2_to_v3(m):
        ...     m["format_version"] = 3
        ...     return m
    """
    if not _is_int(from_version) or from_version < 1:
        raise ValueError(f"from_version must be a positive integer, got {from_version!r}")

    def wrap(fn: Migration) -> Migration:
        MIGRATIONS[from_version] = fn
        return fn

    return wrap


def register_adapter_migration(adapter_id: str, from_version: int) -> Callable[[PayloadMigration], PayloadMigration]:
    """Register ``fn(state) -> state`` upgrading ``adapter_id``'s payload from ``from_version`` to the next.

    ``state`` is the component's saved state *skeleton* (JSON, see docs/format.md):
    tensors appear as references ``{"t": "tensor", "key": ..., ...}`` that may be moved,
    renamed or dropped, never rewritten (the key says where the bytes are). Applied by
    :meth:`DistributedCheckpoint.load` to each saved state (every rank's, for per_rank
    components) when the registered adapter is newer than the saved one.

    Example:
        >>> from torchrl_dcp.format.migrations import register_adapter_migration, skeleton_dict, make_skeleton_dict
        >>> @register_adapter_migration("example.counter", 1)
        ... def _counter_v1_to_v2(state):
        ...     d = skeleton_dict(state)
        ...     d["value"] = d.pop("count")  # renamed in v2; the tensor stays where it is
        ...     return make_skeleton_dict(d)
    """
    if not isinstance(adapter_id, str) or not adapter_id or not _is_int(from_version) or from_version < 1:
        raise ValueError("register_adapter_migration(adapter_id: str, from_version: positive int)")

    def wrap(fn: PayloadMigration) -> PayloadMigration:
        ADAPTER_MIGRATIONS[(adapter_id, from_version)] = fn
        return fn

    return wrap


def skeleton_dict(node: Any) -> dict[str, Any]:
    """A saved dict's skeleton (``{"t": "dict", "items": [[k, v], ...]}``) as a Python dict of skeletons."""
    if isinstance(node, dict) and node.get("t") in MAPPING_NODES and isinstance(node.get("items"), list):
        return {k: v for k, v in node["items"]}
    raise CheckpointFormatError(f"expected a dict skeleton, found {str(node)[:80]!r}")


def make_skeleton_dict(mapping: dict[str, Any]) -> dict[str, Any]:
    """The skeleton of a plain dict whose values are skeletons (inverse of :func:`skeleton_dict`)."""
    return {"t": "dict", "items": [[k, v] for k, v in mapping.items()]}


def migrate_component(name: str, record: dict[str, Any], target_version: int, source: Any = None) -> dict[str, Any]:
    """A copy of the component ``record`` whose payload is upgraded to ``target_version``.

    Raises:
        CheckpointVersionError: a step of the chain is not registered, or the saved
            payload is newer than ``target_version``.
    """
    adapter_id, version = record["adapter"], record["adapter_version"]
    if version > target_version:
        raise CheckpointVersionError(
            f"component {name!r} was saved with {adapter_id!r} v{version}, the registered adapter reads up to "
            f"v{target_version}: upgrade the library that provides it",
            path=source,
        )
    check_depth(record, source)  # payload migrations may walk the state recursively
    out = copy.deepcopy(record)
    while out["adapter_version"] < target_version:
        current = out["adapter_version"]
        fn = ADAPTER_MIGRATIONS.get((adapter_id, current))
        if fn is None:
            raise CheckpointVersionError(
                f"component {name!r} was saved with {adapter_id!r} v{current} and the registered adapter is "
                f"v{target_version}, but no migration from v{current} is registered "
                "(torchrl_dcp.format.manifest.register_adapter_migration)",
                path=source,
            )
        try:
            if out["placement"] == "per_rank":
                for state in out["ranks"].values():
                    state["state"] = fn(state["state"])
            else:
                out["state"] = fn(out["state"])
        except Exception as err:
            raise CheckpointFormatError(
                f"component {name!r}: migrating {adapter_id!r} v{current} -> v{current + 1} failed "
                f"({type(err).__name__}: {err})",
                path=source,
            ) from err
        out["adapter_version"] = current + 1
    out["inventory"] = component_inventory(name, out)
    return out


def component_inventory(name: str, record: dict[str, Any]) -> dict[str, Any]:
    """``{dcp_key: {"dtype", "shape"}}`` of every tensor a component record's states name (all ranks)."""
    from torchrl_dcp.format.codec import dtype_name, tensor_specs
    from torchrl_dcp.placement import key_prefix

    placement = record["placement"]
    if placement == "per_rank":
        states = [(int(r), s["state"]) for r, s in sorted(record["ranks"].items(), key=lambda kv: int(kv[0]))]
    else:
        states = [(0, record["state"])]
    inventory: dict[str, Any] = {}
    for rank, state in states:
        prefix = key_prefix(placement, name, rank)
        for spec in sorted(tensor_specs(state), key=lambda s: s.key):
            inventory[f"{prefix}/{spec.key}"] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape)}
    return inventory


def _with_inventory(name: str, record: dict[str, Any]) -> dict[str, Any]:
    from torchrl_dcp.format.codec import dtype_from_name

    record["inventory"] = component_inventory(name, record)
    for key, entry in record["inventory"].items():  # (a shape's product is computed below: a 4,000-digit one is
        shape = entry.get("shape") if isinstance(entry, dict) else None  # no tensor, and breaks every printer)
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise ValueError(f"tensor {key!r} has shape {str(shape)[:80]}, not sizes below 2**63")
        if math.prod(shape) >= 2**63:  # (each size below it, their product past any tensor's element count)
            raise ValueError(f"tensor {key!r} has shape {str(shape)[:80]}, of 2**63 elements or more")
    record["num_tensors"] = len(record["inventory"])
    record["nbytes"] = sum(
        math.prod(t["shape"]) * dtype_from_name(t["dtype"]).itemsize for t in record["inventory"].values()
    )
    return record


@register_migration(1)
def _v1_to_v2(manifest: dict[str, Any]) -> dict[str, Any]:
    """v2 adds each component's tensor ``inventory`` and counts ``num_tensors``/``nbytes`` over every rank."""
    components = manifest.get("components")
    for name, record in components.items() if isinstance(components, dict) else ():
        if isinstance(record, dict):
            try:
                _with_inventory(name, record)
            except (KeyError, TypeError, AttributeError, ValueError) as err:
                raise CheckpointFormatError(f"malformed v1 component {name!r}: {err}") from None
    manifest["format_version"] = 2
    return manifest


@register_migration(2)
def _v2_to_v3(manifest: dict[str, Any]) -> dict[str, Any]:
    """v3 adds ``save_id`` and ``manifest_checksum``; a v2 checkpoint has neither (``verify`` says so)."""
    manifest["save_id"] = None
    manifest["manifest_checksum"] = None
    manifest["format_version"] = 3
    return manifest


@register_migration(3)
def _v3_to_v4(manifest: dict[str, Any]) -> dict[str, Any]:
    """v4 adds ``chunks`` (tensors cut into chunk files) and per-file ``origin``; a v3 checkpoint has neither."""
    manifest["chunks"] = {}
    manifest["format_version"] = 4
    return manifest


@register_migration(4)
def _v4_to_v5(manifest: dict[str, Any]) -> dict[str, Any]:
    """v5 moves per-rank states into shards (``sharded``) and records storage entries (``index``); a v4 checkpoint
    holds everything in its root and leaves storage entries to ``.metadata``."""
    manifest["sharded"] = False
    manifest["index"] = None
    manifest["format_version"] = 5
    return manifest


@register_migration(5)
def _v5_to_v6(manifest: dict[str, Any]) -> dict[str, Any]:
    """v6 writes replicated tensors into ``__<rank>_shared.distcp``; a v5 checkpoint keeps them in its ranks' data
    files, where its manifest says they are: nothing to change."""
    manifest["format_version"] = 6
    return manifest


@register_migration(6)
def _v6_to_v7(manifest: dict[str, Any]) -> dict[str, Any]:
    """v7 lists each rank's own files in its shard (``rank_files`` counts them in the root); a v6 root lists every
    file itself, which ``rank_files`` ``null`` says (its shards list none)."""
    manifest["rank_files"] = None
    manifest["format_version"] = 7
    return manifest


@register_migration(7)
def _v7_to_v8(manifest: dict[str, Any]) -> dict[str, Any]:
    """v8 packs what the root says of each rank (its shard's size and CRC-32 in ``files``, its own files' count and
    bytes in ``rank_files``) into ``rank_table`` (:mod:`torchrl_dcp.format.rank_table`); a v7 root lists them one
    JSON record per rank. Shards of a migrated format-6 root (``rank_files`` ``null``) are of version 5."""
    from torchrl_dcp.format.layout import shard_name
    from torchrl_dcp.format.rank_table import RankRow, crc_of, rank_table

    files, counted, world = manifest.get("files"), manifest.pop("rank_files", None), manifest.get("world_size")
    manifest["rank_table"] = None
    manifest["format_version"] = 8
    if manifest.get("sharded") is not True:
        return manifest
    if not isinstance(files, dict) or not _is_int(world) or not 0 < world <= 2**31:
        raise CheckpointFormatError("a sharded manifest needs files and a world size")
    if counted is not None and (not isinstance(counted, list) or len(counted) != world):
        raise CheckpointFormatError("rank_files must hold [count, bytes] of each saved rank's own files")
    rows = []
    for r in range(world):
        rec = files.pop(shard_name(r), None)
        if isinstance(rec, dict) and set(rec) != {"size", "checksum"}:  # (an origin: no save writes one on a shard)
            raise CheckpointFormatError(f"the record of {shard_name(r)} holds {sorted(rec)}: no save writes that")
        size = rec.get("size") if isinstance(rec, dict) else None
        crc = crc_of(rec.get("checksum")) if isinstance(rec, dict) else None
        if not _is_int(size) or not 0 <= size < 2**64 or crc is None:
            raise CheckpointFormatError(
                f"a sharded manifest lists one shard per saved rank with its size and CRC-32, not {shard_name(r)}: "
                f"{rec!r}"
            )
        own = [0, 0] if counted is None else counted[r]
        if not (isinstance(own, list) and len(own) == 2 and all(_is_int(v) and v >= 0 for v in own)):
            raise CheckpointFormatError(f"rank_files[{r}] must be [count, bytes] of rank {r}'s own files")
        if own[0] >= 2**32 or own[1] >= 2**64:
            raise CheckpointFormatError(f"rank_files[{r}] counts more files or bytes than a save writes: {own}")
        rows.append(RankRow(size, crc, own[0], own[1]))
    manifest["rank_table"] = rank_table(rows, 5 if counted is None else 7)
    return manifest
