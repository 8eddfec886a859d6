"""What ``ppctl inspect-layout`` reports: the layout as one JSON-able object, and its rich tables.

Every rank carries its predicted memory by part (``ppctl.plan.memory``; the same on every
rank of one pp rank). Up to ``MAX_LISTED_RANKS`` ranks the report lists every group and every rank. Beyond, it
summarises them (counts, sizes, the first and the last group and ranks), computed without
enumerating the world, so any size takes the same few milliseconds and little memory.
"""

from __future__ import annotations

import functools
import itertools

from ppctl.config import PpctlConfig, message_seq_length, schedule_spec
from ppctl.resolve.resolved import ResolvedConfig, stage_counts
from ppctl.parallel.layout import ParallelLayout, context_parallel_slices
from ppctl.plan.balance import balance_summary, layout_string
from ppctl.plan.memory import config_memory

MAX_TABLE_GROUPS = 8
MAX_TABLE_RANKS = 64
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")
MAX_LISTED_RANKS = 16_384  # beyond this world size, groups and ranks are summarised
SUMMARY_RANKS = 4  # rank entries shown at each end of a summarised world
SUMMARY_MEMBERS = 16  # ranks shown at each end of a summarised group


def local_span(pieces: tuple[range, ...], start: int, stop: int) -> list[list[int]]:
    """The ``[start, end)`` runs of sequence positions at local indices ``[start, stop)`` of the pieces laid end to end."""
    runs, offset = [], 0
    for piece in pieces:
        low, high = max(start - offset, 0), min(stop - offset, len(piece))
        if low < high and runs and runs[-1][1] == piece[low]:
            runs[-1][1] = piece[high - 1] + 1  # adjacent chunks (the middle CP rank's) read as one run
        elif low < high:
            runs.append([piece[low], piece[high - 1] + 1])
        offset += len(piece)
    return runs


def sequence_report(config: PpctlConfig, cp_rank: int, tp_rank: int) -> dict:
    """The tokens of each sequence one rank holds: in attention (its CP slice) and between blocks (SP's share)."""
    parallel = config.parallel
    pieces = context_parallel_slices(config.trainer.seq_length, cp_rank, parallel.cp)
    local = sum(len(piece) for piece in pieces)
    share = message_seq_length(config)
    start = tp_rank * share if parallel.sequence_parallel else 0
    return {"tokens": local_span(pieces, 0, local), "residual_tokens": local_span(pieces, start, start + share)}


def layout_report(resolved: ResolvedConfig) -> dict:
    """The ``--json`` contract: world_size, order, sizes, sequence, groups, ranks, pipeline_layout, layers (groups
    and ranks summarised beyond ``MAX_LISTED_RANKS`` ranks). ``pipeline_layout`` is the split in use written out
    stage by stage (the even split's too): ``parallel.pipeline_layout`` expanded, the even split, or the one
    ``parallel.balance=auto`` chose."""
    config, layout = resolved.config, resolved.layout
    memory = [parts.to_json() for parts in config_memory(resolved)]
    if layout.world_size > MAX_LISTED_RANKS:
        groups, ranks = summarised_groups(layout), summarised_ranks(layout, config, memory)
    else:
        groups, ranks = layout.all_groups(), listed_ranks(layout, config, memory)
    placement = layout.placement
    layers = [
        {"pp_rank": pp_rank, "vp_stage": chunk, "stage": stage.stage, "copy": placement.copy_of(stage.stage),
         "layers": list(stage.layers), "pre_process": stage.pre_process, "post_process": stage.post_process}
        for (pp_rank, chunk), stage in resolved.layer_map.items()
    ]
    return {
        "world_size": layout.world_size,
        "order": layout.order,
        "sizes": {name: layout.sizes[name] for name in ("tp", "cp", "dp", "pp", "vpp")},
        "experts": experts_report(resolved),
        "placement": {"stages": list(placement.owners), "copies": placement.copies,
                      "describe": schedule_spec(config).placement_name},
        "sequence": {"seq_length": config.trainer.seq_length, "cp_comm": config.parallel.cp_comm,
                     "sequence_parallel": config.parallel.sequence_parallel,
                     "message_tokens": message_seq_length(config)},
        "groups": groups,
        "ranks": ranks,
        "pipeline_layout": layout_string(stage_counts(resolved)),
        "layers": layers,
    }


def experts_report(resolved: ResolvedConfig) -> dict | None:
    """The expert view of an MoE model (None for a dense one): the experts per MoE layer, which layers route, and the
    fold's sizes (``ep``, ``etp``, ``edp``: each rank holds ``num_experts / ep`` consecutive experts)."""
    moe, layout = resolved.model.moe, resolved.layout
    if moe is None:
        return None
    return {"num_experts": moe.num_experts, "topk": moe.topk,
            "moe_layers": list(moe.layer_ids(resolved.config.model.num_layers)), "ep": layout.ep, "etp": layout.etp,
            "edp": layout.edp, "per_rank": moe.num_experts // layout.ep}


def is_summarised(report: dict) -> bool:
    """Whether a report summarises its groups and ranks (its ``ranks`` is then an object, not a list)."""
    return isinstance(report["ranks"], dict)


def rank_entry(layout: ParallelLayout, config: PpctlConfig, rank: int, sequences: dict, memory: list[dict]) -> dict:
    """One entry of ``ranks``: the rank, its coordinates, the tokens it holds (``sequences`` memoises those) and
    its predicted ``memory`` by part (``memory``: per pp rank)."""
    coords = layout.coords(rank)
    key = coords["cp"], coords["tp"]
    if key not in sequences:
        sequences[key] = sequence_report(config, *key)
    entry = {"rank": rank, **coords, **sequences[key], "memory": memory[coords["pp"]]}
    if config.model.moe.num_experts:
        expert = layout.expert_coords(rank)
        held = layout.experts_of(rank, config.model.moe.num_experts)
        entry["expert"] = {"ep": expert["ep"], "edp": expert["edp"], "experts": [held.start, held.stop]}
    return entry


def listed_ranks(layout: ParallelLayout, config: PpctlConfig, memory: list[dict]) -> list[dict]:
    """Every rank's entry."""
    sequences: dict = {}
    return [rank_entry(layout, config, rank, sequences, memory) for rank in range(layout.world_size)]


def summarised_ranks(layout: ParallelLayout, config: PpctlConfig, memory: list[dict]) -> dict:
    """``{count, first, last}``: the number of ranks and the entries of the first and the last few."""
    sequences: dict = {}
    world = layout.world_size
    entry = functools.partial(rank_entry, layout, config, sequences=sequences, memory=memory)
    return {"count": world, "first": [entry(rank) for rank in range(SUMMARY_RANKS)],
            "last": [entry(rank) for rank in range(world - SUMMARY_RANKS, world)]}


def summarised_groups(layout: ParallelLayout) -> dict:
    """Group name -> ``{count, size, first, last}``: how many groups, their size, and the first and the last
    group, each as ``{head, tail}`` (its first ranks, and its last ones when it has more than fit in head)."""
    summary = {}
    for name in layout.group_names:
        first, last = layout.end_group_ranks(name)
        size = layout.group_size(name)
        summary[name] = {"count": layout.group_count(name), "size": size,
                         "first": group_ends(layout, name, first, size), "last": group_ends(layout, name, last, size)}
    return summary


def group_ends(layout: ParallelLayout, name: str, rank: int, size: int) -> dict:
    """``{head, tail}`` of ``rank``'s group: its first ``SUMMARY_MEMBERS`` ranks, then up to as many last ones."""
    head = list(itertools.islice(layout.iter_group(name, rank), SUMMARY_MEMBERS))
    tail_size = min(SUMMARY_MEMBERS, size - len(head))
    tail = list(itertools.islice(layout.iter_group(name, rank, descending=True), tail_size))
    return {"head": head, "tail": tail[::-1]}


def print_layout(report: dict, resolved: ResolvedConfig) -> None:
    """Readable tables: sizes, groups, rank coordinates and the layer map."""
    from rich.console import Console

    console = Console()
    sizes, config = report["sizes"], resolved.config
    vocab = resolved.model.padded_vocab_size
    console.print(
        f"[bold]{report['world_size']} ranks[/]  order {report['order']} (fastest first)  "
        + "  ".join(f"{name}={value}" for name, value in sizes.items())
        + f"  vocab {config.model.vocab_size} -> padded {vocab}"
    )
    sequence = report["sequence"]
    console.print(f"sequence {sequence['seq_length']} tokens  cp={sizes['cp']} (attention: {sequence['cp_comm']})  "
                  f"sequence_parallel={sequence['sequence_parallel']}")
    console.print(f"{sequence['message_tokens']} tokens of each sequence per pipeline message")
    if report["experts"] is not None:
        console.print(experts_text(report["experts"]))
    placement = report["placement"]
    copies = f"; {placement['copies']} parameter copies" if placement["copies"] > 1 else ""
    console.print(f"placement ({config.schedule.name}): {placement['describe']}{copies}")
    console.print(pipeline_layout_text(report, resolved), soft_wrap=True)
    if is_summarised(report):
        console.print(f"more than {MAX_LISTED_RANKS:,} ranks: each group kind is summarised by its count, its size "
                      f"and its first and last group")
        console.print(_summarised_groups_table(report))
    else:
        console.print(_groups_table(report))
    if report["world_size"] <= MAX_TABLE_RANKS:
        console.print(_ranks_table(report))
    console.print(_layers_table(report))


def experts_text(experts: dict) -> str:
    """``experts: 8 per MoE layer (layers 0-3), top-2; ep=2 etp=1 edp=2: each rank holds 4 ...``."""
    layers = experts["moe_layers"]
    span = f"{layers[0]}-{layers[-1]}" if len(layers) > 2 else ", ".join(map(str, layers))
    folded = (f"; ep={experts['ep']} etp={experts['etp']} edp={experts['edp']} (expert ranks folded etp-ep-edp in "
              f"each stage): each rank holds {experts['per_rank']} consecutive experts, the ep groups exchange tokens "
              f"and the edp groups reduce the experts' gradients") if experts["ep"] > 1 else \
        "; ep=1: every rank holding a layer holds all its experts"
    return f"experts: {experts['num_experts']} per MoE layer (layers {span}), top-{experts['topk']}{folded}"


def pipeline_layout_text(report: dict, resolved: ResolvedConfig) -> str:
    """``pipeline layout: Ett|ttt|ttt|ttL``, and with ``parallel.balance=auto`` the slowest rank's predicted work
    per microbatch beside the even split's."""
    text = f"pipeline layout: {report['pipeline_layout']}"
    if resolved.config.parallel.balance != "auto":
        return text
    summary = balance_summary(resolved, stage_counts(resolved))
    return (f"{text} (balance=auto: the slowest rank's predicted work {flop_text(summary.slowest_flops)} per "
            f"microbatch, {flop_text(summary.even_slowest_flops)} with the even split {summary.even_layout})")


def flop_text(flops: float) -> str:
    """``1.23 GFLOP``: FLOPs with the largest SI prefix below them."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOP"


def _groups_table(report: dict):
    from rich.table import Table

    table = Table(title="process groups")
    table.add_column("group")
    table.add_column("count", justify="right")
    table.add_column("ranks")
    for name, groups in report["groups"].items():
        shown = " ".join(str(group) for group in groups[:MAX_TABLE_GROUPS])
        if len(groups) > MAX_TABLE_GROUPS:
            shown += f" ... {len(groups) - MAX_TABLE_GROUPS} more"
        table.add_row(name, str(len(groups)), shown)
    return table


def _summarised_groups_table(report: dict):
    from rich.table import Table

    table = Table(title="process groups (summarised)")
    table.add_column("group")
    table.add_column("count", justify="right")
    table.add_column("size", justify="right")
    table.add_column("first group ... last group")
    for name, summary in report["groups"].items():
        ends = f"{_ends_text(summary['first'], summary['size'])} ... {_ends_text(summary['last'], summary['size'])}"
        table.add_row(name, f"{summary['count']:,}", f"{summary['size']:,}", ends)
    return table


def _ends_text(ends: dict, size: int, shown: int = 4) -> str:
    """A summarised group of ``size`` ranks in a table cell: ``[0, 1, 2]``, or ``[0, 1, 2, 3, ..., 96, 97, 98, 99]``."""
    members = ends["head"] + ends["tail"]
    if size <= 2 * shown:
        return str(members)
    return "[" + ", ".join(map(str, members[:shown])) + ", ..., " + ", ".join(map(str, members[-shown:])) + "]"


def _ranks_table(report: dict):
    from rich.table import Table

    experts = report["experts"] is not None
    split = experts and report["experts"]["ep"] > 1
    table = Table(title="rank coordinates",
                  caption="memory: predicted MiB, total (parameters + gradients + optimizer + activations + buffers)"
                  + ("; the parameters hold the rank's own experts, the activations the mean of its ep group's routed "
                     "rows" if split else ""))
    for column in ("rank", "tp", "cp", "dp", "pp", *(("ep", "edp", "experts") if experts else ())):
        table.add_column(column, justify="right")
    table.add_column("tokens (attention)")
    table.add_column("tokens (norms, residual)")
    table.add_column("memory MiB")
    for entry in report["ranks"]:
        expert = entry.get("expert")
        held = (str(expert["ep"]), str(expert["edp"]), _ranges_text([expert["experts"]])) if experts else ()
        table.add_row(*(str(entry[key]) for key in ("rank", "tp", "cp", "dp", "pp")), *held,
                      _ranges_text(entry["tokens"]), _ranges_text(entry["residual_tokens"]),
                      memory_text(entry["memory"]))
    return table


def memory_text(memory: dict) -> str:
    """``12.3 (1.0 + 1.0 + 2.0 + 7.9 + 0.4)``: a rank's predicted MiB, in total and by part."""
    parts = " + ".join(f"{memory[part] / 2**20:.1f}" for part in MEMORY_PARTS)
    return f"{memory['total'] / 2**20:.1f} ({parts})"


def _ranges_text(ranges: list[list[int]]) -> str:
    return " ".join(f"{start}-{end - 1}" for start, end in ranges)


def _layers_table(report: dict):
    from rich.table import Table

    table = Table(title="layer map (global layer ids, 0-based)")
    copies = report["placement"]["copies"] > 1
    for column in ("pp rank", "vp stage", "stage", *(("copy",) if copies else ()), "layers", "holds"):
        table.add_column(column)
    for entry in report["layers"]:
        layers = entry["layers"]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 2 else ", ".join(map(str, layers)) or "-"
        holds = " ".join(label for label, flag in (("[cyan]embedding[/]", entry["pre_process"]),
                                                    ("[magenta]loss[/]", entry["post_process"])) if flag)
        copy = (str(entry["copy"]),) if copies else ()
        table.add_row(str(entry["pp_rank"]), str(entry["vp_stage"]), str(entry["stage"]), *copy, span, holds)
    return table
