"""The manifest: ``manifest.json``, written last, is what makes a checkpoint exist.

It records the format version, the world size, library versions, every component
(adapter id and version, placement, JSON state skeleton, per rank where needed,
and its tensor inventory), every data file with its size and checksum, user
metadata, the save's identity (``save_id``, also written into DCP's metadata and at
the end of every data file) and, since format 3, a checksum of its own canonical
body (``manifest_checksum``), so a damaged manifest is refused rather than loaded. Since
format 4 it also records how large tensors were cut into chunk files (``chunks``: rows,
file and content fingerprint of each chunk) and, for a data file kept from an earlier save
by an incremental save, that save's identity (``files[name].origin``). Since format 5 each rank's per-rank
states, inventories, chunk table and storage entries are in a shard of their own
(``manifest-<rank>.json``, :mod:`torchrl_dcp.format.shards`), and the manifest records where
tensors are (``index``), so a load reads the root and its own shard and never DCP's whole
``.metadata``. Since format 6 the replicated tensors a rank writes are in a data file of their
own (``__<rank>_shared.distcp``), so no rank reads (or checksums) another rank's per-rank bytes.
Since format 7 the files only one rank reads (its per-rank data and chunk files) are listed in
that rank's shard; the root lists the others and, per rank, how many files its shard lists and
their bytes (``rank_files``), so the root no longer grows with the files every rank writes. Since format 8
those per-rank facts (each shard's size and checksum, each rank's count and bytes of own files) are one packed
table (``rank_table``, :mod:`torchrl_dcp.format.rank_table`), kept packed once parsed.
Readers validate it strictly, refuse newer format versions and upgrade older ones step by step
through the migrations registered in :mod:`torchrl_dcp.format.migrations` (older adapter payloads
are upgraded the same way). See docs/migrations.md.

Example:
    >>> from torchrl_dcp.format.manifest import FORMAT, FORMAT_VERSION
    >>> FORMAT, FORMAT_VERSION
    ('torchrl_dcp', 8)
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, CheckpointVersionError
from torchrl_dcp.format import migrations
from torchrl_dcp.format.layout import (
    COMPONENT_NAME,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_WORLD_SIZE,
    data_file_rank,
    is_chunk_file,
    is_component_name,
    is_library_file,
    is_plain_name,
)
from torchrl_dcp.format.manifest_depth import check_depth, structure
from torchrl_dcp.format.rank_table import validate_rank_table
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.placement import PLACEMENTS

FORMAT = "torchrl_dcp"
FORMAT_VERSION = 8
CHECKSUM_FIELD = "manifest_checksum"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def unchecked(manifest: dict[str, Any]) -> list[str]:
    """What this checkpoint's format cannot prove (older formats): shown by ``verify``."""
    missing = []
    if manifest.get(CHECKSUM_FIELD) is None:
        missing.append("manifest checksum (format < 3: a damaged manifest may load)")
    if manifest.get("save_id") is None:
        missing.append("save identity (format < 3: a data file from another save is not detected)")
    return missing


def library_versions() -> dict[str, str]:
    import tensordict
    import torch
    import torchrl

    from torchrl_dcp._version import __version__

    return {
        "torch": str(torch.__version__),
        "tensordict": str(tensordict.__version__),
        "torchrl": str(torchrl.__version__),
        "torchrl_dcp": __version__,
    }


def new_manifest(
    *,
    world_size: int,
    components: dict[str, Any],
    files: dict[str, Any],
    metadata: dict[str, Any],
    step: int | None,
    save_id: str,
    chunks: dict[str, list[dict[str, Any]]] | None = None,
    sequence: int | None = None,
    sharded: bool = False,
    index: dict[str, Any] | None = None,
    rank_table: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A sealed manifest of the current format: the root when ``sharded`` (per-rank components carry no ``ranks``
    nor ``inventory``: they are in the shards, which ``rank_table`` records); ``index``: the storage entries of the
    tensors the root inventories (``None``: DCP's ``.metadata`` is the only index); ``rank_table``: each saved
    rank's shard record and own files (:func:`~torchrl_dcp.format.rank_table.rank_table`; ``None`` unsharded)."""
    return seal(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "step": step,
            "world_size": world_size,
            "versions": library_versions(),
            "components": components,
            "files": files,
            "metadata": metadata,
            "save_id": save_id,
            "chunks": chunks or {},
            "sequence": sequence,
            "sharded": sharded,
            "index": index,
            "rank_table": rank_table,
        }
    )


def dumps(manifest: dict[str, Any]) -> bytes:
    """The manifest as compact, key-sorted JSON (one line + newline).

    Compact separators and no ``indent`` keep ``json`` on its C encoder (``indent``
    forces the pure-Python one: about 8x slower, 0.48 s vs 0.06 s for 5,000 tensors here); readers do not care.
    ``python -m json.tool manifest.json`` pretty-prints it.

    Example:
        >>> dumps({"b": 1, "a": [1, 2]})
        b'{"a":[1,2],"b":1}\\n'
    """
    return (json.dumps(manifest, sort_keys=True, allow_nan=False, separators=(",", ":")) + "\n").encode()


def loads_manifest(data: bytes, source: Any) -> dict[str, Any]:
    """Decode, check, validate and migrate manifest bytes (from a directory or an archive member)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(f"manifest is implausibly large ({len(data)} bytes)", path=source)
    return parse_manifest(decode_json(data, source, "manifest"), source, text=data)


def looks_like_ours(data: bytes) -> bool:
    """Whether manifest bytes that did not load are a damaged manifest of ours rather than another tool's: JSON
    naming torchrl_dcp's format (altered), or no JSON at all (truncated, emptied, bytes flipped). Another tool's
    valid JSON is not, nor bytes too dense in values to parse within the bounds (:func:`check_parse_cost`).

    Example:
        >>> looks_like_ours(b'{"chunks":{},"comp'), looks_like_ours(b'{"tool": "mine"}'), looks_like_ours(b"")
        (True, False, True)
    """
    if _OUR_FORMAT.search(data[:MAX_MANIFEST_BYTES]):
        return True
    try:
        check_parse_cost(data, "manifest")
        loads_json(data)
    except CheckpointFormatError:
        return False
    except ValueError:
        return True
    return False


_OUR_FORMAT = re.compile(rb'"format"\s*:\s*"torchrl_dcp"')


def decode_json(data: bytes, source: Any, what: str) -> Any:
    """JSON bytes of a manifest (or a shard: ``what``) decoded under the parse-cost and nesting bounds, strictly
    (no NaN or Infinity)."""
    check_parse_cost(data, source)
    try:
        raw = loads_json(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ValueError as err:
        raise CheckpointFormatError(f"{what} is not valid JSON ({str(err)[:200]})", path=source) from None
    check_depth(structure(raw), source)
    return raw


#: What the Python objects ``json.loads`` builds cost, bounded from the text (CPython 3.11, measured): a pointer per
#: value, an object per mapping and per list on top, and the scalars' own objects (a number or a short string costs
#: at most ~12x its text, a long one ~1x): ``8 * values + 200 * mappings + 64 * lists + 2 * bytes``. It follows the
#: real cost within a factor of ~3 either way: ``[{},...]`` 18x real (56x estimated), ``[[1],...]`` 19x (22x),
#: ``[0,...]`` 4x (6x), ``["ab",...]`` 12x (4x), our writer's manifests ~7x (6x). One shape escapes it: a mapping of
#: many distinct one-character non-Latin-1 keys (``{"😀":0,...}``: each key a string object of ~80 bytes, and the
#: parser's key cache beside the mapping) decodes to ~25x for ~3x estimated, so a forged manifest above the 64 MiB
#: floor can take ~1.5x the bound; charging every key for it would put honest manifests near the bound.
PARSE_BYTES_PER_VALUE = 8
PARSE_BYTES_PER_MAPPING = 200
PARSE_BYTES_PER_LIST = 64
PARSE_BYTES_PER_BYTE = 2
#: a manifest is parsed only if that bound stays within this multiple of its size (or :data:`PARSE_FLOOR`)
PARSE_RATIO = 16
PARSE_FLOOR = 64 << 20


def check_parse_cost(data: bytes, source: Any) -> None:
    """Refuse, before parsing, a manifest dense enough in JSON values that decoding it could take more than
    :data:`PARSE_RATIO` times its size in memory (a forgery of ``[{},{},...]`` costs 18x; our writer's ~7x; a
    list of 800,000 zeros, which a save writes, 4x). A save runs it on what it writes too: no save writes what a
    load refuses.

    Every value after the first in a container follows a comma, so commas plus opening brackets bound the values
    (the cost: :data:`PARSE_BYTES_PER_VALUE` and the others); counting them runs at memory speed.

    Example:
        >>> check_parse_cost(b'{"a": [1, 2]}', "m")  # fine
        >>> try:
        ...     check_parse_cost(b"[" + b"{}," * (1 << 20) + b"{}]", "m")  # 3 MiB of empty objects
        ... except CheckpointFormatError as err:
        ...     print(err.message[:48])
        manifest holds up to 2097155 JSON values in 3145
    """
    mappings, lists = data.count(b"{"), data.count(b"[")
    values = data.count(b",") + mappings + lists + 1
    cost = (
        values * PARSE_BYTES_PER_VALUE
        + mappings * PARSE_BYTES_PER_MAPPING
        + lists * PARSE_BYTES_PER_LIST
        + len(data) * PARSE_BYTES_PER_BYTE
    )
    if cost > max(PARSE_RATIO * len(data), PARSE_FLOOR):
        raise CheckpointFormatError(
            f"manifest holds up to {values} JSON values in {len(data)} bytes: decoding it could take ~{cost >> 20} "
            f"MiB, more than {PARSE_RATIO}x its size; no save writes a manifest that dense (refused before parsing)",
            path=source,
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one beyond the float range (``1e400``, which Python reads as
    infinity) is refused: our writer stores infinities as tagged values, never as numbers."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of the float range")
    return value


def body_checksum(manifest: dict[str, Any]) -> str:
    """``"crc32:<hex>"`` of the manifest's canonical JSON without its own checksum field."""
    from torchrl_dcp.format.checksums import crc32, format_crc

    return format_crc(crc32(dumps({k: v for k, v in manifest.items() if k != CHECKSUM_FIELD})))


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its :func:`body_checksum` (what is written; readers check it)."""
    return {**manifest, CHECKSUM_FIELD: body_checksum(manifest)}


def _check_seal(raw: dict[str, Any], source: Any, text: bytes | None = None) -> None:
    recorded = raw.get(CHECKSUM_FIELD)
    if not isinstance(recorded, str):
        raise CheckpointIntegrityError(f"manifest has no {CHECKSUM_FIELD}: damaged or altered", path=source)
    if text is not None and _sealed_text(text, recorded):
        return
    try:
        actual = body_checksum(raw)
    except RecursionError:
        raise CheckpointFormatError("manifest is nested too deeply to be checked: refused", path=source) from None
    if actual != recorded:
        raise CheckpointIntegrityError(
            f"manifest checksum is {actual}, the manifest says {recorded}: the manifest is damaged or altered "
            "(nothing was loaded)",
            path=source,
        )


def _sealed_text(text: bytes, recorded: str) -> bool:
    """Whether ``text`` is the canonical manifest (as :func:`dumps` writes it) whose body has ``recorded``.

    The writer's bytes are the canonical body with the checksum field inserted, so the
    CRC of the text without that field equals the seal: no re-serialization. Any other
    spelling of the same JSON (re-indented, hand-edited and resealed) is checked the slow
    way, by :func:`body_checksum` of the decoded value.
    """
    from torchrl_dcp.format.checksums import crc32, format_crc

    field = b'"' + CHECKSUM_FIELD.encode() + b'":' + json.dumps(recorded).encode() + b","
    at = text.find(field)
    if at < 0:
        return False
    return format_crc(crc32(text[at + len(field) :], crc32(text[:at]))) == recorded


def parse_manifest(raw: Any, source: Any, *, text: bytes | None = None) -> dict[str, Any]:
    """Validate a decoded manifest (and migrate it to the current version); ``text``: the bytes it was decoded from."""
    if not isinstance(raw, dict):
        raise CheckpointFormatError("manifest is not a JSON object", path=source)
    if raw.get("format") == "torchrl.checkpoint":  # (read through the importer from local paths: not here)
        raise CheckpointFormatError(
            "is a torchrl.checkpoint checkpoint's manifest, not a torchrl_dcp one: DistributedCheckpoint.load imports "
            "such a checkpoint from a local path (a directory or archive); to verify or convert it, or save "
            "incrementally from it, load it and save it with torchrl_dcp first",
            path=source,
        )
    if raw.get("format") != FORMAT:
        raise CheckpointFormatError(f"manifest format is {raw.get('format')!r}, expected {FORMAT!r}", path=source)
    version = raw.get("format_version")
    if not _is_int(version) or version < 1:
        raise CheckpointFormatError(f"format_version {version!r} is not a positive integer", path=source)
    if (version >= 3 or CHECKSUM_FIELD in raw) and version <= FORMAT_VERSION:
        _check_seal(raw, source, text)  # a sealed manifest is checked whatever version it claims (3 -> 2 too)
    if 3 <= version <= FORMAT_VERSION and raw.get("save_id") is None:  # (a v2's migration sets null: nothing else)
        raise CheckpointFormatError(
            f"malformed manifest: save_id is null, which format version {version} never writes (every save since "
            "format 3 records its identity, and its data files end with it): damaged, or altered to waive the "
            "save-identity checks; refused",
            path=source,
        )
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"written with format version {version}, this torchrl_dcp reads up to {FORMAT_VERSION}: "
            "upgrade torchrl_dcp to load it",
            path=source,
        )
    if version < FORMAT_VERSION:
        check_depth(raw, source)  # migrations walk states recursively
        raw = copy.deepcopy(raw)
    while raw["format_version"] < FORMAT_VERSION:
        current = raw["format_version"]
        migration = migrations.MIGRATIONS.get(current)
        if migration is None:
            raise CheckpointVersionError(
                f"format version {current} is older than {FORMAT_VERSION} and no migration from it is registered",
                path=source,
            )
        try:
            raw = migration(raw)
        except CheckpointFormatError as err:
            raise CheckpointFormatError(f"migrating format version {current}: {err.message}", path=source) from None
        if not isinstance(raw, dict) or raw.get("format_version") != current + 1:
            raise CheckpointVersionError(f"migration from format version {current} did not upgrade it", path=source)
    _validate(raw, source)
    return raw


def _validate(m: dict[str, Any], source: Any) -> None:
    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"malformed manifest: {what}", path=source)

    if not _is_int(m.get("world_size")) or not 1 <= m["world_size"] <= MAX_WORLD_SIZE:
        raise bad(f"world_size must be a positive integer of at most {MAX_WORLD_SIZE} (file names spell 9 digits)")
    if m.get("step") is not None and not _is_int(m["step"]):
        raise bad("step must be an integer or null")
    for field in ("versions", "metadata", "components", "files"):
        if not isinstance(m.get(field), dict):
            raise bad(f"{field} must be an object")
    if m.get("save_id") is not None and not (isinstance(m["save_id"], str) and len(m["save_id"]) == 32):
        raise bad("save_id must be 32 hex digits or null")
    for name, rec in m["files"].items():
        validate_file_record(name, rec, bad, m.get("save_id"))
        writer = data_file_rank(name)
        if writer is not None and writer >= m["world_size"]:  # (an incremental save keeps files at one world size)
            raise bad(f"files lists {name!r}, a file of rank {writer}, in a checkpoint of {m['world_size']} rank(s)")
    validate_chunk_table(m.get("chunks"), m["files"], bad)
    if m.get("sequence") is not None and not (_is_int(m["sequence"]) and m["sequence"] >= 0):
        raise bad("sequence must be a non-negative integer or null")
    if not isinstance(m.get("sharded"), bool):
        raise bad("sharded must be true or false")
    validate_rank_table(m, bad)  # one shard per saved rank (what bounds the ranks a reader iterates)
    for name, rec in m["components"].items():  # before the index, which reads their inventories
        if not is_component_name(name):  # (a save refuses it: a '/' or '..' would reach paths of exports and tools)
            raise bad(f"component name {name!r} is not one a save writes (it must match {COMPONENT_NAME.pattern})")
        _validate_component(name, rec, None if m["sharded"] else range(m["world_size"]), bad)
    _validate_index(m, bad)


def _validate_index(m: dict[str, Any], bad: Callable[[str], CheckpointFormatError]) -> None:
    index = m.get("index")
    if index is None:
        return
    if not isinstance(index, dict) or set(index) != {"entries"}:
        raise bad("index must be null or {entries}")
    shared = {  # the root's own tensors (a shard places its rank's); the components were validated first
        k for rec in m["components"].values() for k in rec.get("inventory") or {}
    }
    check_entries(index["entries"], m["files"], shared, bad)
    check_placed_once(index["entries"], m["chunks"], bad)
    _validate_placed(m["chunks"], bad)


def check_placed_once(entries: list[list[Any]], chunks: Mapping[str, Any], bad: Callable[[str], Any]) -> None:
    """Each tensor is placed once: by one storage entry (whole) or by the chunk table, never twice (the last of two
    entries won, and bytes of another shape were accepted beside a tensor's chunks: no save writes either)."""
    seen: set[str] = set()
    for e in entries:
        if e[0] in seen:
            raise bad(f"the storage entries place tensor {e[0]!r} twice: no save writes that")
        seen.add(e[0])
    both = seen.intersection(chunks)
    if both:
        raise bad(f"tensor {min(both)!r} is placed both whole (a storage entry) and in chunks: no save writes that")


def _validate_placed(chunks: dict[str, Any], bad: Callable[[str], CheckpointFormatError]) -> None:
    """Where the manifest has an index, every chunk entry says where its record is."""
    for key, entries in chunks.items():
        if not all(_is_int(e.get(f)) and e[f] >= 0 for e in entries for f in ("offset", "length")):
            raise bad(f"chunks[{key!r}] entries need an offset and a length where the manifest has an index")


def check_entries(
    entries: Any, files: Mapping[str, Any], keys: Collection[str], bad: Callable[[str], CheckpointFormatError]
) -> None:
    """Storage entries ``[key, file, offset, length]``: of ``keys`` only, in listed files, non-negative."""
    if not isinstance(entries, list):
        raise bad("entries must be a list")
    for e in entries:  # (types compared exactly: JSON gives plain ints and strs; a bool is no offset)
        if (
            type(e) is not list
            or len(e) != 4
            or type(e[0]) is not str
            or type(e[1]) is not str
            or type(e[2]) is not int
            or type(e[3]) is not int
            or e[2] < 0
            or e[3] < 0
        ):
            raise bad("entries must be [key, file, offset, length]")
        if e[0] not in keys:
            raise bad(f"entry for {e[0]!r}, a tensor this part of the manifest does not hold")
        if e[1] not in files:
            raise bad(f"entry for {e[0]!r} names {e[1]!r}, which is not in 'files'")


def validate_assembled(m: dict[str, Any], source: Any) -> None:
    """The checks of a root that concern per-rank states, on the manifest assembled from it and the shards read."""

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"malformed manifest: {what}", path=source)

    ranks = m["shards_read"]
    for name, rec in m["components"].items():
        if rec.get("placement") == "per_rank":
            _validate_component(name, rec, ranks, bad)
    validate_chunk_table(m["chunks"], m["files"], bad)
    if m.get("index") is not None:
        check_placed_once(m["index"]["entries"], m["chunks"], bad)
        _validate_placed(m["chunks"], bad)


def validate_file_record(
    name: str, rec: Any, bad: Callable[[str], CheckpointFormatError], save_id: str | None = None
) -> None:
    """A ``files`` record: an integer size, a checksum, a plain name (not the manifest's), an optional origin: on a
    chunk file only (what an incremental save keeps), naming another save than ``save_id`` (the record's own)."""
    if not isinstance(rec, dict) or not _is_int(rec.get("size")) or rec["size"] < 0:
        raise bad(f"files[{name!r}] needs an integer size")
    if not isinstance(rec.get("checksum"), str):
        raise bad(f"files[{name!r}] needs a checksum")
    if not is_plain_name(name) or name == MANIFEST:
        raise bad(f"file name {name!r} is not a plain file name")
    if not is_library_file(name):  # (a save writes no other file: a listed README.txt would be carried by conversions)
        raise bad(f"file name {name!r} is not one a save writes (data, chunk, metadata or manifest shard files)")
    if "origin" in rec and not _is_save_id(rec["origin"]):
        raise bad(f"files[{name!r}].origin must be a save id (32 hex digits)")
    if "origin" in rec and (not is_chunk_file(name) or rec["origin"] == save_id):  # (no save writes one)
        raise bad(
            f"files[{name!r}].origin: only a chunk file an incremental save kept from another save has one, "
            "naming that save"
        )


def _is_save_id(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)


_FINGERPRINT = re.compile(r"crc32:[0-9a-f]{8}/adler32:[0-9a-f]{8}")  # checksums.fingerprint_of's spelling


def validate_chunk_table(chunks: Any, files: Mapping[str, Any], bad: Callable[[str], CheckpointFormatError]) -> None:
    """A chunk table: per key, a list of ``{start, rows, file, fingerprint, ...}`` entries, each in a listed file."""
    if not isinstance(chunks, dict):
        raise bad("chunks must be an object")
    for key, entries in chunks.items():
        if not isinstance(entries, list):
            raise bad(f"chunks[{key!r}] must be a list")
        for e in entries:
            ok = (
                isinstance(e, dict)
                and all(_is_int(e.get(f)) and e[f] >= 0 for f in ("start", "rows"))
                and isinstance(e.get("file"), str)
                and e["file"] in files
                and isinstance(e.get("fingerprint"), str)
                and _FINGERPRINT.fullmatch(e["fingerprint"]) is not None
            )
            if not ok:
                name = e.get("file") if isinstance(e, dict) else None
                unlisted = (
                    f": chunk file {name!r} is not in 'files'" if isinstance(name, str) and name not in files else ""
                )
                raise bad(
                    f"chunks[{key!r}] entries need start, rows, a listed file and a fingerprint "
                    f"('crc32:<8 hex>/adler32:<8 hex>'){unlisted}"
                )


def _validate_component(
    name: str, rec: Any, ranks: Collection[int] | None, bad: Callable[[str], CheckpointFormatError]
) -> None:
    """``ranks``: the saved ranks whose states a per-rank component must hold (``None``: a sharded root's, whose
    states are in the shards)."""
    if not isinstance(rec, dict):
        raise bad(f"components[{name!r}] must be an object")
    if not isinstance(rec.get("adapter"), str) or not _is_int(rec.get("adapter_version")):
        raise bad(f"components[{name!r}] needs adapter and adapter_version")
    placement = rec.get("placement")
    if placement not in PLACEMENTS:
        raise bad(f"components[{name!r}].placement {placement!r} is not one of {PLACEMENTS}")
    for total in ("num_tensors", "nbytes"):  # every rank's tensors counted (compared with them by verify; a v1's
        if not (_is_int(rec.get(total)) and rec[total] >= 0):  # migration counts them)
            raise bad(f"components[{name!r}].{total} must be a count (an integer >= 0), not {rec.get(total)!r}")
    if placement == "per_rank" and ranks is None:
        if "ranks" in rec or "inventory" in rec or not all(_is_int(rec.get(f)) for f in ("num_tensors", "nbytes")):
            raise bad(f"components[{name!r}] is per-rank: its states are in the shards, its totals in the root")
        return
    if placement == "per_rank":
        states = rec.get("ranks")
        if (  # (sizes first: a forged world_size of 10**9 is refused without building 10**9 names)
            not isinstance(states, dict) or len(states) != len(ranks) or sorted(states) != sorted(map(str, ranks))
        ):
            raise bad(f"components[{name!r}].ranks must hold one state per saved rank")
        for r, state in states.items():
            if not isinstance(state, dict) or "state" not in state:
                raise bad(f"components[{name!r}].ranks[{r}] needs a state")
    elif "state" not in rec:
        raise bad(f"components[{name!r}] needs a state")
    inventory = rec.get("inventory")
    if not isinstance(inventory, dict) or not all(_is_tensor_entry(k, t) for k, t in inventory.items()):
        raise bad(f"components[{name!r}].inventory must map tensor keys to {{dtype, shape}}")


def _is_tensor_entry(key: Any, t: Any) -> bool:
    if type(key) is not str or type(t) is not dict or len(t) != 2:  # exactly {dtype, shape}: nothing rides along
        return False
    shape = t.get("shape")
    if type(t.get("dtype")) is not str or type(shape) is not list:
        return False
    for d in shape:  # (exact types, as JSON gives them: a bool is no size)
        if type(d) is not int or d < 0:
            return False
    return True
