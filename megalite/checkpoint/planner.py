"""torch.distributed.checkpoint (DCP) planners for blocks of global tensors.

The state dicts given to DCP here are flat: ``key -> value``. A tensor value is this
rank's block of a global tensor, described by a :class:`~megalite.checkpoint.layout.Piece`
(global shape + offsets); any other value (python objects: schedule, RNG, counters) is
pickled as a byte blob. DCP's own resharding then does the rest: on save the coordinator
merges every rank's blocks into one metadata entry per key (identical blocks written by
data-parallel replicas are deduplicated: one rank writes each); on load every rank reads
the overlap of its block with each saved block.

Only public DCP planner interfaces are used: ``WriteItem`` / ``ReadItem`` built from
``ChunkStorageMetadata``, and ``create_read_items_for_chunk_list`` for the overlaps.
"""

from __future__ import annotations

import io
import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
)
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpoint.layout import Piece


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets),
                                sizes=torch.Size(piece.sizes))


def _whole(key: str, tensor: torch.Tensor) -> Piece:
    shape = tuple(tensor.shape)
    return Piece(key, shape, (0,) * len(shape), shape)


class BlockSavePlanner(DefaultSavePlanner):
    """Writes each tensor of the state dict as the block ``pieces[key]`` (or the whole
    tensor when ``key`` has no piece) of its global tensor."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, torch.Tensor):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            piece = self.pieces.get(key) or _whole(key, value)
            if tuple(value.shape) != piece.sizes:
                raise ValueError(f"{key}: block {tuple(value.shape)} does not match its "
                                 f"piece {piece.sizes}")
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(piece), properties=TensorProperties.create_from_tensor(value),
                    size=torch.Size(piece.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn]

    def transform_object(self, write_item: WriteItem, obj):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            return buffer
        return obj.detach().contiguous()


class BlockLoadPlanner(DefaultLoadPlanner):
    """Fills each tensor of the state dict with its block ``pieces[key]`` of the saved
    global tensor; non-tensor values are replaced by the saved objects."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise KeyError(f"the checkpoint has no entry {key!r}")
            if isinstance(md, BytesStorageMetadata):
                items.append(ReadItem(type=LoadItemType.BYTE_IO,
                                      dest_index=MetadataIndex(key),
                                      dest_offsets=torch.Size((0,)),
                                      storage_index=MetadataIndex(key),
                                      storage_offsets=torch.Size((0,)),
                                      lengths=torch.Size((0,))))
                continue
            piece = self.pieces.get(key) or _whole(key, value)
            if tuple(md.size) != piece.global_shape:
                raise ValueError(f"{key}: saved shape {tuple(md.size)}, expected "
                                 f"{piece.global_shape}")
            items += create_read_items_for_chunk_list(key, md, [_chunk(piece)])
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


@contextmanager
def _quiet(no_dist: bool):
    """Silence DCP's 'assuming the intent is to ... in a single process' warning."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*in a single process")
        yield


def save_blocks(state: dict, pieces: dict[str, Piece], directory: str, *, group=None,
                no_dist: bool = False, sync_files: bool = True) -> None:
    """DCP-save ``state`` (blocks per ``pieces``) into ``directory`` (collective over
    ``group``, the world by default, unless ``no_dist``); ``sync_files`` False: the
    caller fsyncs the files itself. Blocks all on the CPU are
    written without DCP's copy-ahead loader: it opens a CUDA stream whenever CUDA is
    visible, which a ``--device cpu`` run on a GPU host must not."""
    on_gpu = any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in state.values())
    writer = dcp.FileSystemWriter(directory, sync_files=sync_files, single_file_per_rank=True,
                                  **({} if on_gpu else {"per_thread_copy_ahead": 0}))
    with _quiet(no_dist):
        dcp.save(state, storage_writer=writer, planner=BlockSavePlanner(pieces),
                 process_group=group, no_dist=no_dist)


def load_blocks(state: dict, pieces: dict[str, Piece], reader, *, no_dist: bool = False
                ) -> None:
    """DCP-load into ``state`` in place (``reader``: a ``FileSystemReader``); collective
    over the world unless ``no_dist``."""
    with _quiet(no_dist):
        dcp.load(state, storage_reader=reader, planner=BlockLoadPlanner(pieces),
                 no_dist=no_dist)
