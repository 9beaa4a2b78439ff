"""Rank 0's (and every rank's) bookkeeping at N simulated ranks, in one process: no gloo, no data files.

``benchmarks/scaling.py`` measures real ranks up to what this machine holds (8). This part feeds the
library's own planning and commit functions with what N ranks would send, built by running the real
``save_engine.encode`` once per simulated rank on the ``dict`` variant's state (16 MiB per_rank
buffer in two chunks, 200 small per_rank tensors, a replicated 4 MiB policy), and times what grows
with N:

- every rank: its own plan (``plan_local``: the shared tensors and its own, after one fixed-size
  ``all_reduce``), ``WritePlan.share``/``chunk_share``; for comparison, what the gathered planning
  (``plan_writes`` over all ranks' tensor lists, which only a failed or differing save runs now)
  and unpickling the N payloads of its all_gather would cost every rank;
- every rank before the commit gather: its manifest shard and its pickled part of ``.metadata``
  (``commit_records.write_rank_part``);
- rank 0 at commit: unpickling the gathered parts, ``.metadata`` spliced from them
  (``commit_records.metadata_bytes``), the root manifest (``root_manifest``: JSON + CRC-32 seal);
- every rank at load: the root and its own shard parsed, checked and assembled, DCP's ``Metadata`` of
  its keys built from them and checked (``metadata_from_index``; bytes parsed and the parse's peak
  memory), ``load_engine.files_for``; for comparison, the allow-list unpickling of the whole
  ``.metadata`` (what ``verify`` and format-4 loads read).

Data file sizes and offsets are computed, not written. Usage::

    python -m benchmarks.scaling_synth --ranks 8,64,256,1000 --out benchmarks/results/scaling-synth.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

SAVE_ID = "0" * 32
RECORD_OVERHEAD = 1700  # bytes a record adds to a data file (measured; docs/format.md)


def _t(fn: Any, reps: int = 3) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def simulate(world: int, reps: int = 3) -> dict[str, Any]:
    """One simulated world size (the cyclic GC paused, as the library pauses it in saves and loads)."""
    from torchrl_dcp._gc import gc_paused

    with gc_paused():
        return _simulate(world, reps)


def _simulate(world: int, reps: int) -> dict[str, Any]:
    from benchmarks.scaling import build_state, checkpoint_for
    from torchrl_dcp import load_engine, save_engine
    from torchrl_dcp.commit_records import metadata_bytes, root_manifest, write_rank_part
    from torchrl_dcp.format.dcp_metadata import parse_metadata
    from torchrl_dcp.format.layout import shard_name
    from torchrl_dcp.format.manifest import loads_manifest, validate_assembled
    from torchrl_dcp.format.metadata_checks import check_coverage, check_inventoried, check_storage_bounds
    from torchrl_dcp.format.shards import assemble, parse_shard
    from torchrl_dcp.planner import is_own_key, plan_local, plan_writes, tensor_infos
    from torchrl_dcp.storage.base import WriteOutcome
    from torchrl_dcp.storage.source import metadata_from_index
    from torchrl_dcp.storage.writer import ChunkEntry

    ckpt = checkpoint_for(build_state("dict", 0, "cpu"))
    names = list(ckpt.components)

    def encode(rank: int) -> Any:
        items = [
            save_engine.EncodeItem(n, ckpt.components[n], ckpt._adapter(n), ckpt.placement(n), ckpt._ctx(n, None))
            for n in names
        ]
        return save_engine.encode(items, rank)

    t = time.perf_counter()
    encoded = [encode(r) for r in range(world)]
    encode_s = (time.perf_counter() - t) / world
    infos = [tensor_infos(e.flat) for e in encoded]
    plan_payload = [pickle.dumps((None, (i, {}))) for i in infos]
    unpickle_s, _ = _t(lambda: [pickle.loads(p) for p in plan_payload], reps)
    gathered_plan_s, _ = _t(lambda: plan_writes(infos), reps)
    plans = [plan_local(i, r, world) for r, i in enumerate(infos)]
    plan_s, last = _t(lambda: plan_local(infos[-1], world - 1, world), reps)
    share_s, _ = _t(lambda: (last.share(world - 1), last.chunk_share(world - 1)), reps)

    parts, stored = [], {}
    for r, (enc, plan) in enumerate(zip(encoded, plans)):
        outcome = WriteOutcome()
        offset = 0
        for key in plan.share(r):
            length = plan.tensors[key].nbytes + RECORD_OVERHEAD
            outcome.entries.append((key, f"__{r}_0.distcp", offset, length))
            offset += length
        if outcome.entries:
            outcome.files[f"__{r}_0.distcp"] = {"size": offset + 64, "checksum": "crc32:0123abcd"}
        for c in plan.chunk_share(r):
            length = c.rows * plan.tensors[c.key].nbytes // plan.tensors[c.key].shape[0] + RECORD_OVERHEAD
            outcome.files[c.file] = {"size": length + 64, "checksum": "crc32:0123abcd"}
            outcome.chunks.append(
                ChunkEntry(c.key, c.start, c.rows, c.file, 0, length, "crc32:0123abcd/adler32:0123abcd")
            )
        target = _MemoryTarget(stored)

        def part(enc: Any = enc, outcome: WriteOutcome = outcome, target: Any = target, r: int = r) -> Any:
            return write_rank_part(
                records=enc.records,
                outcome=outcome,
                target=target,
                rank=r,
                save_id=SAVE_ID,
                indexed=True,
                checkpoint_id="synthetic",
            )

        if r == world - 1:
            part_s, _ = _t(part, reps)
        parts.append(part())
    payloads = [pickle.dumps(p) for p in parts]
    gather_s, parts = _t(lambda: [pickle.loads(p) for p in payloads], reps)
    shared = {
        k: (getattr(torch, t.dtype.split(".")[-1]), t.shape) for k, t in plans[0].tensors.items() if not is_own_key(k)
    }
    meta_s, meta = _t(lambda: metadata_bytes(shared, parts, "synthetic", SAVE_ID), reps)
    files = {name: rec for p in parts for name, rec in p.files.items()}
    files[".metadata"] = {"size": len(meta), "checksum": "crc32:0123abcd"}
    job_records = encoded[0].records

    def root() -> bytes:
        return root_manifest(
            records=job_records,
            parts=parts,
            files=files,
            indexed=True,
            world_size=world,
            metadata={},
            step=1,
            save_id=SAVE_ID,
            sequence=None,
        )

    manifest_s, manifest = _t(root, reps)
    me = world - 1
    shard = stored[shard_name(me)]

    def load_metadata() -> Any:  # what a rank's load parses and builds: the root, its shard, its keys' Metadata
        parsed_root = loads_manifest(manifest, "synthetic")
        m = assemble(parsed_root, {me: parse_shard(shard, parsed_root, me, "shard")}, "synthetic")
        validate_assembled(m, "synthetic")
        md = metadata_from_index(m, "synthetic", "synthetic")
        check_storage_bounds(md, "synthetic", m["files"])
        check_coverage(md, "synthetic")
        check_inventoried(md, "synthetic", m["components"])
        return md

    load_s, metadata = _t(load_metadata, reps)
    tracemalloc.start()
    load_metadata()
    parse_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tracemalloc.start()  # the JSON alone: the root and the shard parsed and validated, kept (what a load holds)
    parsed_root = loads_manifest(manifest, "synthetic")
    held = (parsed_root, parse_shard(shard, parsed_root, me, "shard"))
    json_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del held
    unpickle_meta_s, whole = _t(lambda: parse_metadata(meta, "synthetic"), 1)
    assert all(k in whole.state_dict_metadata for k in metadata.state_dict_metadata)  # the splice holds every rank's
    mine = {k: None for k in encoded[-1].flat}
    files_for_s, _ = _t(lambda: load_engine.files_for(metadata, mine), reps)
    parsed = json.loads(manifest)
    comp_bytes = {n: len(json.dumps(c, separators=(",", ":"))) for n, c in parsed["components"].items()}
    return {
        "ranks": world,
        "files": len(files) + 1,
        "manifest_bytes": len(manifest),
        "shard_bytes": len(shard),
        "metadata_bytes": len(meta),
        "component_bytes": comp_bytes,
        "chunk_table_bytes": len(json.dumps(parsed["chunks"], separators=(",", ":"))),
        "files_table_bytes": len(json.dumps(parsed["files"], separators=(",", ":"))),
        "plan_payload_bytes_per_rank": 4 * 8,  # the agreement: an all_reduce of 4 int64 (``_dist.agree``)
        "gathered_plan_payload_bytes_per_rank": statistics.median(len(p) for p in plan_payload),
        "commit_payload_bytes_per_rank": statistics.median(len(p) for p in payloads),
        "load_parsed_bytes_per_rank": len(manifest) + len(shard),
        "load_parse_peak_bytes": parse_peak,
        "load_json_parse_peak_bytes": json_peak,
        "every_rank": {
            "encode_own_state_s": encode_s,
            "plan_local_s": plan_s,
            "gathered_unpickle_all_gather_s": unpickle_s,
            "gathered_plan_writes_s": gathered_plan_s,
            "share_and_chunk_share_s": share_s,
            "shard_and_metadata_part_s": part_s,
            "load_root_shard_and_metadata_s": load_s,
            "load_files_for_s": files_for_s,
            "verify_unpickle_whole_metadata_s": unpickle_meta_s,
        },
        "rank0": {
            "commit_unpickle_gathered_s": gather_s,
            "metadata_splice_s": meta_s,
            "root_manifest_s": manifest_s,
            "commit_s": gather_s + meta_s + manifest_s,
        },
    }


class _MemoryTarget:
    """A staging area in memory: what a rank's shard write needs of a SaveTarget."""

    def __init__(self, stored: dict[str, bytes]) -> None:
        self.stored = stored

    def write_member(self, name: str, data: bytes) -> dict[str, Any]:
        self.stored[name] = data
        return {"size": len(data), "checksum": "crc32:0123abcd"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,256,1000")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for world in (int(r) for r in args.ranks.split(",")):
        row = simulate(world, args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(
                json.dumps({"command": "python -m benchmarks.scaling_synth", "results": rows}, indent=1)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
