"""Per-rank microbatches, read once per TP group and broadcast to the rest of it.

Within a TP group only the source rank (TP rank 0) reads the dataset; it packs
the fields its pipeline stages need for the whole step into one int64 tensor and
broadcasts it; the other TP ranks allocate that tensor from the known shapes and
receive. Which fields a rank needs comes from its stages' I/O specs
(``ppctl.pipeline.stage.StageIO.fields``): the first stage reads tokens and position
ids, the last labels and the loss mask, a middle stage position ids under rotary
embeddings and otherwise nothing (no read, no broadcast); with documents kept apart
every stage with layers also reads each token's document (``segment_ids``).

With context parallelism every rank then keeps its CP rank's tokens of each field
(``slice_for_context_parallel``): chunks r and 2*cp-1-r of the sequence. Position ids
stay global, so positions are right on every stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ppctl.data.dataset import (
    Microbatch, WindowDataset, global_loss_tokens, microbatches_per_dp_rank, slice_for_context_parallel,
    step_microbatches,
)

ALL_FIELDS = ("tokens", "position_ids", "labels", "loss_mask", "segment_ids")
FLOAT32_FIELDS = ("loss_mask",)


class PipelineDataIterator:
    """Gives one rank the microbatches of each step for its DP rank and pipeline role.

    ``tp_group`` is this rank's TP process group (None when tp=1),
    ``tp_src_rank`` the global rank of TP rank 0 in it, ``is_tp_src`` whether
    this rank is that source. ``fields``: the microbatch fields this rank's stages
    read (any of ``ALL_FIELDS``). Non-source ranks never read ``dataset``.
    ``cp_rank`` / ``cp_size``: every field is cut to that CP rank's tokens after the
    broadcast (the loss-token count stays the whole global batch's).
    """

    def __init__(
        self, dataset: WindowDataset, seed: int, global_batch_size: int, micro_batch_size: int,
        seq_length: int, dp_rank: int, dp_size: int, tp_group: dist.ProcessGroup | None,
        tp_src_rank: int, is_tp_src: bool, fields: tuple[str, ...], device: str = "cpu",
        cp_rank: int = 0, cp_size: int = 1,
    ):
        if tp_group is None and not is_tp_src:
            raise ValueError("a rank without a TP group (tp=1) must be its own TP source; got is_tp_src=False")
        if dataset.seq_length != seq_length:
            raise ValueError(f"iterator seq_length={seq_length} differs from the dataset's {dataset.seq_length}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        if set(fields) - set(ALL_FIELDS):
            raise ValueError(f"unknown microbatch fields {sorted(set(fields) - set(ALL_FIELDS))}; "
                             f"known: {', '.join(ALL_FIELDS)}")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} out of range for cp_size={cp_size}")
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.dataset = dataset
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.tp_group = tp_group
        self.tp_src_rank = tp_src_rank
        self.is_tp_src = is_tp_src
        self.device = device  # where broadcast buffers live (NCCL broadcasts device tensors only)
        self.needed_fields = tuple(name for name in ALL_FIELDS if name in fields)  # a fixed order for packing
        self.num_microbatches = microbatches_per_dp_rank(global_batch_size, micro_batch_size, dp_size)

    def microbatches(self, step: int) -> list[Microbatch]:
        """Return this rank's microbatches of ``step``; fields its stage does not need are None."""
        if not self.needed_fields:
            return [Microbatch(**dict.fromkeys(ALL_FIELDS)) for _ in range(self.num_microbatches)]
        microbatches = self._read_and_send(step) if self.is_tp_src else self._receive()
        return [self._context_parallel_part(microbatch) for microbatch in microbatches]

    def _context_parallel_part(self, microbatch: Microbatch) -> Microbatch:
        """This CP rank's tokens of every field present (the whole microbatch when cp=1)."""
        if self.cp_size == 1:
            return microbatch
        return Microbatch(**{name: None if value is None else slice_for_context_parallel(value, self.cp_rank,
                                                                                          self.cp_size)
                             for name, value in vars(microbatch).items()})

    def global_loss_tokens(self, step: int, microbatches: list[Microbatch],
                           replicas: dist.ProcessGroup | None = None) -> float:
        """Return the loss-weight sum over the whole global batch ``step``: the one count its loss is divided by
        (last-stage ranks only).

        ``microbatches`` are this rank's of ``step`` (``microbatches(step)``: its DP rank's share, cut to its CP
        part); ``replicas`` is the group of the ranks holding the other shares (the dp x cp ranks of this pp rank;
        None when there are none). With all-ones masks the count is gbs*seq, with no message; otherwise each rank
        sums the masks it holds in float64 and one all-reduce over ``replicas`` adds the shares, so the count is
        what the loss's masks hold and no rank reads another's samples. Every rank of ``replicas`` must call this.
        """
        if "loss_mask" not in self.needed_fields:
            raise RuntimeError("global_loss_tokens needs the loss mask; this rank does not hold the last pipeline stage")
        if self.dataset.loss_mask_all_ones:
            return global_loss_tokens(self.dataset, self.seed, step, self.global_batch_size)
        share = torch.stack([microbatch.loss_mask.to(torch.float64).sum() for microbatch in microbatches]).sum()
        if replicas is not None and dist.get_world_size(replicas) > 1:
            dist.all_reduce(share, group=replicas)
        return float(share.item())

    def _read_and_send(self, step: int) -> list[Microbatch]:
        """Read this step's microbatches, broadcast the needed fields, keep only those."""
        microbatches = step_microbatches(
            self.dataset, self.seed, step, self.global_batch_size, self.micro_batch_size,
            self.dp_rank, self.dp_size,
        )
        if self._tp_size() > 1 and self.device != "cpu":
            return unpack_fields(self._broadcast(pack_fields(microbatches, self.needed_fields)), self.needed_fields)
        if self._tp_size() > 1:
            self._broadcast(pack_fields(microbatches, self.needed_fields))
        return [_keep_fields(microbatch, self.needed_fields) for microbatch in microbatches]

    def _receive(self) -> list[Microbatch]:
        """Receive this step's needed fields from the TP source into freshly allocated buffers."""
        packed = torch.empty(
            len(self.needed_fields), self.num_microbatches, self.micro_batch_size, self.seq_length,
            dtype=torch.int64, device=self.device,
        )
        return unpack_fields(self._broadcast(packed), self.needed_fields)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` (moved to the device) from the TP source to its TP group; return it."""
        tensor = tensor.to(self.device)
        if self._tp_size() > 1:
            dist.broadcast(tensor, src=self.tp_src_rank, group=self.tp_group)
        return tensor

    def _tp_size(self) -> int:
        """Return the size of this rank's TP group (1 without one)."""
        return 1 if self.tp_group is None else dist.get_world_size(self.tp_group)


def pack_fields(microbatches: list[Microbatch], field_names: tuple[str, ...]) -> torch.Tensor:
    """Return the named fields of all microbatches as one int64 tensor ``[fields, mb, mbs, seq]``.

    Float fields travel as the bit pattern of their float64 value, which is exact
    for float32 data.
    """
    per_field = []
    for name in field_names:
        stacked = torch.stack([getattr(microbatch, name) for microbatch in microbatches])
        per_field.append(stacked.to(torch.float64).view(torch.int64) if name in FLOAT32_FIELDS else stacked)
    return torch.stack(per_field)


def unpack_fields(packed: torch.Tensor, field_names: tuple[str, ...]) -> list[Microbatch]:
    """Return the microbatches held in ``packed`` (see ``pack_fields``); other fields are None."""
    fields = {}
    for field_index, name in enumerate(field_names):
        values = packed[field_index]
        fields[name] = values.view(torch.float64).to(torch.float32) if name in FLOAT32_FIELDS else values
    num_microbatches = packed.shape[1]
    return [
        Microbatch(**{name: fields[name][index] if name in fields else None for name in ALL_FIELDS})
        for index in range(num_microbatches)
    ]


def _keep_fields(microbatch: Microbatch, field_names: tuple[str, ...]) -> Microbatch:
    """Return ``microbatch`` with every field not in ``field_names`` set to None."""
    return Microbatch(**{name: getattr(microbatch, name) if name in field_names else None for name in ALL_FIELDS})
