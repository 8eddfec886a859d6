"""The parallel layout: pure rank arithmetic, process-group membership and the layer map.

Nothing here imports ``torch.distributed`` or starts a process: the layout of any
world size is plain integer arithmetic, so it is tested exhaustively and printed by
``ppctl inspect-layout`` for thousands of ranks in a fraction of a second.

Rank order follows Megatron-Core's ``RankGenerator``: the order string lists the
dimensions from fastest-varying to slowest, so with the default ``tp-cp-dp-pp``
consecutive ranks form a TP group and pipeline groups are strided by tp*cp*dp.

The layout also carries the stage placement (``ppctl.parallel.placement``: global
pipeline stage -> pp rank, and the model copies), which the schedule decides and shares.
The layout builds on it what depends on where a stage runs: the layer map, the
``embedding`` group (the ranks holding the embedding and the output layer) and the
``replica`` group (with DualPipe's two copies, the mirror pp rank too).

With expert parallelism (``ep > 1``) the same ranks have a second view for the experts, Megatron-Core's "MoE
parallel folding": the ranks of each pipeline stage, in the dense order, are re-read as ``etp-ep-edp`` (expert
tensor parallel fastest), so the pipeline groups are the dense ones. The ``ep`` groups exchange tokens; the ``edp``
groups (``expert_replica`` with DualPipe's mirror rank) hold the same experts and reduce their gradients. A stage's
ranks must be consecutive for the fold: with ``ep > 1`` the order must end in ``pp``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from ppctl.parallel.placement import Placement, looped_placement

DIMENSIONS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"

# Group name -> the dimensions whose ranks it spans.
GROUP_DIMENSIONS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
    "tp_pp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
}
# ``embedding``: the ranks holding copies of a tied word embedding; ``replica``: the ranks holding
# the same parameters (dp x cp, and with DualPipe's two model copies the mirror pp rank too).
GROUP_NAMES = (*GROUP_DIMENSIONS, "embedding", "replica")
# The expert view's groups (only with ep > 1): ``ep`` (the ranks a layer's experts are split over, which exchange
# tokens), ``edp`` (the ranks holding the same experts) and ``expert_replica`` (edp, and with DualPipe's two model
# copies the mirror pp rank's edp group too: every rank holding those experts' parameters).
EXPERT_GROUP_NAMES = ("ep", "edp", "expert_replica")
EXPERT_FOLD = ("etp", "ep", "edp")  # fastest first, within a pipeline stage


class LayoutError(ValueError):
    """A parallel layout or layer split that cannot exist; the message is one line."""


def parse_order(order: str) -> tuple[str, ...]:
    """Split an order string such as ``tp-cp-dp-pp`` and check it names each dimension once."""
    dims = tuple(part.strip() for part in order.split("-"))
    if sorted(dims) != sorted(DIMENSIONS):
        raise LayoutError(
            f"parallel.order={order!r} must list each of tp, cp, dp, pp exactly once, joined by '-' "
            f"(fastest-varying first), e.g. {DEFAULT_ORDER!r}"
        )
    return dims


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions, the order in which ranks enumerate them, and the stage placement.

    ``placement`` puts the ``pp * vpp`` global pipeline stages on the pp ranks, ``vpp``
    on each, and says how many model copies they hold (default: looped, one copy).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    order: str = DEFAULT_ORDER
    placement: Placement | None = None
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in (*DIMENSIONS, "vpp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be a positive integer")
        parse_order(self.order)
        if self.placement is None:
            object.__setattr__(self, "placement", looped_placement(self.pp, self.vpp))
        if not isinstance(self.placement, Placement):
            raise LayoutError(f"placement {self.placement!r} must be a Placement")
        problem = self.placement.problem(self.pp, self.vpp)
        if problem is not None:
            raise LayoutError(problem)
        self._check_expert_fold()

    def _check_expert_fold(self) -> None:
        """The expert view exists: each stage's ranks consecutive, and ``etp * ep`` dividing them."""
        if self.ep * self.etp == 1:
            return
        if self.dims[-1] != "pp":
            raise LayoutError(f"parallel.order={self.order!r} must end in pp with parallel.ep={self.ep}: expert groups "
                              "fold each pipeline stage's ranks (etp-ep-edp, as Megatron-Core), which must be "
                              "consecutive")
        if self.stage_ranks % (self.ep * self.etp):
            raise LayoutError(f"parallel.ep={self.ep} * parallel.etp={self.etp} must divide the {self.stage_ranks} "
                              f"ranks of a pipeline stage (tp * cp * dp) it folds over: the experts split over those ranks "
                              f"(e.g. parallel.dp={self.ep * self.etp})")

    @property
    def group_names(self) -> tuple[str, ...]:
        """The kinds of group this layout has: ``GROUP_NAMES``, and with ``ep > 1`` the expert view's."""
        return GROUP_NAMES + EXPERT_GROUP_NAMES if self.ep > 1 else GROUP_NAMES

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage: tp * cp * dp."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: the ranks of a stage holding the same experts."""
        return self.stage_ranks // (self.ep * self.etp)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{etp, ep, edp, pp}`` of a global rank in the expert view."""
        index, pp_rank = rank % self.stage_ranks, self.coords(rank)["pp"]
        return {"etp": index % self.etp, "ep": index // self.etp % self.ep, "edp": index // (self.etp * self.ep),
                "pp": pp_rank}

    def expert_rank(self, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """Global rank of the given expert-view coordinates."""
        return pp * self.stage_ranks + etp + self.etp * (ep + self.ep * edp)

    def _expert_sizes(self) -> dict[str, int]:
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def _expert_group_of(self, name: str, rank: int) -> list[int]:
        coords = self.expert_coords(rank)
        if name == "expert_replica":
            return sorted(member for pp_rank in self.replica_pp_ranks(coords["pp"])
                          for member in self._expert_group_of("edp", self.expert_rank(**{**coords, "pp": pp_rank})))
        return [self.expert_rank(**{**coords, name: index}) for index in range(self._expert_sizes()[name])]

    def _expert_groups(self, name: str) -> list[list[int]]:
        """Every group of an expert-view kind, listed as the dense kinds are (the fixed coordinates fastest first)."""
        if name == "expert_replica" and self.placement.copies == 1:
            name = "edp"
        if name == "expert_replica":
            return [self._expert_group_of(name, self.expert_rank(etp=etp, ep=ep, pp=pp_rank))
                    for pp_rank in self._lead_pp_ranks("replica") for ep in range(self.ep) for etp in range(self.etp)]
        fixed = [dim for dim in (*EXPERT_FOLD, "pp") if dim != name]
        sizes = self._expert_sizes()
        listed = []
        for values in itertools.product(*(range(sizes[dim]) for dim in reversed(fixed))):
            coords = dict(zip(reversed(fixed), values))
            listed.append(self._expert_group_of(name, self.expert_rank(**coords)))
        return listed

    def experts_of(self, rank: int, num_experts: int) -> range:
        """The experts (global ids) of each MoE layer that ``rank`` holds: its ``ep`` coordinate's equal share."""
        per_rank = num_experts // self.ep
        start = self.expert_coords(rank)["ep"] * per_rank
        return range(start, start + per_rank)

    def replica_pp_ranks(self, pp_rank: int) -> list[int]:
        """The pp ranks holding the same model stages as ``pp_rank`` (itself, and DualPipe's mirror rank)."""
        held = self.placement.model_stages_of(pp_rank)
        return [other for other in range(self.pp) if self.placement.model_stages_of(other) == held]

    def tied_pp_ranks(self, pp_rank: int) -> list[int]:
        """The pp ranks whose tied-embedding copies ``pp_rank`` sums with ([] when it holds none).

        With one model copy: the ranks of the first and the last stage. With DualPipe's two
        copies every such rank holds the embedding of one copy and the output layer of the
        other: its tie is local, and the replica group sums the copies.
        """
        embedding_pp_ranks = self.placement.embedding_pp_ranks
        if pp_rank not in embedding_pp_ranks:
            return []
        return [pp_rank] if self.placement.copies > 1 else embedding_pp_ranks

    @property
    def dims(self) -> tuple[str, ...]:
        """Dimension names from fastest-varying to slowest."""
        return parse_order(self.order)

    @property
    def sizes(self) -> dict[str, int]:
        """Size of each dimension, plus ``vpp``."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "vpp": self.vpp}

    @property
    def world_size(self) -> int:
        """Number of ranks: tp * cp * dp * pp."""
        return self.tp * self.cp * self.dp * self.pp

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for dim in self.dims:
            strides[dim] = stride
            stride *= getattr(self, dim)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{tp, cp, dp, pp}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks")
        coords = {}
        for dim in self.dims:
            size = getattr(self, dim)
            coords[dim] = rank % size
            rank //= size
        return {dim: coords[dim] for dim in DIMENSIONS}

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank of the given coordinates."""
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        strides = self._strides()
        for dim, value in coords.items():
            if not 0 <= value < getattr(self, dim):
                raise LayoutError(f"{dim} coordinate {value} is outside 0..{getattr(self, dim) - 1}")
        return sum(value * strides[dim] for dim, value in coords.items())

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` (see ``GROUP_NAMES``), each a sorted-by-construction rank list.

        Within a group ranks are listed with the fastest dimension varying fastest; groups
        are listed in the same way over the dimensions they do not span (Megatron's order).
        """
        if name in EXPERT_GROUP_NAMES:
            return self._expert_groups(self._known_expert_group(name))
        if name == "embedding":
            return [[pp_group[other] for other in self.tied_pp_ranks(pp_rank)]
                    for pp_group in self.groups("pp") for pp_rank in self.placement.embedding_pp_ranks
                    if self.tied_pp_ranks(pp_rank)[0] == pp_rank]
        if name == "replica" and self.placement.copies == 1:
            return self.groups("dp_cp")
        if name == "replica":
            return [self.group_of("replica", self.rank(**coords)) for coords in self._replica_group_leaders()]
        if name not in GROUP_DIMENSIONS:
            raise LayoutError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")
        spanned = [dim for dim in self.dims if dim in GROUP_DIMENSIONS[name]]
        fixed = [dim for dim in self.dims if dim not in GROUP_DIMENSIONS[name]]
        strides = self._strides()
        spanned_offsets = _offsets(spanned, strides, self)
        return [[base + offset for offset in spanned_offsets] for base in _offsets(fixed, strides, self)]

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind ``name`` that contains ``rank`` (``[]`` for a middle stage and ``embedding``)."""
        if name in EXPERT_GROUP_NAMES:
            return self._expert_group_of(self._known_expert_group(name), rank)
        coords = self.coords(rank)
        if name == "embedding":
            pp_group = self.group_of("pp", rank)
            return [pp_group[other] for other in self.tied_pp_ranks(coords["pp"])]
        if name == "replica":
            return sorted(member for pp_rank in self.replica_pp_ranks(coords["pp"])
                          for member in self.group_of("dp_cp", self.rank(**{**coords, "pp": pp_rank})))
        spanned = GROUP_DIMENSIONS[name]
        base = {dim: (0 if dim in spanned else coords[dim]) for dim in DIMENSIONS}
        strides = self._strides()
        start = self.rank(**base)
        spanned_ordered = [dim for dim in self.dims if dim in spanned]
        return [start + offset for offset in _offsets(spanned_ordered, strides, self)]

    def group_size(self, name: str) -> int:
        """The number of ranks in each group of kind ``name`` (the groups of a kind are all alike)."""
        if name in EXPERT_GROUP_NAMES:
            return len(self.group_of(name, 0))
        if name == "embedding":
            return len(self.tied_pp_ranks(self._lead_pp_ranks(name)[0]))
        if name == "replica":
            return self.dp * self.cp * len(self.replica_pp_ranks(0))
        return math.prod(getattr(self, dim) for dim in self._spanned(name))

    def group_count(self, name: str) -> int:
        """How many groups of kind ``name`` there are, without listing them."""
        if name in EXPERT_GROUP_NAMES:
            return self.world_size // self.group_size(name)
        if name == "embedding":
            return self.world_size // self.pp * len(self._lead_pp_ranks(name))
        if name == "replica" and self.placement.copies > 1:
            return self.tp * len(self._lead_pp_ranks(name))
        return self.world_size // self.group_size(name)

    def end_group_ranks(self, name: str) -> tuple[int, int]:
        """A rank of the first and one of the last group of kind ``name``, in ``groups(name)``'s order."""
        if name == "replica" and self.placement.copies == 1:
            name = "dp_cp"
        if name in GROUP_DIMENSIONS or name in ("ep", "edp"):
            return 0, self.world_size - 1
        if name == "expert_replica":
            leads = self._lead_pp_ranks("replica")
            return 0, self.expert_rank(etp=self.etp - 1, ep=self.ep - 1, pp=leads[-1])
        leads = self._lead_pp_ranks(name)
        last = {"tp": self.tp - 1} if name == "replica" else {"tp": self.tp - 1, "cp": self.cp - 1, "dp": self.dp - 1}
        return self.rank(pp=leads[0]), self.rank(**last, pp=leads[-1])

    def iter_group(self, name: str, rank: int, descending: bool = False) -> Iterator[int]:
        """The members of ``rank``'s group of kind ``name`` one by one, ascending (or descending): as
        ``group_of`` lists them, without building the list (a dp group may hold millions of ranks)."""
        coords = self.coords(rank)
        if name == "embedding" or name in EXPERT_GROUP_NAMES:
            members = self.group_of(name, rank)  # one rank per pp rank at most, or one stage's ranks at most
            yield from reversed(members) if descending else members
            return
        if name == "replica":
            groups = [self.iter_group("dp_cp", self.rank(**{**coords, "pp": pp_rank}), descending)
                      for pp_rank in self.replica_pp_ranks(coords["pp"])]
            yield from heapq.merge(*groups, reverse=descending)
            return
        base = self.rank(**{dim: (0 if dim in GROUP_DIMENSIONS[name] else coords[dim]) for dim in DIMENSIONS})
        spanned = [dim for dim in self.dims if dim in GROUP_DIMENSIONS[name]]
        for offset in _iter_offsets(spanned, self._strides(), self, descending):
            yield base + offset

    def _known_expert_group(self, name: str) -> str:
        if self.ep == 1:
            raise LayoutError(f"group {name!r} exists only with expert parallelism (parallel.ep > 1)")
        return name

    def _spanned(self, name: str) -> tuple[str, ...]:
        if name not in GROUP_DIMENSIONS:
            raise LayoutError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")
        return GROUP_DIMENSIONS[name]

    def _lead_pp_ranks(self, name: str) -> list[int]:
        """The pp rank that leads each ``embedding`` or ``replica`` group of one pp group, in order."""
        if name == "embedding":
            return [pp_rank for pp_rank in self.placement.embedding_pp_ranks
                    if self.tied_pp_ranks(pp_rank)[0] == pp_rank]
        if name == "replica":
            return [pp_rank for pp_rank in range(self.pp) if self.replica_pp_ranks(pp_rank)[0] == pp_rank]
        raise LayoutError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")

    def _replica_group_leaders(self) -> list[dict[str, int]]:
        """Coordinates of one rank per replica group: dp = cp = 0, the lowest pp rank of its replicas."""
        return [{"tp": tp, "pp": pp_rank} for pp_rank in range(self.pp) if self.replica_pp_ranks(pp_rank)[0] == pp_rank
                for tp in range(self.tp)]

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group kind -> its list of rank lists."""
        return {name: self.groups(name) for name in self.group_names}

    def layer_map(self, num_layers: int, pipeline_layout: str | None = None) -> dict[tuple[int, int], "StageLayers"]:
        """``{(pp_rank, chunk): StageLayers}``: the model split into stages, placed by this layout."""
        return layer_map(num_layers, self.pp, self.vpp, self.placement, pipeline_layout)


def _offsets(dims: Sequence[str], strides: dict[str, int], layout: ParallelLayout) -> list[int]:
    """Rank offsets spanned by ``dims``, the first dimension varying fastest."""
    ranges = [range(0, getattr(layout, dim) * strides[dim], strides[dim]) for dim in reversed(dims)]
    return [sum(combo) for combo in itertools.product(*ranges)]


def _iter_offsets(dims: Sequence[str], strides: dict[str, int], layout: ParallelLayout,
                  descending: bool = False) -> Iterator[int]:
    """``_offsets`` one at a time (``itertools.product`` would first copy every range into a tuple).

    Ascending, since each dimension's stride exceeds the span of the faster ones; or descending.
    """
    spans = [(getattr(layout, dim), strides[dim]) for dim in reversed(dims)]  # slowest first
    return _walk_offsets(spans, 0, descending)


def _walk_offsets(spans: Sequence[tuple[int, int]], base: int, descending: bool) -> Iterator[int]:
    if not spans:
        yield base
        return
    (size, stride), rest = spans[0], spans[1:]
    for index in (range(size - 1, -1, -1) if descending else range(size)):
        yield from _walk_offsets(rest, base + index * stride, descending)


# ---------------------------------------------------------------------------
# Layer map: split the model into pipeline stages, then place stages on ranks.
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StageLayers:
    """The transformer layers of one pipeline stage and whether it holds the embedding / the loss."""

    stage: int
    layers: tuple[int, ...]
    pre_process: bool
    post_process: bool

    @staticmethod
    def whole(num_layers: int) -> "StageLayers":
        """The one stage of a model run whole in one chunk: every layer, the embedding and the loss."""
        return StageLayers(stage=0, layers=tuple(range(num_layers)), pre_process=True, post_process=True)


_LAYOUT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")  # an innermost group and its repetition: (tt|)*3
_LAYOUT_REPEAT = re.compile(r"([EtL|])\*(\d+)")  # one symbol repeated: t*3
_LAYOUT_LONGEST = 1_000_000  # symbols after expansion: a layout string of a real model is far shorter


def expand_pipeline_layout(text: str) -> str:
    """A layout string with its repetitions written out: ``"E(tt|)*2tL"`` -> ``"Ett|tt|tL"``, ``"t*3"`` -> ``"ttt"``.

    Groups may nest; spaces are ignored. ``LayoutError`` for an unbalanced parenthesis, a group
    without ``*N`` or an expansion beyond any real model's.
    """

    def repeated(match: re.Match) -> str:
        symbols, times = match.group(1), int(match.group(2))
        if len(symbols) * times > _LAYOUT_LONGEST:
            raise LayoutError(f"parallel.pipeline_layout {text!r} expands to more than {_LAYOUT_LONGEST:,} symbols")
        return symbols * times

    expanded, previous = text.replace(" ", ""), None
    while expanded != previous:
        previous, expanded = expanded, _LAYOUT_GROUP.sub(repeated, expanded)
        if len(expanded) > _LAYOUT_LONGEST:
            raise LayoutError(f"parallel.pipeline_layout {text!r} expands to more than {_LAYOUT_LONGEST:,} symbols")
    if "(" in expanded or ")" in expanded:
        raise LayoutError(f"parallel.pipeline_layout {text!r}: unbalanced parentheses, or a group without *N "
                          "(write (tt|)*3)")
    return _LAYOUT_REPEAT.sub(repeated, expanded)


def parse_pipeline_layout(text: str, num_layers: int, num_stages: int) -> list[list[int]]:
    """Parse a Megatron-LM layout string such as ``"Ettt|tttt|tttL"`` or ``"E(tt|)*3ttL"``.

    ``E`` marks the embedding (first stage only), ``L`` the output layer and loss (last
    stage only), ``t`` one transformer layer; ``|`` separates stages; ``X*N`` repeats a
    symbol and ``(...)*N`` a group. A stage may be empty (it passes its input on). Returns
    the global layer ids of each stage. Every layer is placed exactly once, or ``LayoutError``.
    """
    stage_texts = expand_pipeline_layout(text).split("|")
    if len(stage_texts) != num_stages:
        raise LayoutError(
            f"parallel.pipeline_layout has {len(stage_texts)} stages but the layout needs "
            f"{num_stages} (pp * chunks per rank)"
        )
    counts = [_count_layers(stage_text, index, num_stages) for index, stage_text in enumerate(stage_texts)]
    if sum(counts) != num_layers:
        raise LayoutError(
            f"parallel.pipeline_layout places {sum(counts)} transformer layers but model.num_layers={num_layers}"
        )
    return _consecutive_ranges(counts)


def _count_layers(stage_text: str, index: int, num_stages: int) -> int:
    """The transformer layers of one expanded stage; ``E`` and ``L`` checked to be where they may be."""
    unexpected = set(stage_text) - set("EtL")
    if unexpected:
        raise LayoutError(f"parallel.pipeline_layout stage {index} {stage_text!r}: unexpected "
                          f"{sorted(unexpected)[0]!r} (use E, t, L, |, X*N and (...)*N)")
    if "E" in stage_text and index != 0:
        raise LayoutError(f"parallel.pipeline_layout: E (embedding) must be in the first stage, found in stage {index}")
    if "L" in stage_text and index != num_stages - 1:
        raise LayoutError(f"parallel.pipeline_layout: L (loss) must be in the last stage, found in stage {index}")
    if stage_text.count("E") > 1 or stage_text.count("L") > 1:
        raise LayoutError(f"parallel.pipeline_layout stage {index} {stage_text!r}: E and L may appear once each")
    return stage_text.count("t")


def _consecutive_ranges(counts: Iterable[int]) -> list[list[int]]:
    stages, start = [], 0
    for count in counts:
        stages.append(list(range(start, start + count)))
        start += count
    return stages


def even_pipeline_layout(num_layers: int, num_stages: int, embedding_as_layer: bool, loss_as_layer: bool) -> str:
    """The layout string of an even split in which the embedding and/or the output layer with the loss count as
    one transformer layer each (Megatron-LM's ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split``): ``(6, 4, True, True)`` -> ``"Et|tt|tt|tL"``."""
    counted = num_layers + int(embedding_as_layer) + int(loss_as_layer)
    if counted % num_stages:
        raise LayoutError(
            f"model.num_layers={num_layers} with the embedding and the loss counted as layers makes {counted}, "
            f"which must be divisible by the number of pipeline stages {num_stages}")
    counts = [counted // num_stages] * num_stages
    counts[0] -= int(embedding_as_layer)
    counts[-1] -= int(loss_as_layer)
    if min(counts) < 0:
        raise LayoutError(f"model.num_layers={num_layers} is too few for {num_stages} stages with the embedding "
                          "and the loss counted as layers")
    stages = ["t" * count for count in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def split_layers(num_layers: int, num_stages: int, pipeline_layout: str | None = None) -> list[list[int]]:
    """Global layer ids of each of ``num_stages`` stages: even, or from an explicit layout string."""
    if pipeline_layout:
        return parse_pipeline_layout(pipeline_layout, num_layers, num_stages)
    if num_layers % num_stages:
        raise LayoutError(
            f"model.num_layers={num_layers} must be divisible by the number of pipeline stages "
            f"{num_stages} (pp * vpp; pp with dualpipe's two copies), or give parallel.pipeline_layout"
        )
    return _consecutive_ranges([num_layers // num_stages] * num_stages)


def layer_map(
    num_layers: int,
    pp: int,
    chunks_per_rank: int = 1,
    placement: Placement | None = None,
    pipeline_layout: str | None = None,
) -> dict[tuple[int, int], StageLayers]:
    """``{(pp_rank, chunk): StageLayers}``: the split composed with a placement (looped by default).

    ``chunk`` numbers a rank's stages in increasing stage order. With the placement's
    ``copies`` model copies the model is split into ``pp * chunks_per_rank / copies``
    model stages and global stage s runs model stage ``s % stages_per_copy``
    (DualPipe: copy 1 repeats copy 0).
    """
    placement = placement if placement is not None else looped_placement(pp, chunks_per_rank)
    problem = placement.problem(pp, chunks_per_rank)
    if problem is not None:
        raise LayoutError(problem)
    stages_per_copy = placement.stages_per_copy
    stage_layers = split_layers(num_layers, stages_per_copy, pipeline_layout)
    result = {}
    for stage, pp_rank in enumerate(placement):
        model_stage = placement.model_stage(stage)
        result[(pp_rank, placement.chunk_of(stage))] = StageLayers(
            stage=stage,
            layers=tuple(stage_layers[model_stage]),
            pre_process=model_stage == 0,
            post_process=model_stage == stages_per_copy - 1,
        )
    return dict(sorted(result.items()))


# --- context parallelism: which tokens each CP rank holds ----------------------------------

# How attention reaches the other CP ranks' tokens: keys and values all-gathered, passed
# around a ring block by block, or an all-to-all from sequence-split to head-split.
CP_COMM_MODES = ("allgather", "ring", "a2a")


def context_parallel_chunks(cp_rank: int, cp_size: int) -> tuple[int, ...]:
    """The sequence chunks (of ``2 * cp_size`` equal ones) CP rank ``cp_rank`` holds, in order.

    Rank r keeps chunks r and 2*cp-1-r: under a causal mask the early chunk has little
    to attend to and the late one much, so every rank does the same attention work.
    One chunk (0,) when cp_size is 1.
    """
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"cp_rank={cp_rank} out of range for cp_size={cp_size}")
    return (0,) if cp_size == 1 else (cp_rank, 2 * cp_size - 1 - cp_rank)


def context_parallel_slices(seq_length: int, cp_rank: int, cp_size: int) -> tuple[range, ...]:
    """Token positions ``[start, end)`` of the sequence that CP rank ``cp_rank`` holds, in its local order."""
    num_chunks = 1 if cp_size == 1 else 2 * cp_size
    if seq_length % num_chunks:
        raise LayoutError(f"sequence length {seq_length} must be a multiple of 2*cp = {num_chunks}")
    chunk = seq_length // num_chunks
    return tuple(range(index * chunk, (index + 1) * chunk) for index in context_parallel_chunks(cp_rank, cp_size))


def context_parallel_positions(seq_length: int, cp_rank: int, cp_size: int) -> list[int]:
    """The global sequence index of each token CP rank ``cp_rank`` holds, in its local order."""
    return [position for piece in context_parallel_slices(seq_length, cp_rank, cp_size) for position in piece]
