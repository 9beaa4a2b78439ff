"""Rank code of the trainer conformance suite: a straight run, a run SIGKILLed after a scheduled save, a resume.

Each rank writes ``<out>/<mode>.rank<r>.json``: one record per training iteration (frames, a digest of the
collected batch and of the learner after the iteration's optimisation), the state audit of the whole Trainer
(:func:`torchrl_dcp.audit.state_snapshot`) where the comparison needs it, and the RNG streams' next draws.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
from tests_distributed.trainer_zoo import build_trainer
from torchrl_dcp.audit import state_snapshot

#: collected frames of the whole run, and between two scheduled saves (the kill follows the first)
TOTAL_FRAMES = 96
SAVE_EVERY = 48


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        flat = torch.empty(t.numel(), dtype=t.dtype)  # fresh strides: a stride-0 view does not view as bytes
        flat.copy_(t.detach().cpu().reshape(-1))
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _learner_digest(trainer: Any) -> str:
    state = trainer.loss_module.state_dict()
    return digest(*(state[k] for k in sorted(state)))


def _rng_draws() -> dict[str, Any]:
    return {"torch": digest(torch.rand(4)), "numpy": np.random.rand(2).tolist(), "random": random.random()}


def _seed(rank: int) -> None:
    torch.manual_seed(2000 + rank)
    np.random.seed(2000 + rank)
    random.seed(2000 + rank)


def run(kind: str, ckpt_dir: str, mode: str, out: str, variant: str = "") -> None:
    """``mode``: ``straight`` (train to the end), ``kill`` (SIGKILL after the first scheduled save), ``resume``.
    ``variant``: ``rank_0_logs`` (rank 0 alone has a logger and logs an evaluation value: the usual distributed job),
    ``one_epoch`` (an on-policy Trainer of one epoch: its buffer's generator pauses after each iteration's last
    batch, and the next iteration draws nothing)."""
    rank = dist.get_rank()
    logger = None
    rank_0_logs = variant == "rank_0_logs"
    if rank_0_logs and rank == 0:
        from torchrl.record.loggers import CSVLogger

        logger = CSVLogger("rank0", log_dir=str(Path(out) / "logs"))
    epochs = 1 if variant == "one_epoch" else None
    build = {"total_frames": TOTAL_FRAMES, "save_every": SAVE_EVERY, "logger": logger, "num_epochs": epochs}
    trainer = build_trainer(kind, rank, ckpt_dir, **build)
    if rank_0_logs:
        trainer._log_interval = 20  # (SACTrainer(log_interval=...): a key is logged again after 20 frames)
        if rank == 0:  # (an evaluation value, and a hook of rank 0 alone: ``trainer_module.count_frames_log``)
            from torchrl.trainers import CountFramesLog

            trainer.register_op("post_steps_log", lambda batch: {"eval": float(batch["next", "reward"].mean())})
            CountFramesLog(frame_skip=1).register(trainer)
    _seed(rank)
    result: dict[str, Any] = {"records": []}
    current: dict[str, Any] = {}

    def on_batch(batch: Any) -> None:
        current.update(
            frames=trainer.collected_frames, batch=digest(*batch.select(*batch.keys(True, True)).values(True, True))
        )

    def after_steps() -> None:
        result["records"].append({**current, "learner": _learner_digest(trainer)})

    trainer.register_op("pre_steps_log", on_batch)
    trainer.register_op("post_steps", after_steps)
    path = Path(out) / f"{mode}.rank{rank}.json"
    if mode == "resume":
        info = tdcp.resume(trainer.checkpoint, ckpt_dir)
        result["resumed_step"] = None if info is None else info.step
        result["restored"] = state_snapshot(trainer, "trainer")
    if mode == "kill":
        save = trainer.save_trainer

        def save_then_die(*args: Any, **kwargs: Any) -> None:
            save(*args, **kwargs)
            if trainer.checkpoint_rotation.entries():  # the first scheduled save committed on every rank
                result["saved_step"] = trainer.checkpoint_rotation.entries()[-1].step
                result["saved"] = state_snapshot(trainer, "trainer")
                path.write_text(json.dumps(result))
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.save_trainer = save_then_die
    trainer.train()
    result["final"] = state_snapshot(trainer, "trainer")
    result["rng"] = _rng_draws()
    result["counters"] = {"frames": trainer.collected_frames, "optim_steps": trainer._optim_count}
    path.write_text(json.dumps(result))
