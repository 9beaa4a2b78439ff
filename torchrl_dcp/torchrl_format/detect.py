"""Whether a path holds a ``torchrl.checkpoint`` checkpoint (torch-free: the CLI's tools ask it first).

Example:
    >>> import tempfile
    >>> is_torchrl_checkpoint(tempfile.mkdtemp())
    False
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

__all__ = ["FORMAT_NAME", "JSON_LIMIT", "MANIFEST", "is_torchrl_checkpoint", "read_torchrl_manifest"]

FORMAT_NAME = "torchrl.checkpoint"
MANIFEST = "manifest.json"
#: the most bytes one JSON file of a torchrl checkpoint may hold (a manifest, a schema, a buffer's metadata)
JSON_LIMIT = 256 << 20


def is_torchrl_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory or ZIP file whose ``manifest.json`` says ``torchrl.checkpoint``."""
    return read_torchrl_manifest(path) is not None


def read_torchrl_manifest(path: str | os.PathLike) -> dict | None:
    """The parsed ``manifest.json`` of the torchrl checkpoint at ``path`` (not validated: a load does that), or
    ``None`` when ``path`` holds none."""
    p = Path(path)
    try:
        if p.is_dir():
            if not (p / MANIFEST).is_file() or (p / MANIFEST).stat().st_size > JSON_LIMIT:
                return None
            raw = (p / MANIFEST).read_bytes()
        elif p.is_file() and zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                info = z.getinfo(MANIFEST)
                if info.file_size > JSON_LIMIT:
                    return None
                raw = z.read(info)
        else:
            return None
        manifest = json.loads(raw)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return None
    if not isinstance(manifest.get("components"), dict):
        manifest["components"] = {}
    return manifest
