"""Checkpoints written by ``torchrl.checkpoint`` (torchrl 0.14), read-only: load, verify and inspect them.

:meth:`~torchrl_dcp.DistributedCheckpoint.load`, ``verify`` and ``inspect`` recognise such a
checkpoint (a directory or a ``.torchrl`` ZIP archive whose ``manifest.json`` says
``torchrl.checkpoint``) and read it through this package: :mod:`.reader` parses its files
without a pickle, :mod:`.buffers` maps a dumped replay buffer onto our adapter's state,
:mod:`.importer` restores the components all-or-nothing; :mod:`.detect` (torch-free) says
whether a path holds one.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl.checkpoint import Checkpoint
    >>> from torchrl_dcp.torchrl_format import is_torchrl_checkpoint
    >>> path = Checkpoint(policy=torch.nn.Linear(2, 1)).save(tempfile.mkdtemp() + "/c")
    >>> is_torchrl_checkpoint(path)
    True
"""

from torchrl_dcp.torchrl_format.detect import is_torchrl_checkpoint

__all__ = ["is_torchrl_checkpoint"]
