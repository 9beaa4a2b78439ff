"""What a ``torchrl.checkpoint`` checkpoint holds (its format's name, its manifest, the files its manifest lists).

Known here, below the storage layer, so that every destination an export replaces (a local directory, an
object-store prefix) replaces exactly the files torchrl wrote there, and keeps (refuses to delete) anything else.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORMAT_NAME", "JSON_LIMIT", "MANIFEST", "written_files"]

FORMAT_NAME = "torchrl.checkpoint"
MANIFEST = "manifest.json"
#: the most bytes one JSON file of a torchrl checkpoint may hold (a manifest, a schema, a buffer's metadata)
JSON_LIMIT = 256 << 20


def written_files(manifest: dict[str, Any]) -> set[str]:
    """The relative paths (``/``-separated) of the files a ``torchrl.checkpoint`` directory with this parsed
    ``manifest`` holds: ``manifest.json`` and each component's listed files under its ``path``. What is replaced
    when an export overwrites it; anything else in the tree is not torchrl's (a user's file, kept: refused).

    Example:
        >>> sorted(written_files({"components": {"n": {"path": "components/0000-n", "files": ["value.json"]}}}))
        ['components/0000-n/value.json', 'manifest.json']
    """
    names = {MANIFEST}
    for rec in (manifest.get("components") or {}).values():
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not isinstance(rec.get("files"), list):
            continue
        names.update(f"{rec['path']}/{f}" for f in rec["files"] if isinstance(f, str))
    return names
