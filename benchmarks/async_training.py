"""Does training feel an async save? A training loop timed with and without a save of ``--mib`` MiB in flight.

The loop is a SAC-sized update on the CPU (actor and two critics of 256 hidden units,
batch 256, Adam): forward, backward, step. Three phases, alternated ``--rounds`` times:

- ``idle``: the loop alone, for as long as the async save below took;
- ``async``: ``async_save`` of a replay buffer holding ``--mib`` MiB is started, then the loop runs until the save
  committed (the steps between the call's return and the commit);
- ``blocking``: the time ``async_save`` itself blocked (staging the state into host memory).

Reported: update steps per second in both phases (medians), the slowdown while a save is in flight, and the
blocking time. ``--threads`` sets torch's intra-op threads of the loop (default: torch's). ``--controls`` also
times the loop against background work of one kind each over ``--mib`` MiB, ``--rounds`` times in a shuffled
order: raw ``os.write`` + ``fsync`` (the GIL released), a torch copy, 0.5 s of pure Python (the GIL held), and what a
save does to each byte (CRC-32 and Adler-32 of 1 MiB pieces, each written; fsync) in a thread and in a helper process
fed from shared memory: what a save's slowdown is made of (CPU and memory contention, or the GIL).

Usage::

    python -m benchmarks.async_training --mib 1024 --rounds 5 --out benchmarks/results/async-training-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def make_learner() -> tuple[list[torch.nn.Module], torch.optim.Optimizer]:
    def mlp(i: int, o: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(i, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, o),
        )

    nets = [mlp(17, 12), mlp(23, 1), mlp(23, 1)]  # actor (mean, log-std), two critics
    return nets, torch.optim.Adam([p for n in nets for p in n.parameters()], lr=3e-4)


def update(nets: list[torch.nn.Module], optim: torch.optim.Optimizer) -> None:
    obs, act = torch.randn(256, 17), torch.randn(256, 6)
    actor, q1, q2 = nets
    mean, log_std = actor(obs).chunk(2, -1)
    pi = torch.tanh(mean + log_std.clamp(-5, 2).exp() * torch.randn_like(mean))
    x, y = torch.cat([obs, act], -1), torch.cat([obs, pi], -1)
    loss = (q1(x) - 1).pow(2).mean() + (q2(x) - 1).pow(2).mean() - torch.min(q1(y), q2(y)).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def steps_for(seconds: float, nets: Any, optim: Any) -> float:
    """Update steps per second over ``seconds``."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        update(nets, optim)
        n += 1
    return n / elapsed


def make_buffer(mib: int) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rows = (mib << 20) // 4096
    rb = ReplayBuffer(storage=LazyTensorStorage(rows))
    rb.extend(TensorDict({"obs": torch.randn(rows, 1024)}, [rows]))
    return rb


def run(mib: int, rounds: int, root: Path) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    nets, optim = make_learner()
    ckpt = tdcp.DistributedCheckpoint(actor=nets[0], optimizer=optim)
    ckpt.register("buffer", make_buffer(mib))
    for _ in range(20):
        update(nets, optim)  # warm-up
    idle, busy, blocking, total = [], [], [], []
    for r in range(rounds):
        start = time.perf_counter()
        handle = ckpt.async_save(root / f"step-{r}", step=r)
        blocking.append(time.perf_counter() - start)
        n, t0 = 0, time.perf_counter()
        while not handle.done():
            update(nets, optim)
            n += 1
        elapsed = time.perf_counter() - t0
        handle.wait()
        total.append(time.perf_counter() - start)
        busy.append(n / elapsed if elapsed > 0 else float("nan"))
        shutil.rmtree(root / f"step-{r}", ignore_errors=True)
        idle.append(steps_for(max(elapsed, 0.5), nets, optim))
    med_idle, med_busy = statistics.median(idle), statistics.median(busy)
    return {
        "mib": mib,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "steps_per_s_idle": idle,
        "steps_per_s_during_save": busy,
        "blocking_s": blocking,
        "save_total_s": total,
        "median": {
            "steps_per_s_idle": med_idle,
            "steps_per_s_during_save": med_busy,
            "slowdown": 1 - med_busy / med_idle,
            "blocking_s": statistics.median(blocking),
            "save_total_s": statistics.median(total),
        },
    }


def _checksum_and_write(view: Any, path: str) -> tuple[int, int]:
    """What a save does to each byte, without the rest: CRC-32 and Adler-32 of 1 MiB pieces, each written, fsync."""
    from torchrl_dcp.format.checksums import adler32, crc32

    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        crc, adler = 0, 1
        for off in range(0, len(view), 1 << 20):
            piece = view[off : off + (1 << 20)]
            crc, adler = crc32(piece, crc), adler32(piece, adler)
            os.pwrite(fd, piece, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc, adler


def _helper(conn: Any, name: str, size: int) -> None:
    """A helper process: checksums and writes the shared memory ``name`` whenever asked (``_checksum_and_write``)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    view = shm.buf[:size]
    try:
        while (path := conn.recv()) is not None:
            conn.send(_checksum_and_write(view, path))
    finally:
        view.release()
        shm.close()


def controls(mib: int, rounds: int) -> dict[str, dict[str, Any]]:
    """The loop's slowdown while background work of one kind runs over ``mib`` MiB (see the module docstring),
    each kind ``rounds`` times in a shuffled order, the loop timed alone right after each for as long."""
    import multiprocessing
    import random
    import threading
    from multiprocessing import shared_memory

    nets, optim = make_learner()
    size = mib << 20
    shm = shared_memory.SharedMemory(create=True, size=size)
    data = torch.frombuffer(shm.buf, dtype=torch.float32)
    data.copy_(torch.randn(data.numel()))
    view = memoryview(data.numpy()).cast("B")
    piece = 8 << 20
    scratch = tempfile.mkdtemp(prefix="tdcp-controls-", dir="/tmp")
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    helper = ctx.Process(target=_helper, args=(child_conn, shm.name, size), daemon=True)
    helper.start()

    def raw_write() -> None:
        fd = os.open(f"{scratch}/raw", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            for off in range(0, len(view), piece):
                os.write(fd, view[off : off + piece])
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_copy() -> None:
        out = torch.empty_like(data)
        for off in range(0, data.numel(), piece // 4):
            out[off : off + piece // 4].copy_(data[off : off + piece // 4])

    def python_loop() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.5:
            sum(range(1000))

    def in_helper() -> None:  # this thread only waits on a pipe: the GIL stays with the loop
        conn.send(f"{scratch}/helper")
        conn.recv()

    kinds = {
        "raw write + fsync": raw_write,
        "torch copy": torch_copy,
        "pure Python": python_loop,
        "checksums + write, a thread": lambda: _checksum_and_write(view, f"{scratch}/thread"),
        "checksums + write, a helper process": in_helper,
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
    try:
        for _ in range(rounds):
            for name in random.sample(list(kinds), len(kinds)):
                thread = threading.Thread(target=kinds[name])
                n, start = 0, time.perf_counter()
                thread.start()
                while thread.is_alive():
                    update(nets, optim)
                    n += 1
                elapsed = time.perf_counter() - start
                idle = steps_for(max(elapsed, 0.5), nets, optim)
                runs[name].append((elapsed, 1 - n / elapsed / idle))
    finally:
        conn.send(None)
        helper.join(10)
        view.release()
        data = None  # the last reference to the shared memory's buffer: it can close
        shm.close()
        shm.unlink()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        name: {
            "seconds": statistics.median(s for s, _ in r),
            "slowdown": statistics.median(x for _, x in r),
            "lost_s": statistics.median(s * x for s, x in r),
            "slowdowns": [x for _, x in r],
        }
        for name, r in runs.items()
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads of the loop")
    ap.add_argument("--controls", action="store_true", help="also time background write / copy / Python threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="tdcp-async-training-", dir="/tmp"))
    try:
        report = run(args.mib, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.controls:
        report["controls"] = controls(args.mib, args.rounds)
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    m = report["median"]
    print(
        f"{args.mib} MiB async save, {report['threads']} torch thread(s): {m['steps_per_s_idle']:.0f} updates/s idle, "
        f"{m['steps_per_s_during_save']:.0f} with a save in flight (slowdown {m['slowdown']:.1%}); the call blocked "
        f"{m['blocking_s']:.3f} s, the save took {m['save_total_s']:.3f} s"
    )
    for name, c in report.get("controls", {}).items():
        print(
            f"  control, background {name}: slowdown {c['slowdown']:.1%} over {c['seconds']:.2f} s "
            f"(the loop lost {c['lost_s'] * 1e3:.0f} ms; medians of {args.rounds})"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
