"""How a torchrl ``Trainer`` and a ``DistributedCheckpoint`` meet: its lazy registrations, its ``load_from_file``.

torchrl's Trainer registers its components through ``checkpoint.register`` (``trainer_state`` last, which tells a
checkpoint that a Trainer binds it). Two of its entry points need help to work with our checkpoint:

- :func:`sync_trainer`: trainers that register components after ``Trainer.__init__`` (IQL, CQL) are registered before
  a load, so a fresh process resumes them too;
- :func:`bind_trainer_load`: ``trainer.load_from_file(path)`` reads our checkpoints, and torchrl's.

Example:
    >>> TRAINER_MARKER
    'trainer_state'
"""

from __future__ import annotations

import os
from typing import Any

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.torchrl_format.detect import is_torchrl_checkpoint, read_torchrl_manifest

__all__ = ["TRAINER_MARKER", "bind_trainer_load", "sync_trainer"]

TRAINER_MARKER = "trainer_state"  # what torchrl's Trainer registers when it binds a checkpoint


def sync_trainer(ckpt: Any) -> None:
    """Register what the bound torchrl ``Trainer`` would register at its next save, before a load.

    torchrl's Trainer registers its components when it is built and again before each save; trainers that set
    their replay buffer or target updater after ``Trainer.__init__`` (IQL, CQL in torchrl 0.14) are registered only
    at the first save, so a resume in a fresh process would skip them. The Trainer's own sync (a private method:
    skipped when a torchrl version lacks it) runs first, registering only names not yet registered.
    """
    marker = ckpt._components.get(TRAINER_MARKER)
    trainer = getattr(getattr(marker, "value", None), "trainer", None)
    sync = getattr(trainer, "_sync_checkpoint_components", None)
    bound = getattr(ckpt, "_solo_of", ckpt)  # a local tier's world-of-one copy shares the Trainer's registrations
    if callable(sync) and getattr(trainer, "checkpoint", None) is bound:
        sync(bound)


def bind_trainer_load(trainer: Any, ckpt: Any) -> None:
    """Make ``trainer.load_from_file(path)`` load a torchrl_dcp checkpoint (directory, archive or URL) into ``ckpt``.

    torchrl's ``Trainer.load_from_file`` recognises only ``torchrl.checkpoint``'s manifest and sends anything else to
    ``torch.load`` (``IsADirectoryError`` on our directories). The instance's method is wrapped: our checkpoints
    load through ``ckpt.load`` (the Trainer's lazy registrations first, then every registered component; torchrl's
    ``strict=True``/``False`` as ``"error"``/``"warn"``, ``map_location`` passed on), then the collector's policy
    weights are synchronised as torchrl does. A ``torchrl.checkpoint`` checkpoint (directory or archive) is
    imported read-only the same way (:mod:`torchrl_dcp.torchrl_format`), its components onto the same names; the
    ``rng`` streams our checkpoint adds to a Trainer's are not in it and keep their state. Other files (a
    ``torch.save`` of the legacy backend) go to torchrl's own method.
    """
    original = getattr(trainer, "load_from_file", None)
    if not callable(original) or getattr(original, "_tdcp_bound", False):
        return

    def load_from_file(file: Any, **kwargs: Any) -> Any:
        theirs = is_torchrl_checkpoint(file) if isinstance(file, (str, os.PathLike)) else False
        if not theirs and not _is_ours(file, ckpt.storage_options):
            return original(file, **kwargs)
        strict = kwargs.pop("strict", None)
        options: dict[str, Any] = {"map_location": kwargs.pop("map_location", None)}
        if strict is not None:
            options["strict"] = "error" if strict else "warn"
        if theirs:  # read-only import; the RNG streams we add to a Trainer's checkpoint are not in torchrl's
            saved = set(read_torchrl_manifest(file)["components"])
            sync_trainer(ckpt)  # the Trainer's lazy registrations first (ckpt.load would run them after the choice)
            options["components"] = [n for n in ckpt.components if n in saved or n != "rng"]
        result = ckpt.load(file, **options)
        update = getattr(getattr(trainer, "collector", None), "update_policy_weights_", None)
        if "policy" in result.loaded and callable(update):
            update()  # local copies and workers see the restored learner, as after torchrl's own load
        resumed = getattr(getattr(trainer, "checkpoint_rotation", None), "_resumed_from", None)
        if callable(resumed) and result.step is not None:  # our rotation's every_steps counts from the loaded step,
            resumed(result.step)  # as after its own resume (it saved again at the next iteration)
        return trainer

    load_from_file._tdcp_bound = True  # type: ignore[attr-defined]
    load_from_file.__doc__ = original.__doc__
    trainer.load_from_file = load_from_file


def _is_ours(path: Any, storage_options: Any) -> bool:
    """A checkpoint of ours: a directory (or store prefix) that is not torchrl's, or a file holding our manifest.

    A damaged checkpoint directory of ours is still ours (its load then says what is wrong), where ``torch.load``
    would only say it is a directory; a single file is ours when our manifest reads from it (a ``torch.save`` file
    goes to torchrl's own method)."""
    try:
        where = location_for(path, storage_options)
        if where.entry_kind() == "checkpoint":
            return True
        where.manifest()
    except (CheckpointError, OSError, TypeError, ValueError):
        return False
    return True
