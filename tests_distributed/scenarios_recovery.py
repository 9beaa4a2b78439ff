"""Per-rank program for the local-tier recovery tests, run under ``torchrun --max-restarts 1`` on two "nodes".

    torchrun --nnodes 2 ... -m tests_distributed.scenarios_recovery train ARGS_JSON OUT_DIR

trains the learner and prioritized replay shard of :mod:`tests_distributed.scenarios_multinode`
through a :class:`~torchrl_dcp.CheckpointRotation` with a :class:`~torchrl_dcp.LocalTier` in the
node's own temporary directory, resuming at start. On the first attempt it fails as asked (a
worker SIGKILLed after a step, a node's tier wiped first, a worker killed inside a local save or
inside the replication); the agent restarts every worker, which resume and finish. Each rank
writes ``OUT_DIR/rank<R>.json``: where it resumed from (step, tier) and bit-exact digests of the
final state and of what follows it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

import torchrl_dcp as tdcp
import torchrl_dcp.peer_copy as peer_copy
import torchrl_dcp.save_engine as save_engine
from tests_distributed.scenarios_multinode import _checkpoint, _continue, _objects, _seed_rank, _train_step, digest

LOCAL_EVERY, SHARED_EVERY = 3, 10


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(fault: str, rank: int) -> None:
    """Make this rank die inside the next local save (``"save"``) or while sending its replica (``"replicate"``)."""
    if fault == "save":
        save_engine.run = lambda job: _die()  # type: ignore[assignment]
    elif fault == "replicate":
        real = peer_copy._isend
        sent = [0]

        def send_then_die(tensor: Any, peer: int, group: Any) -> Any:
            sent[0] += 1
            if sent[0] > 1:  # the header and a first piece went, the rest of the files had not
                _die()
            return real(tensor, peer, group)

        peer_copy._isend = send_then_die  # type: ignore[assignment]


def train(shared: str, steps: int, kill_at: int | None, victim: int, wipe: list[int], fault: str | None) -> dict:
    """Train to ``steps`` with local saves every 3 steps and shared ones every 10; fail once as asked."""
    start = tdcp.start_count()  # 1, then 2 after the agents restarted the workers (on every node alike)
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    objs = _objects(0)
    _seed_rank(0)
    ckpt = _checkpoint(objs)
    local = tdcp.LocalTier(Path(tempfile.gettempdir()) / "local-tier", every_steps=LOCAL_EVERY)
    rotation = tdcp.CheckpointRotation(shared, every_steps=SHARED_EVERY, keep_last=2, local=local)
    info = rotation.resume(ckpt)
    first = 0 if info is None else info.step
    for step in range(first + 1, steps + 1):
        _train_step(objs)
        failing = start == 1 and kill_at == step
        if failing and fault is not None and rank == victim:
            _arm(fault, rank)
        rotation.maybe_save(ckpt, step)
        if failing and fault is None:
            dist.barrier()
            if node in wipe and int(os.environ["LOCAL_RANK"]) == 0:
                tdcp_dir = local.path
                for p in sorted(tdcp_dir.rglob("*"), key=lambda p: -len(p.parts)):
                    p.rmdir() if p.is_dir() else p.unlink()
            dist.barrier()
            if victim in (rank, -1):  # -1: every worker of every node at once
                _die()
    rotation.close()
    resumed = None if info is None else {"step": info.step, "tier": info.tier, "start": start}
    return {"resumed": resumed, "final": digest(objs), "next": _continue(objs), "local_steps": local.steps()}


def main(argv: list[str]) -> None:
    name, args, out = argv
    tdcp.init_process_group("gloo")  # a namespace per restart in the agent's store
    try:
        value = globals()[name](*json.loads(args))
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "value": value}))


if __name__ == "__main__":
    main(sys.argv[1:])
