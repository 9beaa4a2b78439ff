"""Per-rank save cost from 1 to N ranks with a fixed per-rank state: where coordination time goes.

Every world size runs in real processes (``torch.multiprocessing`` spawn, gloo). Each rank holds
the same amount of state whatever the world size (weak scaling), in four variants:

- ``dict``: a 16 MiB per_rank buffer-like tensor (cut into two 8 MiB chunk files), 200 small
  per_rank tensors (1 KiB each) and a replicated 4 MiB policy (``nn.Linear(1024, 1024)``);
- ``rb``: a real torchrl ``TensorDictReplayBuffer`` shard (``LazyTensorStorage``, 16 MiB of
  observations, sampler/writer state) per rank, plus the same policy;
- ``tiny``: a 4 KiB policy and one per_rank scalar: the fixed cost of a save (collectives, manifest,
  staging and rename) with almost no bytes;
- ``small2000``: 2,000 per_rank 1 KiB tensors and a 4 KiB policy: metadata-bound (what a rank reads
  and parses at load grows with the world unless metadata is per rank).

Per world size and variant: the bytes each rank reads during a load (``/proc/self/io`` ``rchar``, max
over ranks), the number of exchanges and monitored barriers per save and per load, the median over
``--reps`` of the save and load time of the slowest rank
(between barriers), the time of each collective phase (its monitored barrier, the exchange) and
of rank 0's commit work (``benchmarks/scaling_hooks.py`` wraps the library's functions from outside;
no library code is changed), the pickled payload of each collective (untimed warm-up), the
manifest and ``.metadata`` sizes (per component), the number of files, the CPU seconds of all
ranks, and a baseline: the same files written by rank 0 alone, raw (1 MiB writes + fsync), with no
coordination. ``coordination_per_rank_s`` = (save - baseline) / ranks.

Usage::

    python -m benchmarks.scaling --ranks 1,2,4,8 --out benchmarks/results/scaling-cpu-2cpu.json
    python -m benchmarks.scaling --ranks 1,2,4,8 --device cuda --out $OUT/scaling-gpu.json  # a GPU machine
    python -m benchmarks.scaling --ranks 1,2 --variants dict --s3-ranks 1,2   # + a local S3 server (moto)
    python -m benchmarks.scaling --plot-only benchmarks/results/scaling-cpu-2cpu.json --plot docs/img/scaling.png

With more ranks than CPUs the ranks share them: the report records ``cpus`` and each row's CPU
seconds so that CPU-bound time can be told from waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import scaling_hooks as hooks
from benchmarks.scaling_report import plot, summarize_table

MIB = 1 << 20


# ---------------------------------------------------------------------- per-rank state
def build_state(variant: str, rank: int, device: str) -> dict[str, tuple[Any, str]]:
    """``{name: (object, placement)}``: the same sizes on every rank, different values per rank."""
    g = torch.Generator().manual_seed(1234 + rank)
    torch.manual_seed(0)  # the replicated policy is the same everywhere
    if variant == "small2000":
        small = {f"t{i:04d}": torch.randn(256, generator=g).to(device) for i in range(2000)}
        return {"policy": (torch.nn.Linear(32, 32).to(device), "replicated"), "small": (small, "per_rank")}
    if variant == "tiny":
        return {
            "policy": (torch.nn.Linear(32, 32).to(device), "replicated"),
            "counters": ({"step": torch.tensor([rank])}, "per_rank"),
        }
    policy = torch.nn.Linear(1024, 1023).to(device)  # 4 MiB of parameters
    if variant == "dict":
        buffer = {"obs": torch.randn(4096, 1024, generator=g).to(device)}  # 16 MiB: two 8 MiB chunk files
        small = {f"t{i:03d}": torch.randn(256, generator=g).to(device) for i in range(200)}
        return {"policy": (policy, "replicated"), "buffer": (buffer, "per_rank"), "small": (small, "per_rank")}
    if variant == "rb":
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

        rows = 4096
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(rows, device=device), batch_size=256)
        rb.extend(
            TensorDict(
                {
                    "observation": torch.randn(rows, 1024, generator=g),
                    "action": torch.randn(rows, 6, generator=g),
                    ("next", "reward"): torch.randn(rows, 1, generator=g),
                    ("next", "done"): torch.zeros(rows, 1, dtype=torch.bool),
                },
                [rows],
            ).to(device)
        )
        rb.sample()
        return {"policy": (policy, "replicated"), "buffer": (rb, "per_rank")}
    raise ValueError(f"unknown variant {variant!r}")


def checkpoint_for(state: dict[str, tuple[Any, str]], storage_options: Any = None) -> Any:
    import torchrl_dcp as tdcp

    ckpt = tdcp.DistributedCheckpoint(storage_options=storage_options)
    for name, (obj, placement) in state.items():
        ckpt.register(name, obj, placement=placement)
    return ckpt


# ---------------------------------------------------------------------- measurements
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Any) -> dict[str, Any]:
    """Run ``fn`` between barriers; this rank's own wall and CPU seconds and hooked events."""
    _barrier()
    hooks.reset()
    read = rchar()
    cpu, t = time.process_time(), time.perf_counter()
    fn()
    own = time.perf_counter() - t
    cpu = time.process_time() - cpu
    read = rchar() - read
    events = hooks.totals()
    _barrier()
    return {"own_s": own, "cpu_s": cpu, "events": events, "rchar": read}


def rchar() -> int:
    """Bytes this process has read through read() and friends (``/proc/self/io``; 0 where there is none)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))
    except (OSError, StopIteration):
        return 0


def gather(rec: dict[str, Any]) -> list[dict[str, Any]] | None:
    if not dist.is_initialized():
        return [rec]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rec, out, dst=0)
    return out


def raw_write(files: dict[str, int], directory: Path) -> float:
    """One process writes files of these sizes (1 MiB writes, fsync each, then the directory): no coordination."""
    directory.mkdir(parents=True)
    block = bytearray(os.urandom(MIB))
    t = time.perf_counter()
    for name, size in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left > 0:
                left -= os.write(fd, memoryview(block)[: min(left, MIB)])
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t


def sizes_of(path: Path) -> dict[str, Any]:
    """Manifest, ``.metadata`` and per-component manifest bytes, file counts (rank 0, after a save)."""
    import torchrl_dcp as tdcp

    manifest_bytes = (path / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    comp = {n: len(json.dumps(c, separators=(",", ":"), sort_keys=True)) for n, c in manifest["components"].items()}
    root_files = manifest["files"]
    files = tdcp.read_manifest(path)["files"]  # every file: each rank's own are listed in its shard (format 7)
    return {
        "manifest_bytes": len(manifest_bytes),
        "metadata_bytes": files[".metadata"]["size"],
        "shard_bytes": files.get("manifest-0.json", {}).get("size", 0),  # rank 0's manifest shard (format 5)
        "component_bytes": comp,
        "chunk_table_bytes": len(json.dumps(manifest.get("chunks", {}), separators=(",", ":"))),
        "files_table_bytes": len(json.dumps(root_files, separators=(",", ":"))),
        "files": len(files) + 1,  # + manifest.json
        "data_files": sum(1 for n in files if n.endswith(".distcp")),
        "total_bytes": sum(r["size"] for r in files.values()) + len(manifest_bytes),
        "file_sizes": {n: r["size"] for n, r in files.items()},
    }


def summarize(reps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per rep: slowest rank's wall time, each event's max over ranks, CPU summed; then medians over reps."""
    walls = [max(r["own_s"] for r in rep) for rep in reps]
    cpus = [sum(r["cpu_s"] for r in rep) for rep in reps]
    names = sorted({n for rep in reps for r in rep for n in r["events"] if not n.startswith(("bytes:", "count:"))})
    slowest = {n: statistics.median(max(r["events"].get(n, 0.0) for r in rep) for rep in reps) for n in names}
    rank0 = {n: statistics.median(rep[0]["events"].get(n, 0.0) for rep in reps) for n in names}
    return {
        "wall_s": statistics.median(walls),
        "wall_all_s": walls,
        "rchar_max_rank_bytes": statistics.median(max(r["rchar"] for r in rep) for rep in reps),
        "collectives_rank0": hooks.exchanges(reps[-1][0]["events"]),
        "cpu_s_all_ranks": statistics.median(cpus),
        "events_slowest_rank_s": slowest,
        "events_rank0_s": {n: v for n, v in rank0.items() if n.startswith(("rank0.", "barrier", "gather", "all_g"))},
    }


def run_variant(
    rank: int, world: int, variant: str, cfg: dict[str, Any], root: str, storage_options: Any = None
) -> dict[str, Any] | None:
    state = build_state(variant, rank, cfg["device"])
    ckpt = checkpoint_for(state, storage_options)
    store = "://" in root
    join = (lambda *p: "/".join((root, *p))) if store else (lambda *p: str(Path(root, *p)))
    counts = hooks.count_s3_requests() if store else None
    hooks.PROBE = True  # warm-up: what each rank sends in each collective (pickled bytes), not timed
    payload: dict[str, dict[str, float]] = {}
    for kind, fn in (
        ("save", lambda: ckpt.save(join(variant, "warm"))),
        ("load", lambda: ckpt.load(join(variant, "warm"))),
    ):
        hooks.reset()
        fn()
        payload[kind] = {n[6:]: v for n, v in hooks.totals().items() if n.startswith("bytes:")}
    hooks.PROBE = False
    saves, loads = [], []
    requests: list[dict[str, int]] = []
    for rep in range(cfg["reps"]):
        path = join(variant, f"r{rep}")
        if counts is not None:
            counts.clear()
        saves.append(gather(timed(lambda p=path, s=rep: ckpt.save(p, step=s))))
        save_counts = dict(counts or {})
        if counts is not None:
            counts.clear()
        loads.append(gather(timed(lambda p=path: ckpt.load(p))))
        if rank == 0 and rep > 0 and not store:  # every rank is past the load (gather): keep r0 for sizes
            shutil.rmtree(path, ignore_errors=True)
        requests.append({"save": save_counts, "load": dict(counts or {})})
    all_requests = gather({"requests": requests})
    payloads = gather(payload)
    if rank != 0:
        return None
    out: dict[str, Any] = {"variant": variant, "ranks": world, "store": store}
    out["save"] = summarize(saves)  # type: ignore[arg-type]
    out["load"] = summarize(loads)  # type: ignore[arg-type]
    if store:
        per_rank = [r["requests"] for r in all_requests or []]
        ops: dict[str, dict[str, list[int]]] = {"save": {}, "load": {}}
        for kind in ops:
            for rep in range(cfg["reps"]):
                total: dict[str, int] = {}
                for rank_reqs in per_rank:
                    for op, n in rank_reqs[rep][kind].items():
                        total[op] = total.get(op, 0) + n
                for op, n in total.items():
                    ops[kind].setdefault(op, []).append(n)
        out["s3_requests"] = {k: {op: statistics.median(v) for op, v in d.items()} for k, d in ops.items()}
        return out
    sizes = sizes_of(Path(join(variant, "r0")))
    out["sizes"] = {k: v for k, v in sizes.items() if k != "file_sizes"}
    raws = [raw_write(sizes["file_sizes"], Path(root, variant, f"raw{i}")) for i in range(cfg["reps"])]
    out["raw_write_rank0_alone_s"] = statistics.median(raws)
    out["coordination_per_rank_s"] = (out["save"]["wall_s"] - out["raw_write_rank0_alone_s"]) / world
    out["payload_bytes_per_rank"] = {  # what one rank sends (max over ranks), per collective
        kind: {n: max(p[kind].get(n, 0.0) for p in payloads or []) for n in payloads[0][kind]}  # type: ignore[index]
        for kind in ("save", "load")
    }
    shutil.rmtree(Path(root, variant), ignore_errors=True)
    return out


def run(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    hooks.install()
    results = []
    for variant in cfg["variants"]:
        with tempfile.TemporaryDirectory(prefix="scaling-", dir=cfg["dir"]) as d:
            root = _shared_dir(d, rank)
            results.append(run_variant(rank, world, variant, cfg, root))
        if world in cfg["s3_ranks"] and variant == "dict":
            prefix = f"s3://{cfg['bucket']}/w{world}"
            results.append(run_variant(rank, world, variant, cfg, prefix, cfg["storage_options"]))
    return [r for r in results if r is not None]


def _shared_dir(local: str, rank: int) -> str:
    """Rank 0's scratch directory, known to every rank."""
    box = [local]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def run_world(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from benchmarks.world import spawn_world

    return spawn_world(world, run, cfg, timeout=cfg["timeout"])


def machine(device: str) -> dict[str, Any]:
    import torchrl

    info = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "device": device,
        "backend": "gloo (checkpoint collectives and the job's group)",
        "load_average": os.getloadavg(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--variants", default="tiny,dict,rb,small2000")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--s3-ranks", default="", help="world sizes that also save the dict variant to a local S3")
    parser.add_argument("--dir", default=os.environ.get("TDCP_BENCH_DIR"), help="scratch directory")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--plot", default=None, help="PNG plot (skipped without matplotlib)")
    parser.add_argument("--plot-only", default=None, help="plot an existing JSON report and exit")
    args = parser.parse_args(argv)
    if args.plot_only:
        report = json.loads(Path(args.plot_only).read_text())
        print(summarize_table(report))
        plot(report, args.plot or "docs/img/scaling.png")
        return 0
    cfg: dict[str, Any] = {
        "variants": [v for v in args.variants.split(",") if v],
        "reps": args.reps,
        "device": args.device,
        "dir": args.dir,
        "timeout": args.timeout,
        "s3_ranks": [int(r) for r in args.s3_ranks.split(",") if r],
        "bucket": None,
        "storage_options": None,
    }
    server = None
    if cfg["s3_ranks"]:
        from tests_distributed.s3server import s3_server

        server = s3_server()
        os.environ.update(server.env)  # spawned ranks inherit it
        cfg["bucket"], cfg["storage_options"] = server.bucket, server.storage_options
    report: dict[str, Any] = {"machine": machine(args.device), "command": "python -m benchmarks.scaling", "results": []}
    try:
        for world in (int(r) for r in args.ranks.split(",")):
            t = time.perf_counter()
            rows = run_world(world, cfg)
            report["results"] += rows
            print(f"{world} rank(s): {time.perf_counter() - t:.0f} s", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    finally:
        if server is not None:
            server.stop()
    report["machine"]["load_average_end"] = os.getloadavg()
    print(summarize_table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
