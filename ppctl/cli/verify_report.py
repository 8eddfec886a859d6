"""``ppctl verify``'s output: the table of quantities against their tolerances, and its ``--json`` object."""

from __future__ import annotations

from pathlib import Path

from ppctl.verify.compare import Verdict


def verdict_json(verdict: Verdict, run_dirs: dict[str, Path], shrunk: list[str], replaced: tuple[str, ...]) -> dict:
    """The ``--json`` contract: equal, rows (quantity, worst, tolerance, where, equal), worst_parameter, the run
    directories, what ``--shrink`` changed and the user's overrides verify set itself."""
    worst = verdict.worst_parameter
    return {"equal": verdict.equal,
            "rows": [{"quantity": row.quantity, "worst": row.worst, "tolerance": row.tolerance, "where": row.where,
                      "equal": row.equal} for row in verdict.rows],
            "worst_parameter": None if worst is None else {"name": worst.name, "difference": worst.difference,
                                                           "bound": worst.bound},
            "run_dirs": {name: str(path) for name, path in run_dirs.items()},
            "shrunk": shrunk, "replaced": list(replaced)}


def print_verdict(verdict: Verdict, run_dirs: dict[str, Path], shrunk: list[str], replaced: tuple[str, ...]) -> None:
    """The table, the parameter that differs most, and the verdict's line."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for line in shrunk:
        console.print(f"shrunk: {line}", soft_wrap=True)
    if replaced:
        console.print(f"set by verify instead: {' '.join(replaced)}", soft_wrap=True)
    table = Table(title="against one process")
    for column in ("quantity", "worst difference", "tolerance", "where", "verdict"):
        table.add_column(column)
    for row in verdict.rows:
        table.add_row(row.quantity, f"{row.worst:.3g}", f"{row.tolerance:.3g}", row.where,
                      "equal" if row.equal else "[bold red]DIFFERS[/]")
    console.print(table)
    console.print("parameters: each one's largest element difference over the bound AdamW's steps allow it "
                  "(docs/verify.md)", soft_wrap=True)
    worst = verdict.worst_parameter
    if worst is not None:
        console.print(f"parameter that differs most: {worst.name}: {worst.difference:.3g} (bound {worst.bound:.3g})",
                      soft_wrap=True)
    console.print(f"runs: {run_dirs['parallel']} against {run_dirs['single']}", soft_wrap=True)
    differing = [row.quantity for row in verdict.rows if not row.equal]
    console.print("equal to one process" if not differing else
                  f"[bold red]differs from one process[/]: {', '.join(differing)}", soft_wrap=True)
