"""A torchrl ``Trainer`` driven by a :class:`~torchrl_dcp.CheckpointRotation`'s policies and preemption.

A ``Trainer(..., checkpoint=DistributedCheckpoint(), checkpoint_rotation=CheckpointRotation(...))``
binds the rotation when it registers its components (torchrl 0.14.1,
``Trainer._sync_checkpoint_components``). The binding:

- adds a ``post_steps`` operation that takes the rotation's decision for the step
  (:meth:`CheckpointRotation.decide`: one collective when preemption signals or
  ``every_seconds`` are configured) and, when a preemption signal reached any rank, calls
  ``trainer.request_stop``: the Trainer finishes the iteration, saves (forced, synchronously)
  at its usual place and leaves ``train()`` cleanly;
- replaces the instance's ``save_trainer`` (the Trainer's own schedule,
  ``save_trainer_interval``) by the rotation's ``every_steps`` / ``every_seconds`` when
  either is set (torchrl's interval otherwise), saving with ``async_saves`` when set. The
  save happens where torchrl's does (end of the iteration, after the logging hooks), so a
  resume continues exactly as the run that never stopped. The final save (``total_frames``
  reached) is synchronous. A rotation's :class:`~torchrl_dcp.LocalTier` saves on its own schedule
  at the same place.

Steps are the Trainer's ``collected_frames``, as in torchrl's own checkpoints.

Example:
    >>> rotation = tdcp.CheckpointRotation("ckpts", every_steps=10_000, keep_last=2,
    ...                                    preemption_signals=(signal.SIGTERM,))  # doctest: +SKIP
    >>> trainer = SACTrainer(..., checkpoint=tdcp.DistributedCheckpoint(), checkpoint_rotation=rotation)  # doctest: +SKIP
    >>> tdcp.resume(trainer.checkpoint, "ckpts"); trainer.train(); rotation.close()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.adapters.trainer_rank_state import MID_ITERATION
from torchrl_dcp.errors import TorchrlDcpWarning

logger = get_logger(__name__)

_BOUND = "_tdcp_rotation"


class _TrainerBinding:
    """The state the two Trainer entry points share: the decision of the current iteration."""

    def __init__(self, rotation: Any, trainer: Any) -> None:
        self.rotation = rotation
        self.trainer = trainer
        self.decision: Any = None

    def post_steps(self) -> None:
        trainer = self.trainer
        self.decision = self.rotation.decide(trainer.checkpoint, int(trainer.collected_frames))
        if self.decision.preempted:  # (a stop the requeued job must not inherit: saved as none, trainer_state)
            trainer._tdcp_preempted = True
            trainer.request_stop(f"preempted ({self.decision.signal or 'a signal on another rank'})")

    def save_trainer(self, force_save: bool = False) -> None:
        trainer, rotation = self.trainer, self.rotation
        step = int(trainer.collected_frames)
        # a save from a hook inside an iteration (MID_ITERATION) counts toward no schedule: the iteration's own save
        # at its end stays due, and replaces it (a resume from it would skip the rest of the iteration)
        inside = getattr(trainer, MID_ITERATION, False) is True
        decision = self.decision
        if not inside:  # (the iteration's own save: the decision of its post_steps op, taken once)
            self.decision = None
        if decision is None or decision.step != step:  # called outside the training loop, or from a hook
            decision = rotation.decide(trainer.checkpoint, step)
        if inside and decision.preempted:  # not the preemption's save: the iteration's end stops and saves (exact)
            decision = dataclasses.replace(decision, preempted=False, signal=None)
        if inside and step == rotation._last_step and self._holds(step):
            # (a batch_process hook: torchrl counts the batch's frames after them) the step of the last save at an
            # iteration's end, or of the last load: a save now would replace that checkpoint by one a resume from
            # which skips the rest of this iteration; the iteration's own save (at its end) stays due
            if force_save:
                warnings.warn(
                    f"save_trainer(force_save=True) from a hook inside the iteration after step {step}: the "
                    f"checkpoint of step {step} (the last one saved at an iteration's end, or the one the Trainer "
                    "loaded) would be replaced by one that skips the rest of this iteration at a resume, so it is "
                    "not made. Save from a hook that runs after torchrl counts the batch's frames (pre_optim_steps "
                    "or later)",
                    TorchrlDcpWarning,
                    stacklevel=2,
                )
            return
        if rotation.schedule.active:
            scheduled = decision.due
        else:  # torchrl's own schedule
            scheduled = (step - trainer._last_save) > trainer.save_trainer_interval
        if scheduled and not inside:
            trainer._last_save = step  # what torchrl records at a scheduled save
        local_due = rotation.local is not None and rotation.local.due(step)  # the node-local tier's own schedule
        if not (force_save or scheduled or decision.preempted or local_due):
            return
        rotation.save_decided(
            trainer._sync_checkpoint_components(),
            decision,
            trainer._checkpoint_manifest_metadata(),
            force=force_save or scheduled,
            sync=force_save or decision.preempted,
            counted=not inside,
        )

    def _holds(self, step: int) -> bool:
        """Whether the rotation holds an entry of ``step`` (its save in flight committed first: every rank waits for
        its own, as the save would)."""
        self.rotation.wait()
        return any(e.step == step for e in self.rotation.entries())


def bind_trainer(rotation: Any, trainer: Any, ckpt: Any) -> None:
    """Let ``rotation`` decide when ``trainer`` saves ``ckpt`` (once per Trainer; see the module docstring)."""
    if getattr(trainer, _BOUND, None) is rotation:
        return
    for needed in ("register_op", "request_stop", "_sync_checkpoint_components", "_checkpoint_manifest_metadata"):
        if not callable(getattr(trainer, needed, None)):
            logger.warning(
                "this torchrl Trainer has no %s: the rotation's policies and preemption do not drive its saves "
                "(torchrl's save_trainer_interval does); call rotation.maybe_save yourself",
                needed,
            )
            return
    best = rotation.keep_best
    if best is not None and best[0] not in ("collected_frames", "optim_steps") and trainer.checkpoint_metadata is None:
        raise ValueError(  # (it failed at the first save, training done until then)
            f"the rotation's keep_best ranks checkpoints by metadata[{best[0]!r}], which this Trainer's saves do not "
            f"record (only collected_frames and optim_steps): build the Trainer with "
            f"checkpoint_metadata=lambda trainer: {{{best[0]!r}: <the metric>}}"
        )
    binding = _TrainerBinding(rotation, trainer)

    def checkpoint_policy() -> None:  # a named op: the Trainer's hook timing logs show it
        binding.post_steps()

    trainer.register_op("post_steps", checkpoint_policy)
    trainer.save_trainer = binding.save_trainer  # the instance's schedule: torchrl's train() calls it each iteration
    trainer.train = _unless_finished(trainer, trainer.train)
    setattr(trainer, _BOUND, rotation)


def _unless_finished(trainer: Any, train: Any) -> Any:
    """``trainer.train``, except for a Trainer resumed from a checkpoint at or past its ``total_frames`` (a job
    requeued after its last save, e.g. preempted in its last iteration), or from the save a stop request made
    (``EarlyStopping``): torchrl's loop compares the frames and the request only after a batch, so it trained one
    batch more and saved past the end, unlike the run that never stopped. Then it trains nothing (the collector is
    left as it is: a raised ``total_frames`` trains on) and says so."""

    def train_unless_finished(*args: Any, **kwargs: Any) -> Any:
        if getattr(trainer, "_stop_training", False) is True:  # (restored: the save a stop request made last)
            logger.warning(
                "the Trainer was stopped early in the run it resumed from (%s): nothing left to train; set "
                "trainer._stop_training = False before train() to train further",
                getattr(trainer, "_stop_reason", None) or "request_stop",
            )
            return None
        total, done = getattr(trainer, "total_frames", None), getattr(trainer, "collected_frames", 0)
        if type(total) is int and total > 0 and type(done) is int and done >= total:
            logger.warning(
                "the Trainer has collected %d frames of total_frames=%d (resumed from its last checkpoint): "
                "nothing left to train; raise total_frames to train further",
                done,
                total,
            )
            return None
        return train(*args, **kwargs)

    return train_unless_finished
