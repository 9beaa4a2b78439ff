"""Names of the files in a checkpoint, spelled once (no torch needed).

A committed checkpoint (directory or archive) holds ``manifest.json`` (written last: it
is what makes the checkpoint exist), DCP's ``.metadata`` and one data file per rank
that wrote tensors, ``__<rank>_0.distcp``.

Example:
    >>> from torchrl_dcp.storage.layout import MANIFEST, DCP_METADATA, data_file_name
    >>> MANIFEST, DCP_METADATA, data_file_name(3)
    ('manifest.json', '.metadata', '__3_0.distcp')
"""

from __future__ import annotations

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
MAX_MANIFEST_BYTES = 1 << 30  # a manifest (or .metadata) larger than this is refused before it is read


def data_file_name(rank: int) -> str:
    """The data file our writer gives rank ``rank`` (DCP's own writer uses the same name)."""
    return f"__{rank}_0.distcp"


def is_plain_name(name: str) -> bool:
    """A file name that stays inside its checkpoint: no separator, no ``..``, no NUL."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name
