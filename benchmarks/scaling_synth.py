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
- rank 0 at commit: ``dcp_metadata`` + pickle (``.metadata``), ``build_manifest`` + ``dumps``
  (JSON + the manifest's CRC-32 seal);
- every rank at load: ``loads_manifest`` (parse, checksum, validate) and the allow-list unpickling of
  ``.metadata``; ``load_engine.files_for`` (a scan of every storage entry).

Data file sizes and offsets are computed, not written. Usage::

    python -m benchmarks.scaling_synth --ranks 8,64,256,1000 --out benchmarks/results/scaling-synth.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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
    from torchrl_dcp.format.dcp_metadata import parse_metadata
    from torchrl_dcp.format.manifest import loads_manifest
    from torchrl_dcp.planner import plan_local, plan_writes, tensor_infos
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

    gathered = []
    for r, (enc, plan) in enumerate(zip(encoded, plans)):
        files: dict[str, Any] = {}
        entries, offset = [], 0
        for key in plan.share(r):
            length = plan.tensors[key].nbytes + RECORD_OVERHEAD
            entries.append((key, f"__{r}_0.distcp", offset, length))
            offset += length
        if entries:
            files[f"__{r}_0.distcp"] = {"size": offset + 64, "checksum": "crc32:0123abcd"}
        chunks = []
        for c in plan.chunk_share(r):
            length = c.rows * plan.tensors[c.key].nbytes // plan.tensors[c.key].shape[0] + RECORD_OVERHEAD
            files[c.file] = {"size": length + 64, "checksum": "crc32:0123abcd"}
            chunks.append(ChunkEntry(c.key, c.start, c.rows, c.file, 0, length, "crc32:0123abcd.adler32:0123abcd"))
        per_rank = {n: (rec.state, rec.inventory) for n, rec in enc.records.items() if rec.placement == "per_rank"}
        gathered.append((None, files, entries, per_rank, chunks))
    commit_payload = [len(pickle.dumps(g)) for g in gathered]
    with tempfile.TemporaryDirectory() as d:
        job = save_engine.SaveJob(Path(d), None, 1, {}, encoded[0], plans[0], None, 0, world, save_id="0" * 32)
        meta_s, meta = _t(lambda: pickle.dumps(save_engine.dcp_metadata(job, gathered, d)), reps)
        files = {name: rec for g in gathered for name, rec in g[1].items()}
        files[".metadata"] = {"size": len(meta), "checksum": "crc32:0123abcd"}
        manifest_s, manifest = _t(lambda: save_engine.dumps(save_engine.build_manifest(job, gathered, files)), reps)
        parse_s, _ = _t(lambda: loads_manifest(manifest, "synthetic"), reps)
        unpickle_meta_s, metadata = _t(lambda: parse_metadata(meta, "synthetic"), reps)
    mine = {k: None for k in encoded[-1].flat}
    files_for_s, _ = _t(lambda: load_engine.files_for(metadata, mine), reps)
    parsed = json.loads(manifest)
    comp_bytes = {n: len(json.dumps(c, separators=(",", ":"))) for n, c in parsed["components"].items()}
    return {
        "ranks": world,
        "files": len(files) + 1,
        "manifest_bytes": len(manifest),
        "metadata_bytes": len(meta),
        "component_bytes": comp_bytes,
        "chunk_table_bytes": len(json.dumps(parsed["chunks"], separators=(",", ":"))),
        "files_table_bytes": len(json.dumps(parsed["files"], separators=(",", ":"))),
        "plan_payload_bytes_per_rank": 4 * 8,  # the agreement: an all_reduce of 4 int64 (``_dist.agree``)
        "gathered_plan_payload_bytes_per_rank": statistics.median(len(p) for p in plan_payload),
        "commit_payload_bytes_per_rank": statistics.median(commit_payload),
        "every_rank": {
            "encode_own_state_s": encode_s,
            "plan_local_s": plan_s,
            "gathered_unpickle_all_gather_s": unpickle_s,
            "gathered_plan_writes_s": gathered_plan_s,
            "share_and_chunk_share_s": share_s,
            "load_parse_manifest_s": parse_s,
            "load_unpickle_metadata_s": unpickle_meta_s,
            "load_files_for_s": files_for_s,
        },
        "rank0": {"dcp_metadata_and_pickle_s": meta_s, "build_manifest_and_dumps_s": manifest_s},
    }


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
