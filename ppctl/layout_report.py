"""What ``ppctl inspect-layout`` reports: the layout as one JSON-able object, and its rich tables."""

from __future__ import annotations

from ppctl.config import PpctlConfig, config_layer_map, layout_of, padded_vocab_size
from ppctl.parallel.layout import GROUP_NAMES

MAX_TABLE_GROUPS = 8
MAX_TABLE_RANKS = 64


def layout_report(config: PpctlConfig) -> dict:
    """The ``--json`` contract: world_size, order, sizes, groups, ranks, layers."""
    layout = layout_of(config)
    ranks = [{"rank": rank, **layout.coords(rank)} for rank in range(layout.world_size)]
    layers = [
        {"pp_rank": pp_rank, "vp_stage": chunk, "layers": list(stage.layers),
         "pre_process": stage.pre_process, "post_process": stage.post_process}
        for (pp_rank, chunk), stage in config_layer_map(config).items()
    ]
    return {
        "world_size": layout.world_size,
        "order": layout.order,
        "sizes": {name: layout.sizes[name] for name in ("tp", "cp", "dp", "pp", "vpp")},
        "groups": layout.all_groups(),
        "ranks": ranks,
        "layers": layers,
    }


def print_layout(report: dict, config: PpctlConfig) -> None:
    """Readable tables: sizes, groups, rank coordinates and the layer map."""
    from rich.console import Console

    console = Console()
    sizes = report["sizes"]
    vocab = padded_vocab_size(config.model.vocab_size, config.model.make_vocab_size_divisible_by, sizes["tp"])
    console.print(
        f"[bold]{report['world_size']} ranks[/]  order {report['order']} (fastest first)  "
        + "  ".join(f"{name}={value}" for name, value in sizes.items())
        + f"  vocab {config.model.vocab_size} -> padded {vocab}"
    )
    console.print(_groups_table(report))
    if report["world_size"] <= MAX_TABLE_RANKS:
        console.print(_ranks_table(report))
    console.print(_layers_table(report))


def _groups_table(report: dict):
    from rich.table import Table

    table = Table(title="process groups")
    table.add_column("group")
    table.add_column("count", justify="right")
    table.add_column("ranks")
    for name in GROUP_NAMES:
        groups = report["groups"][name]
        shown = " ".join(str(group) for group in groups[:MAX_TABLE_GROUPS])
        if len(groups) > MAX_TABLE_GROUPS:
            shown += f" ... {len(groups) - MAX_TABLE_GROUPS} more"
        table.add_row(name, str(len(groups)), shown)
    return table


def _ranks_table(report: dict):
    from rich.table import Table

    table = Table(title="rank coordinates")
    for column in ("rank", "tp", "cp", "dp", "pp"):
        table.add_column(column, justify="right")
    for entry in report["ranks"]:
        table.add_row(*(str(entry[key]) for key in ("rank", "tp", "cp", "dp", "pp")))
    return table


def _layers_table(report: dict):
    from rich.table import Table

    table = Table(title="layer map (global layer ids, 0-based)")
    for column in ("pp rank", "vp stage", "layers", "holds"):
        table.add_column(column)
    for entry in report["layers"]:
        layers = entry["layers"]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 2 else ", ".join(map(str, layers)) or "-"
        holds = " ".join(label for label, flag in (("[cyan]embedding[/]", entry["pre_process"]),
                                                    ("[magenta]loss[/]", entry["post_process"])) if flag)
        table.add_row(str(entry["pp_rank"]), str(entry["vp_stage"]), span, holds)
    return table
