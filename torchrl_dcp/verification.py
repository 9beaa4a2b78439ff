"""Check a checkpoint's integrity without loading it into any object.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> path = tdcp.DistributedCheckpoint(w=torch.nn.Linear(2, 2)).save(tempfile.mkdtemp() + "/c")
    >>> tdcp.verify(path)["files"] >= 2
    True
"""

from __future__ import annotations

import os
from typing import Any

from torchrl_dcp.codec import tensor_specs
from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.manifest import component_inventory
from torchrl_dcp.placement import key_prefix
from torchrl_dcp.storage.container import open_regular
from torchrl_dcp.storage.layout import DCP_METADATA, MANIFEST
from torchrl_dcp.storage.source import CheckpointSource, open_source


def _check_blob_headers(src: CheckpointSource, metadata: Any) -> None:
    """Each tensor's byte range starts with a ZIP local header (every tensor is a ``torch.save`` blob)."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, index.fqn))
    for rel, items in sorted(by_file.items()):
        span = src.container.byte_range(rel)
        fd = open_regular(span.path, span.where)
        try:
            for offset, key in sorted(items):
                if os.pread(fd, 4, span.base + offset) != b"PK\x03\x04":
                    raise CheckpointIntegrityError(
                        f"tensor {key!r} at byte {offset} is not a torch.save blob: the file is inconsistent with "
                        "DCP's metadata (damaged or forged)",
                        path=span.where,
                    )
        finally:
            os.close(fd)


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Validate the manifest, every file's size and checksum, and that DCP's metadata
    holds every tensor the manifest names with the same dtype and shape.

    Returns:
        A summary ``{"path", "files", "bytes", "tensors"}``.

    Raises:
        CheckpointError: naming the first problem found.
    """
    src = open_source(path)
    root = src.path
    manifest = src.manifest()
    src.check(True)
    tensors = 0
    metadata = src.dcp_metadata()
    if metadata is not None:
        saved = metadata.state_dict_metadata
        for name, rec in manifest["components"].items():
            states = (
                [(int(r), s["state"]) for r, s in rec["ranks"].items()]
                if rec["placement"] == "per_rank"
                else [(0, rec["state"])]
            )
            if rec["inventory"] != component_inventory(name, rec):
                raise CheckpointIntegrityError(
                    f"component {name!r}: the tensor inventory disagrees with its saved state", path=root / MANIFEST
                )
            for r, skeleton in states:
                prefix = key_prefix(rec["placement"], name, r)
                for spec in tensor_specs(skeleton):
                    entry = saved.get(f"{prefix}/{spec.key}")
                    props = getattr(entry, "properties", None)
                    if entry is None or props is None or props.dtype != spec.dtype or tuple(entry.size) != spec.shape:
                        raise CheckpointIntegrityError(
                            f"component {name!r}: tensor {spec.key!r} is absent from DCP metadata or differs in "
                            "dtype/shape",
                            path=root / DCP_METADATA,
                        )
                    tensors += 1
        _check_blob_headers(src, metadata)
    elif manifest["components"] and any(rec.get("num_tensors") for rec in manifest["components"].values()):
        raise CheckpointFormatError("manifest lists tensors but no data files", path=root)
    return {
        "path": str(root),
        "files": len(manifest["files"]),
        "bytes": sum(f["size"] for f in manifest["files"].values()),
        "tensors": tensors,
    }
