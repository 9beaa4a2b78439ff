"""torchrl_dcp: distributed, exact-resume checkpoints for TorchRL jobs, over torch.distributed.checkpoint.

Example:
    >>> import torchrl_dcp as tdcp
    >>> tdcp.DistributedCheckpoint  # doctest: +ELLIPSIS
    <class 'torchrl_dcp.checkpoint.DistributedCheckpoint'>
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from torchrl_dcp._version import __version__

# Names whose modules import torch are imported on first use, so that torch-free tools
# (``torchrl-dcp inspect / ls / convert``, tdcp.to_archive / to_directory) start in
# milliseconds and stream multi-GB checkpoints in a few tens of MB of RSS (importing
# torch alone costs ~0.5 GB of RSS). Add a new torch-dependent export here and below.
_LAZY: dict[str, str] = {
    "Adapter": "torchrl_dcp.adapters",
    "AdapterContext": "torchrl_dcp.adapters",
    "CheckpointOptions": "torchrl_dcp.adapters",
    "RNGState": "torchrl_dcp.adapters",
    "register_adapter": "torchrl_dcp.adapters",
    "SaveHandle": "torchrl_dcp.async_save",
    "DistributedCheckpoint": "torchrl_dcp.checkpoint",
    "LoadResult": "torchrl_dcp.checkpoint",
    "LocalTier": "torchrl_dcp.local_tier",
    "init_process_group": "torchrl_dcp.elastic",
    "start_count": "torchrl_dcp.elastic",
    "verify": "torchrl_dcp.verification",
    "StateDifference": "torchrl_dcp.audit",
    "state_differences": "torchrl_dcp.audit",
    "state_snapshot": "torchrl_dcp.audit",
}

if TYPE_CHECKING:
    from torchrl_dcp.adapters import Adapter, AdapterContext, CheckpointOptions, RNGState, register_adapter
    from torchrl_dcp.async_save import SaveHandle
    from torchrl_dcp.audit import StateDifference, state_differences, state_snapshot
    from torchrl_dcp.checkpoint import DistributedCheckpoint, LoadResult
    from torchrl_dcp.elastic import init_process_group, start_count
    from torchrl_dcp.local_tier import LocalTier
    from torchrl_dcp.verification import verify


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a subpackage: ``tdcp.adapters.register_...``
        raise AttributeError(f"module 'torchrl_dcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


from torchrl_dcp.convert import to_archive, to_directory  # torch-free
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CheckpointVersionError,
    CollectiveError,
    EncodingError,
    IncompatibleComponentError,
    InexactResumeWarning,
    LocalTierWarning,
    PartialLoadWarning,
    StaleCheckpointWarning,
    TorchrlDcpWarning,
    UnrestoredComponentWarning,
    UnsafeCheckpointError,
    WorldSizeMismatchError,
)
from torchrl_dcp.export import export_torchrl  # torch-free
from torchrl_dcp.placement import Placement
from torchrl_dcp.rotation import CheckpointRotation, ResumeInfo, resume
from torchrl_dcp.rotation_entries import RotationEntry, by_commit
from torchrl_dcp.storage.backends import read_manifest

__all__ = [
    "Adapter",
    "AdapterContext",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CheckpointOptions",
    "CheckpointRotation",
    "CheckpointVersionError",
    "CollectiveError",
    "DistributedCheckpoint",
    "EncodingError",
    "IncompatibleComponentError",
    "InexactResumeWarning",
    "LoadResult",
    "LocalTier",
    "PartialLoadWarning",
    "Placement",
    "RNGState",
    "ResumeInfo",
    "RotationEntry",
    "SaveHandle",
    "LocalTierWarning",
    "StaleCheckpointWarning",
    "StateDifference",
    "TorchrlDcpWarning",
    "UnrestoredComponentWarning",
    "UnsafeCheckpointError",
    "WorldSizeMismatchError",
    "__version__",
    "by_commit",
    "export_torchrl",
    "init_process_group",
    "start_count",
    "read_manifest",
    "register_adapter",
    "resume",
    "state_differences",
    "state_snapshot",
    "to_archive",
    "to_directory",
    "verify",
]
