"""Files of a rotation directory: an entry's size, and removing entries and leftovers of killed saves safely.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from torchrl_dcp.rotation_files import _size
    >>> _size(Path(tempfile.mkdtemp()))
    0
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.storage.urls import is_store

_LEFTOVER = re.compile(r"^\.step-(\d+)(\.zip)?\.tdcp-(staging|trash|tmp)-")


def _size(path: Path) -> int | None:
    """Bytes of a file, or of the regular files directly in a directory (links not followed); ``None``: gone."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size
        total = 0
        with os.scandir(path) as it:
            for f in it:
                try:
                    if f.is_file(follow_symlinks=False):
                        total += f.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
        return total
    except (FileNotFoundError, NotADirectoryError):
        return None


def _remove(path: Path) -> bool:
    """Delete an entry: renamed aside first, so a crash never leaves a half-deleted committed entry.

    False when it was already gone (another process pruned it).
    """
    from torchrl_dcp.storage.commit import remove_tree, trash_path

    if is_store(path):
        from torchrl_dcp.storage.objectstore_tools import remove_entry

        return remove_entry(path)  # type: ignore[arg-type]
    if path.name.startswith("."):
        remove_tree(path)
        return True
    trash = trash_path(path)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    remove_tree(trash)
    return True


def _remove_leftover(path: Path) -> bool:
    """Remove a staging/trash/temporary entry of a killed save, unless a live save of its step holds the lock."""
    from torchrl_dcp.storage.commit import DestinationLock

    m = _LEFTOVER.match(path.name)
    assert m is not None
    lock = DestinationLock(path.parent / path.name[1 : path.name.index(".tdcp-")], wait=0.0)
    try:
        lock.acquire()
    except CheckpointError:
        return False  # a save (or conversion) of that step is running: its leftovers are its own
    try:
        return _remove(path)
    finally:
        lock.release()
