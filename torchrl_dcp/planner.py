"""DCP planners: what each rank writes and reads.

Per-rank state already carries rank-specific keys (``rank/<r>/...``) when it
reaches DCP, so DCP's key-based de-duplication can only merge truly replicated
state, whose writes it then balances across ranks. The load planner refuses byte
items (DCP would ``torch.load(weights_only=False)`` them) and checks every
destination's dtype and shape against the saved metadata, which DCP does not do
for dtypes.

Example:
    >>> from torchrl_dcp.planner import SavePlanner, SafeLoadPlanner
    >>> SavePlanner().flatten_state_dict
    False
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchrl_dcp.errors import IncompatibleComponentError, UnsafeCheckpointError


class SavePlanner(DefaultSavePlanner):
    """Our state dicts are flat ``{key: tensor}``: no flattening, balanced de-duplication."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True, dedup_save_to_lowest_rank=False)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only, into destinations whose dtype and shape match what was saved."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True, allow_partial_load=False)

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, dest in state_dict.items():
            saved = metadata.state_dict_metadata.get(key)
            if saved is None:
                raise IncompatibleComponentError(f"tensor {key!r} is not in the checkpoint's DCP metadata")
            if not isinstance(saved, TensorStorageMetadata):
                raise UnsafeCheckpointError(f"entry {key!r} is a byte item, which torchrl_dcp never loads")
            if saved.properties.dtype != dest.dtype or tuple(saved.size) != tuple(dest.shape):
                raise IncompatibleComponentError(
                    f"tensor {key!r} was saved as {saved.properties.dtype} {tuple(saved.size)}, "
                    f"the destination is {dest.dtype} {tuple(dest.shape)}"
                )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn!r} is a byte item, which torchrl_dcp never loads")
