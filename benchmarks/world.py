"""Run a benchmark function on ``world`` real ranks (spawned processes, gloo), as torchrun would.

Example:
    >>> from benchmarks.world import spawn_world
    >>> spawn_world(1, len, {})  # doctest: +SKIP
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RankFn = Callable[[int, int, dict[str, Any]], Any]  # (rank, world, cfg) -> rank 0's result


def _worker(fn: RankFn, rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if cfg.get("device") == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, cfg)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def spawn_world(world: int, fn: RankFn, cfg: dict[str, Any], timeout: float = 3600) -> Any:
    """``fn(rank, world, cfg)`` on ``world`` spawned ranks (a module-level function); returns rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while True:  # a rank that died is reported at once, not after the whole timeout
            try:
                return queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for other in procs:  # the others would wait for it in their next collective
                        other.kill()
                    raise RuntimeError(f"rank(s) died before returning a result: {dead} (rank, exit code)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result from rank 0 within {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
