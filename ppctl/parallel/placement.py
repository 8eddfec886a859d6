"""The stage placement: which pp rank runs each global pipeline stage, and how the stages form model copies.

The model is cut into global pipeline stages; a placement maps each one to the pp rank
that runs it. The schedule decides the placement (looped for 1F1B and interleaved 1F1B,
a V for ZB-V and DualPipeV, a V holding two model copies for DualPipe), and the layout
and the schedule share the one value: everything that depends on where a stage runs
(the layer map, the ranks that read tokens, hold embeddings or compute the loss, who
sends to whom) is answered here.

Plain integer arithmetic: nothing of ppctl's and no torch is imported.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Optional


class PlacementError(ValueError):
    """A placement that cannot be built (sizes below 1); the message is one line."""


@dataclass(frozen=True)
class Placement:
    """The pp rank of each global pipeline stage, and the model copies the stages hold.

    ``owners[stage]`` is the pp rank that runs global stage ``stage``. ``copies`` model
    copies (DualPipe holds 2) cut the global stages into ``copies`` consecutive runs of
    ``stages_per_copy``: global stage ``s`` runs model stage ``s % stages_per_copy`` of
    copy ``s // stages_per_copy``. Indexing and iterating a placement read its owners.
    Building one checks nothing; ``problem`` says whether it fits a pipeline.
    """

    owners: tuple[int, ...]
    copies: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "owners", tuple(self.owners))

    def __len__(self) -> int:
        return len(self.owners)

    def __getitem__(self, stage: int) -> int:
        return self.owners[stage]

    def __iter__(self) -> Iterator[int]:
        return iter(self.owners)

    @cached_property
    def num_stages(self) -> int:
        """The number of global pipeline stages (``pp * chunks_per_rank``)."""
        return len(self.owners)

    @cached_property
    def stages_per_copy(self) -> int:
        """The global stages of one model copy (all of them with one copy); a microbatch goes through these."""
        return self.num_stages // self.copies

    def model_stage(self, stage: int) -> int:
        """The model stage (which layers, within its copy) global stage ``stage`` runs."""
        return stage % self.stages_per_copy

    def copy_of(self, stage: int) -> int:
        """The model copy global stage ``stage`` belongs to (0 with one copy)."""
        return stage // self.stages_per_copy

    def rank_of(self, stage: int) -> int:
        """The pp rank that runs global stage ``stage``."""
        return self.owners[stage]

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The global stages ``pp_rank`` runs, in increasing order (its chunks 0, 1, ...); () for none."""
        return self._stages_by_rank.get(pp_rank, ())

    def chunk_of(self, stage: int) -> int:
        """The local chunk index of global stage ``stage``: its position among its rank's stages."""
        return self._chunks[stage]

    def model_stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The model stages ``pp_rank`` holds (of any copy), sorted."""
        return tuple(sorted({self.model_stage(stage) for stage in self.stages_of(pp_rank)}))

    @property
    def first_stage_rank(self) -> int:
        """The pp rank holding stage 0 (the embedding; it reads the tokens)."""
        return self.owners[0]

    @property
    def last_stage_rank(self) -> int:
        """The pp rank holding the last stage (output layer and loss; it logs)."""
        return self.owners[-1]

    @property
    def loss_stages(self) -> tuple[int, ...]:
        """The global stages that compute a loss: each copy's last."""
        return tuple((copy + 1) * self.stages_per_copy - 1 for copy in range(self.copies))

    @property
    def loss_pp_ranks(self) -> list[int]:
        """The pp ranks holding the last stage of some copy (they compute losses), sorted."""
        return sorted({self.owners[stage] for stage in self.loss_stages})

    @property
    def embedding_pp_ranks(self) -> list[int]:
        """The pp ranks holding the first stage of some copy or a loss: a word embedding or an output layer.

        One rank when a V puts both ends of the model on it.
        """
        firsts = {self.owners[copy * self.stages_per_copy] for copy in range(self.copies)}
        return sorted(firsts | set(self.loss_pp_ranks))

    def problem(self, pp: int, chunks_per_rank: int) -> Optional[str]:
        """What keeps this placement from running ``chunks_per_rank`` stages on each of ``pp`` ranks, or None.

        The stages number ``pp * chunks_per_rank``, every owner is a pp rank, every rank
        holds exactly ``chunks_per_rank`` stages, and ``copies`` (at least 1) divides the
        stages and each rank's chunks. The answer is one line.
        """
        expected = pp * chunks_per_rank
        if pp < 1 or chunks_per_rank < 1:
            return f"pp={pp} and chunks per rank={chunks_per_rank} must both be at least 1"
        if len(self.owners) != expected:
            return f"placement has {len(self.owners)} stages, expected pp*chunks_per_rank = {expected}"
        counts = collections.Counter(self.owners)  # one pass: pp may be large
        if min(counts) < 0 or max(counts) >= pp:
            stage, owner = next((stage, owner) for stage, owner in enumerate(self.owners) if not 0 <= owner < pp)
            return f"stage {stage} is placed on rank {owner}, outside 0..{pp - 1}"
        for pp_rank in range(pp):
            if counts[pp_rank] != chunks_per_rank:
                return (f"placement does not put {chunks_per_rank} of {expected} stages on each of {pp} pp ranks: "
                        f"rank {pp_rank} holds {counts[pp_rank]} stages, expected chunks_per_rank = {chunks_per_rank}")
        if self.copies < 1:
            return f"copies={self.copies} must be at least 1"
        if expected % self.copies:
            return f"{expected} pipeline stages cannot hold {self.copies} model copies"
        if chunks_per_rank % self.copies:
            return (f"{self.copies} model copies do not divide chunks_per_rank={chunks_per_rank}: "
                    f"each rank must hold as many chunks of every copy")
        return None

    @cached_property
    def _stages_by_rank(self) -> dict[int, tuple[int, ...]]:
        """pp rank -> its global stages, in increasing order (only ranks that hold some)."""
        stages: dict[int, list[int]] = {}
        for stage, owner in enumerate(self.owners):
            stages.setdefault(owner, []).append(stage)
        return {owner: tuple(owned) for owner, owned in stages.items()}

    @cached_property
    def _chunks(self) -> tuple[int, ...]:
        """Global stage -> its chunk index on its rank."""
        seen: collections.Counter[int] = collections.Counter()
        chunks = []
        for owner in self.owners:
            chunks.append(seen[owner])
            seen[owner] += 1
        return tuple(chunks)


def looped_placement(pp: int, chunks_per_rank: int) -> Placement:
    """Megatron's interleaved placement: stage s runs on rank ``s % pp`` (rank r holds r, r+pp, ...); one copy.

    With one chunk per rank this is the plain pipeline (stage r on rank r).
    """
    _check_sizes(pp, chunks_per_rank)
    return Placement(tuple(stage % pp for stage in range(pp * chunks_per_rank)))


def v_placement(pp: int, copies: int = 1) -> Placement:
    """The V placement (ZB-V, DualPipeV; DualPipe with ``copies=2``): rank r holds stages r and ``2*pp - 1 - r``.

    The stages go down the ranks and come back up, so stage 0 and the last stage both sit
    on rank 0. With one copy that is the model; with two (DualPipe) copy 0 runs down the
    ranks and copy 1 comes back up, model stage j of copy 1 on rank ``pp - 1 - j``.
    """
    _check_sizes(pp, 2)
    return Placement(tuple(stage if stage < pp else 2 * pp - 1 - stage for stage in range(2 * pp)), copies)


def wave_placement(pp: int, waves: int) -> Placement:
    """Hanayo's waves: ``2 * waves * pp`` stages folded down and up the ranks ``waves`` times (one copy).

    Stage s runs on rank ``s mod 2pp`` when that is below pp, else on ``2pp - 1 - (s mod 2pp)``;
    rank r holds ``2 * waves`` stages, and one wave is the V placement.
    """
    _check_sizes(pp, 2 * waves)
    return Placement(tuple(fold if fold < pp else 2 * pp - 1 - fold
                           for fold in (stage % (2 * pp) for stage in range(2 * waves * pp))))


def _check_sizes(pp: int, chunks_per_rank: int) -> None:
    """Refuse fewer than one rank or one chunk per rank."""
    if pp < 1 or chunks_per_rank < 1:
        raise PlacementError(f"pp={pp} and chunks per rank={chunks_per_rank} must both be at least 1")
