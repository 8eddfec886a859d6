"""Save and load pieces of global tensors with ``torch.distributed.checkpoint`` (DCP).

A checkpoint state is a flat dict: a global name -> ``Sharded`` (the rectangles of one
global tensor this rank holds, see ``ppctl.checkpoint.pieces``) or any picklable
object (step, loss scaler, random state). Two small planners hand DCP those
rectangles directly, instead of DTensors: ppctl's shards are not all expressible as
DTensor placements (the vocabulary is padded per TP size and cut off in the checkpoint;
a distributed-optimizer shard is a flat range of a TP shard, so up to three rectangles;
the fused QKV weight keeps each TP rank's heads of q, k and v). Everything else is
DCP's own: its global plan drops the copies that several ranks hold (TP-replicated
parameters, DP replicas, DualPipe's second parameter copy, a tied embedding) and checks
that the saved rectangles tile every tensor exactly, and its load plan reads each
requested rectangle from whichever saved rectangles overlap it, which is the resharding.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ppctl.checkpoint.pieces import Piece


class CheckpointMismatch(RuntimeError):
    """The checkpoint does not hold what this run needs (a missing tensor, another shape)."""


@dataclass
class Sharded:
    """This rank's rectangles of one global tensor of ``global_shape``."""

    global_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def add_pieces(state: dict[str, Any], name: str, global_shape: tuple[int, ...], pieces: list[Piece],
               unique: bool) -> None:
    """Add ``pieces`` of global tensor ``name`` to ``state``.

    ``unique`` (saving): a rectangle this rank already holds (a tied embedding's two copies,
    DualPipe's) is written once. Loading keeps every copy: each is a destination.
    """
    entry = state.setdefault(name, Sharded(tuple(global_shape)))
    if entry.global_shape != tuple(global_shape):
        raise ValueError(f"{name}: pieces of shape {tuple(global_shape)} and {entry.global_shape}")
    held = {piece.offsets for piece in entry.pieces} if unique else set()
    entry.pieces += [piece for piece in pieces if piece.offsets not in held]


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.size())


class _PieceSavePlanner(DefaultSavePlanner):
    """One write item per rectangle; DCP's global plan deduplicates and validates them."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self.tensors = {(name, piece.offsets): piece.tensor for name, entry in state_dict.items()
                        if isinstance(entry, Sharded) for piece in entry.pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, entry in self.state_dict.items():
            if not isinstance(entry, Sharded):
                items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
                continue
            for piece in entry.pieces:
                items.append(WriteItem(
                    index=MetadataIndex(name, torch.Size(piece.offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=_chunk(piece),
                                                properties=TensorProperties.create_from_tensor(piece.tensor),
                                                size=torch.Size(entry.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.state_dict[index.fqn], buffer)
            return buffer
        # A copy of just the rectangle: a view would drag its whole storage along.
        return self.tensors[(index.fqn, tuple(index.offset))].detach().clone()


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Read items for every rectangle this rank asks for; objects are returned in ``self.objects``."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator
        self.objects: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for name, entry in self.state_dict.items():
            if name not in stored:
                raise CheckpointMismatch(f"the checkpoint has no {name!r}")
            if not isinstance(entry, Sharded):
                if not isinstance(stored[name], BytesStorageMetadata):
                    raise CheckpointMismatch(f"the checkpoint's {name!r} is a tensor, not an object")
                requests += self._object_request(name)
                continue
            self._check_shape(name, entry, stored[name])
            requests += create_read_items_for_chunk_list(name, stored[name], [_chunk(p) for p in entry.pieces])
        return LoadPlan(requests)

    @staticmethod
    def _object_request(name: str) -> list[ReadItem]:
        return [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(name), dest_offsets=torch.Size((0,)),
                         storage_index=MetadataIndex(name), storage_offsets=torch.Size((0,)),
                         lengths=torch.Size((0,)))]

    @staticmethod
    def _check_shape(name: str, entry: Sharded, stored) -> None:
        if not isinstance(stored, TensorStorageMetadata):
            raise CheckpointMismatch(f"the checkpoint's {name!r} is an object, not a tensor")
        if tuple(stored.size) != entry.global_shape:
            raise CheckpointMismatch(f"the checkpoint's {name} has shape {list(stored.size)}, this model's "
                                     f"{list(entry.global_shape)}")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        piece = self.state_dict[index.fqn].pieces[index.index]
        lengths = read_item.lengths
        destination = piece.tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, lengths)):
            destination = destination.narrow(dim, start, length)
        return destination

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The reader copied into a view of the destination: nothing left to do."""


def save_state(state: dict[str, Any], directory: Path, process_group=None) -> None:
    """Write this rank's part of ``state`` into ``directory`` (collective over ``process_group``, default all).

    A failed write raises ``CheckpointSaveError``, whose first line names ``directory`` and why.
    """
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True),
                 planner=_PieceSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 process_group=process_group)
    except CheckpointException as error:
        raise CheckpointSaveError(save_failure(directory, error.failures)) from error


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message is one line naming it and the first failing rank's reason."""


def save_failure(directory: Path, failures: dict[int, Any]) -> str:
    """One line from DCP's per-rank failures (rank -> (exception, traceback)): the checkpoint, the first failing
    rank's exception (an OS error as its reason and file) and how many other ranks failed."""
    rank = min(failures)
    failure = failures[rank]
    error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, OSError) and error.strerror:
        reason = f"{error.strerror}" + (f" ({error.filename})" if error.filename else "")
    else:
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    return f"cannot save the checkpoint {directory}: rank {rank}: {reason.rstrip(': ')}{others}"


def load_state(state: dict[str, Any], directory: Path, process_group=None, alone: bool = False) -> dict[str, Any]:
    """Fill every rectangle of ``state`` from the checkpoint in ``directory``; return its objects by name.

    An object entry's value in ``state`` only names what to read. ``alone``: this process reads by itself, with
    no collective (``ppctl export``), whether or not a process group is up.
    """
    planner = _PieceLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), planner=planner,
                 process_group=process_group, no_dist=alone)
    return planner.objects
