"""Does training feel an async save? A training loop timed with and without a save of ``--mib`` MiB in flight.

The loop is a SAC-sized update on the CPU (actor and two critics of 256 hidden units,
batch 256, Adam): forward, backward, step. Three phases, alternated ``--rounds`` times:

- ``idle``: the loop alone, for as long as the async save below took;
- ``async``: ``async_save`` of a replay buffer holding ``--mib`` MiB is started, then the loop runs until the save
  committed (the steps between the call's return and the commit);
- ``blocking``: the time ``async_save`` itself blocked (staging the state into host memory).

Reported: update steps per second in both phases (medians), the slowdown while a save is in flight, and the
blocking time. ``--threads`` sets torch's intra-op threads of the loop (default: torch's). ``--controls`` also
times the loop against background threads that do one kind of work each over ``--mib`` MiB: raw ``os.write`` +
``fsync`` (the GIL released), a torch copy, and 0.5 s of pure Python (the GIL held): what a save's slowdown is made
of (CPU contention or the GIL).

Usage::

    python -m benchmarks.async_training --mib 1024 --rounds 5 --out benchmarks/results/async-training-cpu.json
"""

from __future__ import annotations

import argparse
import json
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


def controls(mib: int) -> dict[str, dict[str, float]]:
    """The loop's slowdown while one background thread writes, copies, or runs Python (see the module docstring)."""
    import os
    import threading

    nets, optim = make_learner()
    data = torch.randn(mib << 18)
    view = memoryview(data.numpy()).cast("B")
    piece = 8 << 20

    def raw_write() -> None:
        fd, name = tempfile.mkstemp(dir="/tmp")
        try:
            for off in range(0, len(view), piece):
                os.write(fd, view[off : off + piece])
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)

    def torch_copy() -> None:
        out = torch.empty_like(data)
        for off in range(0, data.numel(), piece // 4):
            out[off : off + piece // 4].copy_(data[off : off + piece // 4])

    def python_loop() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.5:
            sum(range(1000))

    out = {}
    for name, fn in (("raw write + fsync", raw_write), ("torch copy", torch_copy), ("pure Python", python_loop)):
        idle = steps_for(0.6, nets, optim)
        thread = threading.Thread(target=fn)
        n, start = 0, time.perf_counter()
        thread.start()
        while thread.is_alive():
            update(nets, optim)
            n += 1
        elapsed = time.perf_counter() - start
        out[name] = {"seconds": elapsed, "steps_per_s_idle": idle, "slowdown": 1 - n / elapsed / idle}
    return out


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
        report["controls"] = controls(args.mib)
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    m = report["median"]
    print(
        f"{args.mib} MiB async save, {report['threads']} torch thread(s): {m['steps_per_s_idle']:.0f} updates/s idle, "
        f"{m['steps_per_s_during_save']:.0f} with a save in flight (slowdown {m['slowdown']:.1%}); the call blocked "
        f"{m['blocking_s']:.3f} s, the save took {m['save_total_s']:.3f} s"
    )
    for name, c in report.get("controls", {}).items():
        print(f"  control, a background {name}: slowdown {c['slowdown']:.0%} over {c['seconds']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
