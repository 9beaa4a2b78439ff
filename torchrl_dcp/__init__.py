"""torchrl_dcp: distributed, exact-resume checkpoints for TorchRL jobs, over torch.distributed.checkpoint.

Example:
    >>> import torchrl_dcp as tdcp
    >>> tdcp.DistributedCheckpoint  # doctest: +ELLIPSIS
    <class 'torchrl_dcp.checkpoint.DistributedCheckpoint'>
"""

from __future__ import annotations

__version__ = "0.1.0"

from torchrl_dcp.adapters import (
    Adapter,
    AdapterContext,
    CheckpointOptions,
    RNGState,
    register_adapter,
)
from torchrl_dcp.checkpoint import DistributedCheckpoint, LoadResult
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CollectiveError,
    EncodingError,
    IncompatibleComponentError,
    UnsafeCheckpointError,
    WorldSizeMismatchError,
)
from torchrl_dcp.manifest import read_manifest
from torchrl_dcp.placement import Placement
from torchrl_dcp.verify import verify

__all__ = [
    "Adapter",
    "AdapterContext",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CheckpointVersionError",
    "CollectiveError",
    "DistributedCheckpoint",
    "EncodingError",
    "IncompatibleComponentError",
    "LoadResult",
    "Placement",
    "RNGState",
    "UnsafeCheckpointError",
    "WorldSizeMismatchError",
    "__version__",
    "read_manifest",
    "register_adapter",
    "verify",
]
