"""The forger's tools, shared by the adversarial tests: edit a saved checkpoint directory the way an attacker who
knows docs/format.md would, and reseal everything it documents.

The manifest is edited in the shape readers see (:func:`read_parts`: the root with every rank's shard merged in:
per-rank components with ``ranks`` and ``inventory``, one ``chunks`` table, one ``index``) and written back as a
root and shards (:func:`write_parts`): each shard's size and CRC-32 recorded in the root's ``rank_table`` (format 8;
``files`` before), the root sealed. A forged ``.metadata`` is mirrored into the manifest's storage entries where they can say the same
(:func:`forge_metadata`): a forger who moves a record moves it in both.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchrl_dcp.format.layout import shard_name
from torchrl_dcp.format.manifest import dumps, seal
from torchrl_dcp.format.shards import assemble, record_shards, split
from torchrl_dcp.storage.filesums import file_checksum
from torchrl_dcp.storage.filesystem import safe_load_metadata


def read_parts(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path`` with every shard merged in (nothing validated)."""
    root = json.loads((path / "manifest.json").read_text())
    if not root.get("sharded"):
        return root
    shards = {r: json.loads((path / shard_name(r)).read_text()) for r in range(root["world_size"])}
    m = assemble(root, shards, path)
    m.pop("shards_read", None)
    return m


def write_parts(path: Path, m: dict[str, Any], *, text: Callable[[dict[str, Any]], str] | None = None) -> None:
    """Write ``m`` (as :func:`read_parts` gives it) back as the root and its shards, every record resealed.
    ``text``: how to spell the sealed root (default: the canonical bytes)."""
    if m.get("format_version", 0) < 5:  # an older format: one file, as it was
        root, shards = dict(m), {}
    else:
        root, shards = split(m)
    records = {}
    for r, shard in shards.items():
        data = dumps(shard)
        (path / shard_name(r)).write_bytes(data)
        records[r] = {"size": len(data), "checksum": file_checksum(path / shard_name(r))}
    record_shards(root, records)  # (format 8: in the root's rank table; older: in its files)
    sealed = seal(root)
    if text is None:
        (path / "manifest.json").write_bytes(dumps(sealed))
    else:
        (path / "manifest.json").write_text(text(sealed))


def mirror_into_metadata(path: Path, m: dict[str, Any]) -> bool:
    """Rewrite ``.metadata`` from the manifest ``m``'s inventories and storage entries (what a forger who edited
    the entries writes there too), recording it in ``m``'s ``files``; ``False`` (nothing written) when the
    entries say nothing DCP's metadata can (an entry without its place)."""
    from torchrl_dcp.storage.source import metadata_from_index

    if m.get("index") is None:
        return False
    try:
        md = metadata_from_index(m, str(path), path)
    except Exception:  # noqa: BLE001 - a forgery beyond what .metadata can say
        return False
    md.storage_meta.save_id = m.get("save_id")
    (path / ".metadata").write_bytes(pickle.dumps(md))
    m["files"][".metadata"] = {
        "size": (path / ".metadata").stat().st_size,
        "checksum": file_checksum(path / ".metadata"),
    }
    return True


def root_of(m: dict[str, Any]) -> dict[str, Any]:
    """The root manifest ``write_parts`` would write for ``m``, unsealed (for forgeries of its text)."""
    return split(m)[0] if m.get("format_version", 0) >= 5 else dict(m)


def edit(path: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``fn`` to the manifest and write it back resealed."""
    m = read_parts(path)
    fn(m)
    write_parts(path, m)


def reseal(path: Path, *names: str) -> None:
    """Record the current size and CRC-32 of the files ``names`` in the manifest, and reseal it."""
    m = read_parts(path)
    for name in names:
        m["files"][name] = {
            **m["files"].get(name, {}),
            "size": (path / name).stat().st_size,
            "checksum": file_checksum(path / name),
        }
    write_parts(path, m)


def sync_index(m: dict[str, Any], md: Any) -> bool:
    """Make the manifest's storage entries (``index`` and the chunk table's places) say what ``md``'s records say;
    ``False`` when ``md`` holds nothing they can say (its records are not DCP's types) or the manifest has no
    index. The dtypes, shapes and chunk rows stay the manifest's: they are the inventory's, not the index's."""
    if m.get("index") is None:
        return False
    try:
        records = [(i.fqn, tuple(i.offset), s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()]
    except (AttributeError, TypeError):
        return False
    chunks = m["chunks"]
    entries = []
    for key, offsets, file, offset, length in records:
        if not all(isinstance(v, int) for v in (offset, length)) or not isinstance(file, str):
            return False
        if key in chunks:
            for c in chunks[key]:
                if offsets and c["start"] == offsets[0]:
                    c.update(file=file, offset=offset, length=length)
        elif not any(offsets):  # a record at another offset than the origin: the entries cannot say it
            entries.append([key, file, offset, length])
    recorded = {r[0] for r in records}
    for key in [k for k in chunks if k not in recorded]:  # a tensor whose records are gone: so is its table
        del chunks[key]
    m["index"] = {"entries": entries}
    return True


def forge_metadata(path: Path, fn: Callable[[Any], Any]) -> bool:
    """Rewrite ``.metadata`` with ``fn(md)``, mirror its records into the manifest's storage entries, reseal both;
    ``True`` when the manifest's entries changed with it (else only ``.metadata``, which loads do not read)."""
    md = safe_load_metadata(path / ".metadata")
    fn(md)
    return write_metadata(path, md)


def write_metadata(path: Path, md: Any) -> bool:
    """Write ``md`` as ``.metadata``, mirror and reseal as :func:`forge_metadata`."""
    (path / ".metadata").write_bytes(pickle.dumps(md))
    m = read_parts(path)
    before = places(m)
    sync_index(m, md)
    m["files"][".metadata"] = {
        "size": (path / ".metadata").stat().st_size,
        "checksum": file_checksum(path / ".metadata"),
    }
    write_parts(path, m)
    return places(m) != before


def places(m: dict[str, Any]) -> Any:
    entries = sorted(map(tuple, (m.get("index") or {}).get("entries", [])))
    return entries, json.dumps(m.get("chunks"), sort_keys=True)


def tensor_node(node: Any, key: str) -> dict[str, Any]:
    """The tensor node of a state skeleton whose key is ``key`` (depth-first), to forge it in place."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") == "tensor" and n.get("key") == key:
                return n
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    raise KeyError(key)
