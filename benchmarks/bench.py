"""Workloads and measurements of the benchmark suite (one function per rank; see ``benchmarks/run.py``).

Every rank builds the same workload (replicated model-like state, or its own shard of a
replay buffer), then each method is timed between two barriers: the time is the
slowest rank's. Bytes are the logical tensor bytes of the whole job (all ranks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrl_dcp.storage.commit import fsync_path

warnings.filterwarnings("ignore")

CHUNK = 1 << 20
MiB = 1 << 20


@dataclass
class Workload:
    name: str
    kind: str  # "tensors" (replicated on every rank) or "buffer" (a replay buffer per rank)
    description: str
    params: dict[str, Any]


def workloads(full: bool) -> list[Workload]:
    """The issue's sizes with ``full``; reduced sizes (same shapes) for a few minutes on 2 CPUs otherwise."""
    if full:
        large, medium, small, rb, pix = 1024, 256, 20_000, 1_000_000, 100_000
    else:
        large, medium, small, rb, pix = 256, 64, 5_000, 1_000_000, 5_000
    return [
        Workload("large", "tensors", f"1 × {large} MiB float32", {"tensors": [(large * MiB // 4,)]}),
        Workload("medium", "tensors", f"{medium} × 4 MiB float32", {"tensors": [(MiB,)] * medium}),
        Workload("small", "tensors", f"{small:,} × 1 KiB float32 (many-parameter model)", {"tensors": [(256,)] * small}),
        Workload(
            "rb_mujoco", "buffer", f"replay buffer, {rb:,} transitions, obs 17, act 6 (LazyTensorStorage)",
            {"n": rb, "obs": (17,), "act": 6, "dtype": "float32", "memmap": False},
        ),
        Workload(
            "rb_pixels", "buffer", f"replay buffer, {pix:,} transitions, 84×84×4 uint8 (LazyMemmapStorage)",
            {"n": pix, "obs": (4, 84, 84), "act": 6, "dtype": "uint8", "memmap": True},
        ),
    ]  # fmt: skip


# ---------------------------------------------------------------------- helpers
def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def drop_caches() -> bool:
    """Drop the page cache (root only); False where not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tensor_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]


def raw_write(path: Path, views: list[memoryview]) -> None:
    """The reference: the same bytes, written sequentially in 1 MiB chunks, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for v in views:
            for start in range(0, len(v), CHUNK):
                piece = v[start : start + CHUNK]
                done = 0
                while done < len(piece):
                    done += os.write(fd, piece[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, views: list[memoryview]) -> None:
    """The reference read: ``readinto`` preallocated memory, looping on short reads."""
    with open(path, "rb", buffering=0) as f:
        for v in views:
            done = 0
            while done < len(v):
                n = f.readinto(v[done:])
                if not n:
                    raise EOFError(path)
                done += n


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def copy_dir(src: Path, dst: Path) -> None:
    """A plain file copy of a checkpoint directory (fsynced), the yardstick for archive conversion."""
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
            fsync_path(dst / p.name)


class _StateHolder:
    """An object with ``state_dict``/``load_state_dict`` for ``torchrl.checkpoint``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.state[k].copy_(v)


# ---------------------------------------------------------------------- building workloads
def build(w: Workload, rank: int, world: int, device: torch.device, root: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    if w.kind == "tensors":
        state = {}
        for i, shape in enumerate(w.params["tensors"]):
            state[f"p{i:05d}"] = torch.randn(shape, generator=g).to(device)
        return {"state": state, "flat": state, "replicated": True}
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

    n = w.params["n"] // world
    if w.params["memmap"]:
        storage = LazyMemmapStorage(n, scratch_dir=str(root / f"scratch-{w.name}-{rank}"))
    else:
        storage = LazyTensorStorage(n)
    rb = ReplayBuffer(storage=storage, batch_size=256)
    dtype = getattr(torch, w.params["dtype"])
    step = min(n, 50_000)
    for start in range(0, n, step):
        b = min(step, n - start)

        def obs(b: int = b) -> torch.Tensor:
            if dtype == torch.uint8:
                return torch.randint(0, 255, (b, *w.params["obs"]), dtype=dtype, generator=g)
            return torch.randn((b, *w.params["obs"]), generator=g)

        rb.extend(
            TensorDict(
                {
                    "observation": obs(),
                    "action": torch.randn(b, w.params["act"], generator=g),
                    "next": {
                        "observation": obs(),
                        "reward": torch.randn(b, 1),
                        "done": torch.zeros(b, 1, dtype=torch.bool),
                    },
                },
                [b],
            )
        )
    td = rb.storage._storage
    flat = {f"rank{rank}/{k}": v for k, v in td.flatten_keys("/").items()}
    return {"state": rb, "flat": flat, "replicated": False}


# ---------------------------------------------------------------------- timing
class Recorder:
    def __init__(self, workload: Workload, world: int, total_bytes: int, reps: int) -> None:
        self.workload, self.world, self.total_bytes, self.reps = workload, world, total_bytes, reps
        self.rows: list[dict[str, Any]] = []

    def time(
        self, method: str, op: Callable[[], Any], before: Callable[[], Any] | None = None, reps: int | None = None
    ) -> float | None:
        """Best of ``reps`` (each between barriers; ``before`` runs untimed); None when it failed."""
        best = None
        error = None
        for _ in range(reps or self.reps):
            try:
                if before is not None:
                    before()
                barrier()
                t0 = time.perf_counter()
                op()
                sync_device()
                barrier()
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            except Exception as err:  # recorded, the suite goes on
                error = f"{type(err).__name__}: {err}"
                if os.environ.get("TDCP_BENCH_DEBUG"):
                    traceback.print_exc()
                barrier()
                break
        self.add(method, best, error)
        return best

    def add(self, method: str, seconds: float | None, error: str | None = None, nbytes: int | None = None) -> None:
        nbytes = self.total_bytes if nbytes is None else nbytes
        self.rows.append(
            {
                "workload": self.workload.name,
                "ranks": self.world,
                "method": method,
                "bytes": nbytes,
                "seconds": seconds,
                "gbps": (nbytes / seconds / 1e9) if seconds else None,
                "error": error,
            }
        )


def run_workload(
    w: Workload, rank: int, world: int, device: torch.device, root: Path, reps: int, extras: bool
) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import torchrl_dcp as tdcp

    root = root / f"{w.name}-{world}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    barrier()
    built = build(w, rank, world, device, root)
    flat: dict[str, torch.Tensor] = built["flat"]
    local_bytes = sum(t.numel() * t.element_size() for t in flat.values())
    total = local_bytes if built["replicated"] else local_bytes * world
    rec = Recorder(w, world, total, reps)
    can_drop = drop_caches() if rank == 0 else True

    def cold() -> None:
        barrier()
        if rank == 0:
            drop_caches()
        barrier()

    def fresh(path: Path) -> Callable[[], None]:
        def clean() -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            barrier()

        return clean

    # raw: every rank writes / reads its share of the bytes (replicated state split N ways)
    host = {k: (v.cpu() if v.device.type != "cpu" else v) for k, v in flat.items()}
    views = tensor_views(list(host.values()))
    if built["replicated"] and world > 1:
        views = [v[len(v) * rank // world : len(v) * (rank + 1) // world] for v in views]
    raw = root / f"raw-{rank}.bin"
    rec.time("raw write (1 MiB chunks + fsync)", lambda: raw_write(raw, views))
    read_views = tensor_views([torch.empty_like(t) for t in host.values()])
    if built["replicated"] and world > 1:
        read_views = [v[len(v) * rank // world : len(v) * (rank + 1) // world] for v in read_views]
    if can_drop:
        rec.time("raw read cold (readinto)", lambda: raw_read(raw, read_views), before=cold)
    rec.time("raw read warm (readinto)", lambda: raw_read(raw, read_views))
    os.unlink(raw)
    read_views = []  # release the destinations

    single = world == 1
    # torch.save (single process only)
    if single and extras:
        tfile = root / "torch.pt"

        def tsave() -> None:
            with open(tfile, "wb") as f:
                torch.save({k: v.as_subclass(torch.Tensor) for k, v in flat.items()}, f)
                f.flush()
                os.fsync(f.fileno())

        rec.time("torch.save (+fsync)", tsave)
        if can_drop:
            rec.time("torch.load cold", lambda: torch.load(tfile, weights_only=True), before=cold)
        rec.time("torch.load warm", lambda: torch.load(tfile, weights_only=True))
        tfile.unlink()

    # plain DCP
    dcp_dir = root / "dcp"
    pg = dist.group.WORLD if dist.is_initialized() else None
    rec.time(
        "dcp.save",
        lambda: dcp.save(flat, storage_writer=FileSystemWriter(str(dcp_dir), sync_files=True), process_group=pg),
        before=fresh(dcp_dir),
    )
    dest = {k: torch.empty_like(v) for k, v in flat.items()}
    if can_drop:
        rec.time("dcp.load cold", lambda: dcp.load(dest, checkpoint_id=str(dcp_dir), process_group=pg), before=cold)
    rec.time("dcp.load warm", lambda: dcp.load(dest, checkpoint_id=str(dcp_dir), process_group=pg))
    dest = {}
    if rank == 0:
        shutil.rmtree(dcp_dir, ignore_errors=True)

    # torchrl.checkpoint (single process only)
    if single and extras:
        from torchrl.checkpoint import Checkpoint

        obj = built["state"] if not built["replicated"] else _StateHolder(flat)
        trl = root / "torchrl"
        rec.time("torchrl.checkpoint save (no fsync)", lambda: Checkpoint(state=obj).save(trl), before=fresh(trl))

        def trl_durable() -> None:  # torchrl.checkpoint never fsyncs: what making its files durable adds
            Checkpoint(state=obj).save(trl)
            for p in sorted(trl.rglob("*"), key=lambda p: -len(p.parts)):
                fsync_path(p)
            fsync_path(trl)

        rec.time("torchrl.checkpoint save (+fsync)", trl_durable, before=fresh(trl))
        if can_drop:
            rec.time("torchrl.checkpoint load cold", lambda: Checkpoint(state=obj).load(trl), before=cold)
        rec.time("torchrl.checkpoint load warm", lambda: Checkpoint(state=obj).load(trl))
        if rank == 0:
            shutil.rmtree(trl, ignore_errors=True)

    # ours
    ckpt = tdcp.DistributedCheckpoint()
    ckpt.register("state", built["state"], placement="replicated" if built["replicated"] else "per_rank")
    ours = root / "ours"
    rec.time("torchrl_dcp save", lambda: ckpt.save(ours), before=fresh(ours))
    if built["replicated"] and world > 1:  # what comparing the replicas costs (default "sample")
        for mode in ("off", "full"):
            other = tdcp.DistributedCheckpoint(replica_check=mode)
            other.register("state", built["state"], placement="replicated")
            rec.time(f"torchrl_dcp save (replica_check={mode})", lambda o=other: o.save(ours), before=fresh(ours))
    handle: list[Any] = []

    def async_start() -> None:
        handle.append(ckpt.async_save(ours))

    def async_wait() -> None:
        handle.pop().wait()

    ckpt.async_save(ours).wait()  # first call allocates the staging buffers; later calls reuse them
    blocking, total_async = [], []
    for _ in range(reps):
        fresh(ours)()
        barrier()
        t0 = time.perf_counter()
        async_start()
        barrier()
        t1 = time.perf_counter()
        async_wait()
        barrier()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        total_async.append(t2 - t0)
    rec.add("torchrl_dcp async_save: blocking", min(blocking))
    rec.add("torchrl_dcp async_save: total", min(total_async))
    # the bandwidth limit of staging: copying this rank's tensors once into host memory already touched (page-locked
    # for device tensors, as staging uses; device copies are waited for)
    mine = list(_flat_tensors(built["state"]))
    on_device = any(t.device.type != "cpu" for t in mine)
    touched = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type != "cpu").copy_(t) for t in mine]

    def copy_once() -> None:
        for dst, src in zip(touched, mine):
            dst.copy_(src, non_blocking=src.device.type != "cpu")
        if on_device:
            torch.cuda.synchronize()

    rec.time("memcpy of the staged bytes (touched buffers)", copy_once)
    touched.clear()
    ckpt._async.release()
    if can_drop:
        rec.time("torchrl_dcp load cold", lambda: ckpt.load(ours), before=cold)
    rec.time("torchrl_dcp load warm", lambda: ckpt.load(ours))
    if single and extras:
        if can_drop:
            rec.time("torchrl_dcp load cold (verify=False)", lambda: ckpt.load(ours, verify=False), before=cold)
        rec.time("torchrl_dcp load warm (verify=False)", lambda: ckpt.load(ours, verify=False))
        from torchrl_dcp.storage.filesums import file_checksum

        data_files = [p for p in ours.iterdir() if p.name.endswith(".distcp")]
        rec.time("checksum pass alone, warm (CRC32 of the data files)", lambda: [file_checksum(p) for p in data_files])

    # archives (single process tool): conversion vs a plain copy, loads from the archive vs the directory
    if single and extras and hasattr(tdcp, "to_archive"):
        arch, copy = root / "ours.zip", root / "copy"
        nbytes = dir_bytes(ours)
        t = rec.time("plain copy of the checkpoint (+fsync)", lambda: copy_dir(ours, copy), before=fresh(copy))
        rec.rows[-1]["bytes"] = nbytes
        rec.rows[-1]["gbps"] = nbytes / t / 1e9 if t else None

        def to_archive() -> None:
            tdcp.to_archive(ours, arch, overwrite=True)

        t = rec.time("convert to archive", to_archive, before=lambda: arch.unlink(missing_ok=True))
        rec.rows[-1]["bytes"] = nbytes
        rec.rows[-1]["gbps"] = nbytes / t / 1e9 if t else None
        if can_drop:
            rec.time("torchrl_dcp load from archive cold", lambda: ckpt.load(arch), before=cold)
        rec.time("torchrl_dcp load from archive warm", lambda: ckpt.load(arch))
        shutil.rmtree(copy, ignore_errors=True)
    barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return rec.rows


def worker(rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    """One rank: process group (NCCL with one GPU per rank, gloo otherwise), then every workload."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    backend = "gloo"
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if torch.cuda.device_count() >= world:
            backend = "nccl"
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    rows: list[dict[str, Any]] = []
    try:
        for w in workloads(cfg["full"]):
            if w.name not in cfg["only"]:
                continue
            t0 = time.perf_counter()
            try:
                rows += run_workload(w, rank, world, device, Path(cfg["dir"]), cfg["reps"], cfg["extras"])
            except Exception as err:
                traceback.print_exc()
                rows.append({"workload": w.name, "ranks": world, "method": "(workload)", "error": repr(err)})
            if rank == 0:
                print(f"  {w.name} × {world} rank(s): {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        if rank == 0:
            queue.put({"backend": backend, "rows": rows})
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "torch": torch.__version__}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    with contextlib.suppress(Exception):
        out = subprocess.run(["df", "-T", "/tmp"], capture_output=True, text=True).stdout.splitlines()[-1].split()
        info["tmp_fs"] = f"{out[1]} on {out[0]}"
    import tensordict
    import torchrl

    info["torchrl"], info["tensordict"] = torchrl.__version__, tensordict.__version__
    return info


def _flat_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state, replay buffers' storages included (what an async save stages)."""
    from torchrl_dcp.adapters import resolve_adapter
    from torchrl_dcp.adapters.base import AdapterContext
    from torchrl_dcp.format.codec import encode

    adapter = resolve_adapter(state)
    return list(encode(adapter.state(state, AdapterContext("state")), where="state")[1].values())
