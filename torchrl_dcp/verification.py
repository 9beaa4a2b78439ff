"""Check a checkpoint's integrity without loading it into any object.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> path = tdcp.DistributedCheckpoint(w=torch.nn.Linear(2, 2)).save(tempfile.mkdtemp() + "/c")
    >>> tdcp.verify(path)["files"] >= 2
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from torchrl_dcp.errors import CheckpointError, CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.format.dcp_metadata import metadata_difference
from torchrl_dcp.format.layout import MANIFEST, is_data_file
from torchrl_dcp.format.manifest import unchecked
from torchrl_dcp.format.record import stored_record
from torchrl_dcp.load_plan import check_sparse, check_states, check_totals
from torchrl_dcp.placement import is_absent
from torchrl_dcp.storage.archive import byte_counter
from torchrl_dcp.storage.backends import open_source
from torchrl_dcp.storage.source import CheckpointSource
from torchrl_dcp.torchrl_format import is_torchrl_checkpoint


def _check_blob_headers(src: CheckpointSource, metadata: Any) -> None:
    """Each tensor's byte range starts with a ZIP local header (every tensor is a ``torch.save`` blob)."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, index.fqn))
    for rel, items in sorted(by_file.items()):
        for offset, key, head in _heads(src, rel, sorted(items)):
            if head != b"PK\x03\x04":
                raise CheckpointIntegrityError(
                    f"tensor {key!r} at byte {offset} is not a torch.save blob: the file is inconsistent with "
                    "DCP's metadata (damaged or forged)",
                    path=src.container.byte_range(rel).where,
                )


def _check_references(states: dict[str, Any], components: dict[str, Any], source: Any) -> None:
    """Every tensor a component shares with a replicated one (``xref``) has the shape and dtype it is stored with."""
    stored = {
        (name, spec.key): spec
        for name, by_rank in states.items()
        if components[name]["placement"] == "replicated"
        for state in by_rank.values()
        for spec in state.specs
    }
    for name, by_rank in states.items():
        for state in by_rank.values():
            for ref_name, spec in state.refs:
                held = stored.get((ref_name, spec.key))
                if held is None or held.shape != spec.shape or held.dtype != spec.dtype:
                    raise CheckpointIntegrityError(
                        f"component {name!r} refers to replicated/{ref_name}/{spec.key} as {spec.dtype} "
                        f"{list(spec.shape)}, which {'is not stored' if held is None else f'is {held.dtype} {list(held.shape)}'}: "
                        "the manifest is inconsistent or forged",
                        path=source,
                    )


def _check_records_stored(src: CheckpointSource, metadata: Any) -> None:
    """Every record is a ZIP whose members are all STORED (what loads accept: a compressed member would expand in
    ``torch.load``). Two batched reads per data file: the records' end records, then their central directories."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for rel, items in sorted(by_file.items()):
        cache: dict[tuple[int, int], bytes] = {}
        ends = [(o + n - 22, 22) for o, n, _ in items if n >= 22]
        cache.update(zip(ends, src.read_many(rel, ends)))
        dirs = []
        for o, n, _ in items:
            end = cache.get((o + n - 22, 22), b"")
            if len(end) == 22:
                cd_size, cd_offset = int.from_bytes(end[12:16], "little"), int.from_bytes(end[16:20], "little")
                if cd_offset + cd_size <= n:
                    dirs.append((o + cd_offset, cd_size))
        cache.update(zip(dirs, src.read_many(rel, dirs)))
        for o, n, key in items:
            if not stored_record(_reader(src, rel, o, cache), n):
                raise CheckpointIntegrityError(
                    f"tensor {key!r} at byte {o} is not a torch.save record of STORED members (compressed, or "
                    "malformed): loads refuse it; the checkpoint is damaged or forged",
                    path=src.container.byte_range(rel).where,
                )


def _reader(src: CheckpointSource, rel: str, base: int, cache: dict[tuple[int, int], bytes]) -> Any:
    """``read(offset, n)`` inside the record at ``base`` of ``rel``: from ``cache`` (prefetched), else one read."""

    def read(at: int, size: int) -> bytes:
        found = cache.get((base + at, size))
        return found if found is not None else src.read_many(rel, [(base + at, size)])[0]

    return read


def _heads(src: CheckpointSource, rel: str, items: list[tuple[int, str]]) -> Iterator[tuple[int, str, bytes]]:
    """The first 4 bytes of each record ``(offset, key)`` of the data file ``rel`` (a file, or an object)."""
    yield from ((o, k, h) for (o, k), h in zip(items, src.read_many(rel, [(o, 4) for o, _ in items])))


def check_structure(src: Any) -> dict[str, Any]:
    """What ``verify`` checks of a checkpoint's structure, without reading its tensors, for every tool that reads
    one (``verify``, ``diff``): every listed data file carries this save's identity (a file copied in from another
    save with its record resealed is refused, tensors or not), and every component passes the checks a load runs
    (:func:`~torchrl_dcp.load_plan.check_states`: inventory, decodable states, dtypes and shapes backed by records,
    the saving adapter's own checks) and refers only to tensors of replicated components. Returns the checked states
    by component (``{}`` for a checkpoint without tensors)."""
    manifest = src.manifest()
    metadata = src.dcp_metadata()
    if metadata is None:
        return {}
    where = src.path / MANIFEST
    listed = [n for n in manifest["files"] if is_data_file(n)]
    src.check_identity([*listed, *(info.relative_path for info in metadata.storage_data.values())])
    world = manifest["world_size"]
    states = {
        name: check_states(name, rec, metadata, where, world_size=world) for name, rec in manifest["components"].items()
    }
    for name, rec in manifest["components"].items():
        check_totals(name, rec, where)
    _check_references(states, manifest["components"], where)
    return states


def _check_values(src: CheckpointSource, states: dict[str, Any], components: dict[str, Any], where: Any) -> None:
    """The saving adapters' checks of tensor values (:meth:`~torchrl_dcp.adapters.base.Adapter.check_values`) and
    the indices of every sparse tensor (:func:`~torchrl_dcp.load_plan.check_sparse`), as a load runs them: each reads
    only the tensors it asks for (checksummed already)."""
    from torchrl_dcp.adapters import Adapter, adapter_by_id
    from torchrl_dcp.load_engine import read_fresh

    for name, by_rank in states.items():
        adapter = adapter_by_id(components[name]["adapter"])
        known = (  # the saving adapter, when this process knows it and it checks values
            adapter
            if adapter is not None
            and components[name].get("adapter_version") == adapter.version
            and type(adapter).check_values is not Adapter.check_values
            else None
        )
        if known is None and not any(state.sparse for state in by_rank.values()):
            continue
        for state in by_rank.values():
            if is_absent(state.view):
                continue  # (a rank that held none of it: no tensors, nothing the adapter checks)

            def read(spec: Any, prefix: str = state.prefix) -> Any:
                key = f"{prefix}/{spec.key}"
                return read_fresh(src, {key: (spec.shape, spec.dtype)}, verify=False)[key]

            check_sparse(state, read, name, where)  # (whatever the adapter: the codec's own check)
            if known is None:
                continue
            try:
                known.check_values(state.view, read)
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointIntegrityError(
                    f"component {name!r}: {err}: no save writes that state; the checkpoint is damaged or forged",
                    path=where,
                ) from None


def verify(
    path: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Check a checkpoint without loading it: the manifest (its own checksum, schema), every file's size,
    checksum and save identity, DCP's metadata (same save, every byte range inside its file), and for every
    component the checks a load runs (inventory, decodable states, every tensor present with its dtype and
    shape and backed by its record).

    Returns:
        A summary ``{"path", "files", "bytes", "tensors", "unchecked"}``; ``unchecked`` lists what an older
        format cannot prove (e.g. a format-2 manifest has no checksum of its own).

    ``path`` may be an fsspec URL (``s3://bucket/run/step-100``; ``storage_options`` for its file system).
    ``progress``, when given, is called as ``progress(bytes_checksummed, bytes_total)`` while the files' checksums
    are computed (the bulk of the work; from any thread, one call at a time), as the command line's progress bar.

    Raises:
        CheckpointError: naming the first problem found.
    """
    if is_torchrl_checkpoint(path) and not storage_options:
        from torchrl_dcp.torchrl_format.importer import verify_torchrl

        return verify_torchrl(path)  # torchrl.checkpoint's format (read-only): its own checks
    src = open_source(path, storage_options)
    root = src.path
    manifest = src.manifest()
    total = sum(f["size"] for f in manifest["files"].values())
    src.check(True, progress=None if progress is None else byte_counter(total, progress))
    tensors = 0
    metadata = src.dcp_metadata()
    if metadata is not None and manifest.get("index") is not None:  # the manifest's entries against .metadata
        saved = src.saved_dcp_metadata()
        differ = None if saved is None else metadata_difference(metadata, saved)
        if saved is None or differ is not None:
            raise CheckpointIntegrityError(
                f"the manifest places tensors elsewhere than DCP's .metadata does ({differ or 'none listed'}): "
                "one of them is damaged or forged; do not load it",
                path=root,
            )
    if metadata is not None:
        states = check_structure(src)
        tensors += sum(len(s.specs) for by_rank in states.values() for s in by_rank.values())
        _check_blob_headers(src, metadata)
        _check_records_stored(src, metadata)
        src.check_records(metadata)
        _check_values(src, states, manifest["components"], root / MANIFEST)
    elif any(rec.get("num_tensors") or rec.get("inventory") for rec in manifest["components"].values()):
        raise CheckpointFormatError("manifest lists tensors but no data files", path=root)
    return {
        "path": str(root),
        "files": len(manifest["files"]),
        "bytes": sum(f["size"] for f in manifest["files"].values()),
        "tensors": tensors,
        "unchecked": unchecked(manifest),
    }
