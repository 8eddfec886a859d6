"""The TP ranks of one layout as threads of one process: a forward at tp > 1 without process groups.

``lockstep_logits(config, tokens)`` builds each TP rank's whole-model chunk of ``config`` (its parameters read as
that rank reads them: ``model.init_from`` slices included) and runs their forwards side by side, one thread per
rank; the collectives of ``ppctl.parallel.tensor_parallel`` (the embedding's and the row-parallel projections'
all-reduces) meet at a barrier, where each rank takes the same sum, in rank order. Forward only, without
sequence parallelism: what a unit test needs to compare a TP layout's logits with another model's.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

BARRIER_TIMEOUT_S = 60  # a rank that fails leaves the others waiting: they give up, and the failure is raised


class _Rank:
    """The ``TPGroup.group`` of one thread: which rank it is."""

    def __init__(self, rank: int):
        self.rank = rank


class _Lockstep:
    """What ``tensor_parallel`` calls of ``torch.distributed``, for ranks that are threads."""

    ReduceOp = dist.ReduceOp

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, tensor: torch.Tensor, group: _Rank) -> list[torch.Tensor]:
        self.slots[group.rank] = tensor.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # no rank writes its next slot before every rank has read this round's
        return every

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: _Rank | None = None) -> None:
        """Sum (or max) of every rank's ``tensor``, in place."""
        every = self._exchange(tensor, group)
        tensor.copy_(torch.stack(every).amax(0) if op == dist.ReduceOp.MAX else sum(every[1:], every[0]))

    def all_gather(self, pieces: list[torch.Tensor], tensor: torch.Tensor, group: _Rank | None = None) -> None:
        """Every rank's ``tensor`` into ``pieces``."""
        for piece, part in zip(pieces, self._exchange(tensor, group)):
            piece.copy_(part)


def lockstep_logits(config, tokens: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The logits ``[batch, seq, padded vocabulary]`` of ``config`` at its ``parallel.tp`` (pp=1), the ranks' shards
    put side by side; ``monkeypatch`` (pytest's) swaps ``tensor_parallel``'s collectives for the threads'."""
    import ppctl.parallel.tensor_parallel as tensor_parallel
    from ppctl.model.from_config import build_chunk
    from ppctl.model.recompute import Recompute
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup

    tp, stage = config.parallel.tp, StageLayers.whole(config.model.num_layers)
    monkeypatch.setattr(tensor_parallel, "dist", _Lockstep(tp))

    def rank_logits(rank: int) -> torch.Tensor:
        chunk = build_chunk(config, stage, RankGroups(tp=TPGroup(_Rank(rank), tp, rank)), recompute=Recompute())
        with torch.no_grad():
            return chunk(tokens)

    with ThreadPoolExecutor(tp) as pool:
        shards = [future.result() for future in [pool.submit(rank_logits, rank) for rank in range(tp)]]
    return torch.cat(shards, dim=-1)
