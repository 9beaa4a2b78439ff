"""The ``torchrl-dcp`` command: inspect and verify checkpoints.

Example:
    $ torchrl-dcp inspect ckpts/step-100
    $ torchrl-dcp verify ckpts/step-100 && echo intact
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchrl_dcp.errors import CheckpointError


def _inspect(path: str) -> dict[str, Any]:
    from torchrl_dcp.manifest import read_manifest

    m = read_manifest(path)
    comps = {
        name: {
            "adapter": f"{rec['adapter']} v{rec['adapter_version']}",
            "placement": rec["placement"],
            "ranks": m["world_size"] if rec["placement"] == "per_rank" else None,
            "tensors": rec.get("num_tensors"),
            "bytes": rec.get("nbytes"),
        }
        for name, rec in m["components"].items()
    }
    return {
        "path": str(path),
        "format_version": m["format_version"],
        "created_at": m.get("created_at"),
        "step": m.get("step"),
        "world_size": m["world_size"],
        "versions": m["versions"],
        "components": comps,
        "files": len(m["files"]),
        "bytes": sum(f["size"] for f in m["files"].values()),
        "metadata": m["metadata"],
    }


def _print_inspect(info: dict[str, Any]) -> None:
    print(f"{info['path']}: step {info['step']}, saved by {info['world_size']} rank(s) at {info['created_at']}")
    print(f"  {info['files']} files, {info['bytes']:,} bytes; " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    for name, c in info["components"].items():
        ranks = f" x{c['ranks']} ranks" if c["ranks"] else ""
        print(f"  {name:<24} {c['placement']:<10}{ranks:<10} {c['tensors']} tensors, {c['bytes']:,} bytes  [{c['adapter']}]")
    if info["metadata"]:
        print(f"  metadata: {json.dumps(info['metadata'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrl-dcp", description="Inspect and verify torchrl_dcp checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="components, placements, sizes, versions and metadata")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("verify", help="check every file's size and checksum; exit 1 on damage")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            info = _inspect(args.path)
            print(json.dumps(info, indent=1)) if args.json else _print_inspect(info)
        else:
            from torchrl_dcp.verify import verify

            summary = verify(args.path)
            print(json.dumps({"ok": True, **summary}) if args.json else f"OK {summary['path']}: {summary['files']} files, {summary['bytes']:,} bytes, {summary['tensors']} tensors verified")
    except CheckpointError as err:
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": str(err), "file": err.path}))
        else:
            print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
