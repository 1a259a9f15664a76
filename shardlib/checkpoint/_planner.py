"""DCP planners over :class:`Boxes`: one storage chunk per box, resharded by DCP on load."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["Boxes", "SavePlanner", "LoadPlanner"]


class Boxes:
    """Boxes of one global tensor held by this rank: ``pieces`` ``[(global offsets, view)]``."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype, pieces: list):
        self.size, self.dtype, self.pieces = torch.Size(size), dtype, pieces
        self.by_offset = {tuple(o): t for o, t in pieces}  # unique when saving

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def find(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index
        if i is not None and i < len(self.pieces) and tuple(self.pieces[i][0]) == tuple(index.offset):
            return self.pieces[i][1]  # a load may write one box into two copies (master, compute)
        return self.by_offset[tuple(index.offset)]


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner (deduplication of equal boxes, global-plan validation) over
    :class:`Boxes` values: one write item per box."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, Boxes)}  # tensors, bytes
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Boxes):
                props = TensorProperties(dtype=obj.dtype)
                items += [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                                    tensor_data=TensorWriteData(chunk=c, properties=props, size=obj.size))
                          for c in obj.chunks()]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.find(index) if isinstance(obj, Boxes) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """Reads, for every :class:`Boxes` box, the overlapping parts of the saved boxes (DCP's
    resharding); bytes items land in ``self.loaded``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.loaded: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # not DefaultLoadPlanner's: its state-dict walk would replace Boxes values by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, Boxes)}  # tensors, bytes
        items = list(create_default_local_load_plan(plain, self.metadata).items)
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Boxes):
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], obj.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.find(index) if isinstance(obj, Boxes) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=False)
