"""The ``torchrl-dcp`` command: inspect, verify, convert, list and compare checkpoints.

Every command takes a directory or an archive, prints a human summary, or JSON
with ``--json`` (before or after the command), and exits 1 with the failing file
named when a checkpoint is damaged or refused; ``diff`` exits 0 (identical), 1
(different) or 2 (an error), as ``diff(1)`` does. Output into a closed pipe
(``| head``) ends quietly. ``inspect``, ``ls`` and ``convert`` never import torch
(they start in milliseconds and stream in bounded memory); ``verify`` and ``diff``
do. Also ``python -m torchrl_dcp``. ``verify``, ``convert`` and ``diff`` draw a progress bar (tqdm) on stderr
when it is a terminal, unless ``--json`` or ``-q``/``--quiet``: the library reports bytes through a callback.

Example:
    $ torchrl-dcp inspect ckpts/step-000000000100
    $ torchrl-dcp verify run.zip && echo intact
    $ torchrl-dcp convert ckpts/step-000000000100 run.zip
    $ torchrl-dcp ls ckpts --json
    $ torchrl-dcp diff ckpts/step-000000000100 run.zip
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torchrl_dcp.checkpoint_diff import diff_checkpoints, print_diff, tolerance
from torchrl_dcp.errors import CheckpointError, CheckpointVersionError
from torchrl_dcp.format.manifest_depth import MAPPING_NODES
from torchrl_dcp.placement import is_absent_skeleton
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.storage.files import absent_because
from torchrl_dcp.storage.urls import is_file_url, resolve_path
from torchrl_dcp.torchrl_format.detect import is_torchrl_checkpoint


def _followed(path: str) -> str:
    """``path``, or the path a local link there names: what the library reads through it (``latest -> step-9``,
    ``ckpts -> /scratch/ckpts``), so the tools describe, list and convert that, not the link itself."""
    if is_file_url(path):  # a local path spelled as a URL: the same link
        path = str(resolve_path(path))
    elif "://" in path:
        return path
    bare = path.rstrip("/") or path  # (``latest/``: islink answers for the directory it names, not the link)
    if os.path.islink(bare):
        return os.path.realpath(bare)
    return path


def _inspect(path: str) -> dict[str, Any]:
    if is_torchrl_checkpoint(path):  # torchrl.checkpoint's own format (read-only; imports torch)
        from torchrl_dcp.torchrl_format.importer import inspect_torchrl

        return inspect_torchrl(path)
    where = location_for(_followed(path))
    box = where.container()
    m = box.manifest()
    comps = {}
    for name, rec in m["components"].items():
        inventory = rec["inventory"]
        ranks = absent = None
        if rec["placement"] == "per_rank":  # (the ranks holding it; those that registered none saved it absent)
            saved = sorted((int(r), is_absent_skeleton(s.get("state"))) for r, s in rec["ranks"].items())
            ranks, absent = [r for r, a in saved if not a], [r for r, a in saved if a]
        comps[name] = {
            "adapter": rec["adapter"],
            "adapter_version": rec["adapter_version"],
            "placement": rec["placement"],
            "ranks": ranks,
            "tensors": len(inventory),
            "bytes": rec["nbytes"],
            "shared": _shared_tensors(rec),
        }
        if absent is not None:  # (per-rank: the ranks that registered none when it was saved)
            comps[name]["absent_ranks"] = absent
    return {
        "path": str(where.path),
        "container": where.kind,
        "format_version": box.stored_version(),  # as written (the manifest read is migrated to the current one)
        "created_at": m.get("created_at"),
        "step": m.get("step"),
        "world_size": m["world_size"],
        "versions": m["versions"],
        "components": comps,
        "files": len(m["files"]),
        "bytes": where.size() or 0,  # the whole checkpoint, manifest included: what `ls` and a disk count
        "data_bytes": sum(f["size"] for f in m["files"].values()),
        "metadata": m["metadata"],
    }


def _bytes(out: Any) -> int:
    return location_for(out).size() or 0


def _shared_tensors(rec: dict[str, Any]) -> dict[str, str]:
    """``{path in this component: DCP key it is stored under}`` for tensors stored by another component (xref).

    Walks the JSON skeleton without torch: a plain DCP reader finds such a tensor under
    ``replicated/<component>/<key>`` of the component that stored it.
    """
    states = [s["state"] for s in rec["ranks"].values()] if rec["placement"] == "per_rank" else [rec["state"]]
    found: dict[str, str] = {}
    stack: list[tuple[Any, str]] = [(s, "") for s in states]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((v, where) for v in node)
        elif isinstance(node, dict):
            if node.get("t") == "xref":  # (``inspect`` shows what the manifest says, unvalidated: never crash on it)
                found[where or str(node.get("key", ""))] = f"replicated/{node.get('component')}/{node.get('key')}"
            elif isinstance(node.get("t"), str) and node["t"] in MAPPING_NODES and isinstance(node.get("items"), list):
                pairs = (i for i in node["items"] if isinstance(i, list) and len(i) == 2)
                stack.extend((v, f"{where}/{k}" if where else str(k)) for k, v in pairs)
            else:
                stack.extend((v, where) for k, v in node.items() if k != "t")
    return dict(sorted(found.items()))


def _ranks_text(ranks: list[int]) -> str:
    """``0..7`` for a run of ranks, else the list (a per-rank component some ranks held: ``[1]``)."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}..{ranks[-1]}"
    return ",".join(map(str, ranks)) or "none"


def _print_inspect(info: dict[str, Any]) -> None:
    print(
        f"{info['path']} ({info['container']}): step {info['step']}, saved by {info['world_size']} rank(s) at {info['created_at']}"
    )
    print(
        f"  format v{info['format_version']}, {info['files']} files, {info['bytes']:,} bytes "
        f"({info['data_bytes']:,} of data); " + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    )
    for name, c in info["components"].items():
        ranks = f" ranks {_ranks_text(c['ranks'])}" if c["ranks"] is not None else ""
        print(
            f"  {name:<20} {c['placement']:<10}{ranks:<12} {c['tensors']:>5} tensors {c['bytes']:>14,} bytes  "
            f"[{c['adapter']} v{c['adapter_version']}]"
        )
        for where, key in c["shared"].items():  # stored once, by another component: read it under that key
            print(f"  {'':<20} {where} -> {key} (shared)")
    if info["metadata"]:
        print(f"  metadata: {json.dumps(info['metadata'])}")


@contextlib.contextmanager
def _progress(label: str, args: argparse.Namespace) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a tqdm bar of bytes on stderr, or ``None`` (then nothing is
    drawn and the library runs as without a callback): only when stderr is a terminal, without ``--json`` or
    ``--quiet``, and tqdm imports. The bar is removed when the work ends; stdout never changes."""
    if args.json or args.quiet or not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # (a dependency: only a broken install lacks it)
        yield None
        return
    lock = threading.Lock()
    with tqdm(desc=label, total=0, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False) as bar:

        def show(done: int, total: int) -> None:
            with lock:  # (pieces finish on several threads)
                if bar.total != total:
                    bar.total = total
                bar.update(done - bar.n)

        yield show


def _ours_only(path: str, tool: str) -> None:
    """Refuse, saying so, a ``torchrl.checkpoint`` checkpoint where a tool reads torchrl_dcp's format only (it was
    read as a damaged archive of ours: "member is in a sub-directory")."""
    if is_torchrl_checkpoint(path):
        raise CheckpointError(
            f"is a torchrl.checkpoint checkpoint: `{tool}` reads torchrl_dcp checkpoints; `inspect` and `verify` read "
            "this one, and DistributedCheckpoint.load restores it (then save it with torchrl_dcp to convert or diff it)",
            path=os.path.abspath(path),  # (as every other error names it)
        )


def _convert(src: str, dst: str, overwrite: bool, args: argparse.Namespace) -> dict[str, Any]:
    from torchrl_dcp.convert import to_archive, to_directory

    _ours_only(src, "convert")
    start = time.monotonic()
    source = location_for(_followed(src))
    if source.entry_kind() in ("archive", "other"):  # one file (or object): an archive to unpack
        with _progress("unpacking", args) as show:
            out = to_directory(src, dst, overwrite=overwrite, progress=show)
        kind = "directory"
    else:
        with _progress("packing", args) as show:
            out = to_archive(src, dst, overwrite=overwrite, progress=show)
        kind = "archive"
    size = _bytes(out)
    return {
        "ok": True,
        "source": str(source.path),
        "destination": str(out),
        "container": kind,
        "bytes": size,
        "seconds": round(time.monotonic() - start, 3),
    }


def _ls(directory: str, metric: str | None, mode: str) -> dict[str, Any]:
    from torchrl_dcp.rotation import CheckpointRotation
    from torchrl_dcp.rotation_entries import latest_entry
    from torchrl_dcp.rotation_resume import torchrl_entries

    where = location_for(_followed(directory))
    d = where.path
    kind = where.entry_kind()
    if kind is None:
        raise CheckpointError(f"no rotation directory here: {absent_because(d)}" if where.is_local else
                              "no rotation directory here: nothing is under this prefix", path=d)  # fmt: skip
    if _is_checkpoint(where) or (where.is_local and is_torchrl_checkpoint(d)):
        what = "an archive of a checkpoint" if kind == "archive" else "a checkpoint"
        raise CheckpointError(
            f"is {what}, not a rotation directory of checkpoints: use `torchrl-dcp inspect {d}`", path=d
        )
    if kind != "checkpoint":
        raise CheckpointError("is a file, not a directory: ls lists a rotation directory of checkpoints", path=d)
    rotation = CheckpointRotation(d, keep_best=(metric, mode) if metric is not None else None)  # type: ignore[arg-type]
    theirs = torchrl_entries(rotation)
    entries = [  # each manifest read once; latest and best from this list (torchrl's: named apart, never entries)
        e for e in rotation.entries(include_uncommitted=True) if e.committed or e.path.name not in theirs
    ]
    if metric is not None and entries and all(e.metric is None for e in entries if e.committed):
        raise CheckpointError(
            f"no checkpoint in {d} has metadata {metric!r}: pass a key its saves put in metadata=", path=d
        )
    leftovers = _leftovers(where)
    left = {x["name"] for x in leftovers}  # (a store's killed save is its own prefix: shown as a leftover there too)
    entries = [e for e in entries if e.committed or e.path.name not in left]
    rows = []
    for e in entries:
        row = {"step": e.step, "name": e.path.name, "container": "archive" if e.archive else "directory",
               "bytes": e.size, "committed": e.committed, "created_at": e.created_at}  # fmt: skip
        if metric:
            row[metric] = e.metric
        if e.error:
            row["error"] = e.error
        rows.append(row)
    latest, best = latest_entry(entries), rotation.best_entry(entries)
    return {"directory": str(d), "entries": rows, "latest": latest.path.name if latest else None,
            "best": best.path.name if best else None, "leftovers": leftovers,
            "torchrl_entries": theirs}  # fmt: skip


def _is_checkpoint(where: Any) -> bool:
    try:
        where.manifest()
    except CheckpointVersionError:
        return True  # (a newer library's checkpoint: a checkpoint all the same)
    except CheckpointError:
        return False
    return True


def _leftovers(where: Any) -> list[dict[str, Any]]:
    """What killed saves and conversions left in the rotation directory (staging areas, trash, temporary files),
    with their sizes where known; the next save into the directory sweeps them."""
    out = []
    for left in where.leftovers():
        out.append({"name": left.name, "owner": left.owner, "bytes": where.child(left.name).size()})
    return out


def _print_ls(info: dict[str, Any], metric: str | None) -> None:
    print(
        f"{info['directory']}: {len(info['entries'])} entries, latest {info['latest'] or '(none committed)'}"
        + (f", best {info['best'] or '(none)'} by {metric}" if metric else "")
    )
    for row in info["entries"]:
        flags = []
        if row["name"] == info["latest"]:
            flags.append("latest")
        if metric and row["name"] == info["best"]:
            flags.append("best")
        state = "committed" if row["committed"] else "NOT COMMITTED"
        score = f" {metric}={row[metric] if row.get(metric) is not None else '-'}" if metric else ""
        print(f"  {row['name']:<24} {row['step']:>10} {row['bytes']:>14,} bytes  {state:<13}{score} {' '.join(flags)}")
        if row.get("error"):
            print(f"    ({row['error']})")
    theirs = info.get("torchrl_entries") or ()
    if theirs:
        print(
            f"  and {len(theirs)} torchrl.checkpoint checkpoint{'s' if len(theirs) > 1 else ''} ("
            + ", ".join(theirs[-3:])
            + (", ..." if len(theirs) > 3 else "")
            + "): not entries of this rotation; `torchrl-dcp inspect` reads each, `ckpt.load(path)` loads one"
        )
    for left in info.get("leftovers", ()):
        print(
            f"  {left['name']:<24} {'':>10} {left['bytes']:>14,} bytes  left by a killed save or conversion to "
            f"{left['owner']} (the next save or conversion to it removes it; a rotation's prune, once a newer step "
            "is committed)"
        )


class _UsageError(Exception):
    """An argument argparse refuses, with ``--json``: said as JSON on stdout, as every other error is."""


class _Parser(argparse.ArgumentParser):
    json_errors = False  # (set by main when ``--json`` is among the arguments)

    def error(self, message: str) -> Any:
        if _Parser.json_errors:
            raise _UsageError(f"{self.prog}: {message}")
        return super().error(message)


def _parser() -> argparse.ArgumentParser:
    from torchrl_dcp._version import __version__

    common = _Parser(add_help=False)  # options accepted before and after the command
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output on stdout"
    )
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
        help="no progress bar on stderr (verify, convert and diff draw one when stderr is a terminal)",
    )  # fmt: skip
    parser = _Parser(
        prog="torchrl-dcp",
        description="Inspect, verify, convert and compare torchrl_dcp checkpoints.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"torchrl-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_sub_parser(common))
    p = sub.add_parser("inspect", help="components, placements, ranks, tensors and bytes, versions, metadata")
    p.add_argument("path")
    p = sub.add_parser("verify", help="check every file's size and checksum; exit 1 naming the damaged file")
    p.add_argument("path")
    p = sub.add_parser("convert", help="directory -> archive (.zip) or archive -> directory, checksums verified")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at DST")
    p = sub.add_parser("ls", help="a rotation directory: steps, sizes, committed or not, latest, best")
    p.add_argument("directory")
    p.add_argument("--metric", help="metadata key to rank entries by (shows the best one)")
    p.add_argument("--mode", choices=("max", "min"), default="max")
    p = sub.add_parser("diff", help="which components and tensors differ, with the max abs difference")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=tolerance, default=0.0, help="ignore tensor differences up to this (default 0)")
    return parser


def _sub_parser(common: argparse.ArgumentParser) -> type:
    class SubParser(_Parser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, parents=[common], **kwargs)

    return SubParser


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 on success, 1 on a refused or damaged checkpoint (``diff``: 0 identical, 1 different, 2
    an error); quiet, exit 141, when stdout is a closed pipe."""
    for stream in (sys.stdout, sys.stderr):  # a path the terminal's encoding cannot show is escaped, not an error
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    _Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except _UsageError as err:  # (exit 2, as argparse's own)
        print(json.dumps({"ok": False, "error": str(err), "file": None}))
        return 2
    args.json = getattr(args, "json", False)
    args.quiet = getattr(args, "quiet", False)
    try:
        return _run(args)
    except BrokenPipeError:  # `torchrl-dcp ls ckpts | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's final flush must not fail again)
        return 141


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _run(args: argparse.Namespace) -> int:
    """The command, its output held until it ends and then written: a failed write of the output (a full disk,
    ``> /dev/full``) is said as such, never as a failure to read the checkpoint."""
    held = io.StringIO()
    with contextlib.redirect_stdout(held):
        code = _command(args)
    try:
        sys.stdout.write(held.getvalue())
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as err:
        print(f"error: writing the output to stdout failed ({err.strerror or err}): {_verb(args)} itself "
              "succeeded; write it elsewhere", file=sys.stderr)  # fmt: skip
        return 1
    return code


def _verb(args: argparse.Namespace) -> str:
    return {"ls": "the listing", "diff": "the comparison", "convert": "the conversion"}.get(args.command, args.command)


def _command(args: argparse.Namespace) -> int:
    emit = (
        (lambda info: print(json.dumps(_json_safe(info), indent=1, default=str, allow_nan=False)))
        if args.json
        else None
    )
    try:
        from torchrl_dcp.settings import check_environment

        check_environment()  # (a bad TDCP_* value: one error line naming it, before the command starts)
        if args.command == "inspect":
            info = _inspect(args.path)
            emit(info) if emit else _print_inspect(info)
        elif args.command == "verify":
            from torchrl_dcp.verification import verify

            with _progress("verifying", args) as show:
                summary = verify(args.path, progress=show)
            if emit:
                emit({"ok": True, **summary})
            else:
                print(
                    f"OK {summary['path']}: {summary['files']} files, {summary['bytes']:,} bytes, {summary['tensors']} tensors verified"
                )
                for what in summary.get("unchecked", []):  # what this checkpoint's format cannot prove
                    print(f"  not checked: {what}")
        elif args.command == "convert":
            info = _convert(args.src, args.dst, args.overwrite, args)
            if emit:
                emit(info)
            else:
                print(f"wrote {info['container']} {info['destination']} ({info['bytes']:,} bytes, {info['seconds']} s)")
        elif args.command == "ls":
            info = _ls(args.directory, args.metric, args.mode)
            emit(info) if emit else _print_ls(info, args.metric)
        else:
            with _progress("comparing", args) as show:
                for path in (args.a, args.b):
                    _ours_only(path, "diff")
                info = diff_checkpoints(args.a, args.b, args.atol, show)
            emit(info) if emit else print_diff(info)
            return 0 if info["identical"] else 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise
    except Exception as err:  # noqa: BLE001 - a command-line tool reports every failure as one line, never a traceback
        code = _report(_with_rotation_hint(err), args.json)
        return 2 if args.command == "diff" else code
    return 0


def _with_rotation_hint(err: Exception) -> Exception:
    """A path with no manifest that is a rotation directory (``step-N`` entries): say to list it with ``ls``, as
    ``ls`` on a checkpoint says to use ``inspect``."""
    from torchrl_dcp.rotation_entries import list_entries

    if not isinstance(err, CheckpointError) or err.path is None or "no manifest.json" not in err.message:
        return err
    try:
        entries = list_entries(str(err.path))
    except Exception:  # noqa: BLE001 - only a hint: the original error stands
        return err
    if not entries:
        return err
    hint = f"it is a rotation directory of checkpoints: `torchrl-dcp ls {err.path}` lists them"
    return type(err)(f"{err.message}; {hint} (highest step: {entries[-1].path.name})", path=err.path)


def _report(err: Exception, as_json: bool) -> int:
    """Print ``error: <message>`` (stderr) or ``{"ok": false, ...}`` (stdout, ``--json``); return the exit code 1."""
    from torchrl_dcp.errors import from_os_error

    if isinstance(err, OSError) and not isinstance(err, CheckpointError):
        err = from_os_error(err, "reading")
    if isinstance(err, CheckpointError):
        message = str(err)
    elif isinstance(err, RecursionError):
        message = "a checkpoint file is nested too deeply to read (damaged or forged)"
    elif isinstance(err, (KeyError, ValueError)):
        message = str(err.args[0]) if len(err.args) == 1 else str(err)
    else:
        message = f"unexpected {type(err).__name__}: {err} (please report this as a torchrl_dcp bug)"
    if as_json:
        print(json.dumps({"ok": False, "error": message, "file": getattr(err, "path", None)}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
