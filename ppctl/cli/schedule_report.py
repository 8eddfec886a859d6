"""What ``ppctl inspect-schedule`` shows: a simulated timeline of the configured schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from ppctl.config import PpctlConfig, configured_schedule
from ppctl.pipeline.render import render_plain, render_terminal, simulation_lines, write_timeline
from ppctl.pipeline.simulate import SimResult, parse_costs, simulate_steps


def simulate_config(config: PpctlConfig, cost_text: str, steps: int = 1) -> SimResult:
    """Build the configured schedule and replay ``steps`` steps of it against the cost model ``cost_text``
    (one stream for a schedule that streams steps, PipeDream-2BW; else each step after the last)."""
    return simulate_steps(configured_schedule(config), steps, parse_costs(cost_text))


def _title(result: SimResult) -> str:
    return f"{result.schedule}: simulated step" + (f"s (the {result.steps} steps)" if result.steps > 1 else "")


def write_schedule_picture(result: SimResult, path: Path) -> None:
    """The timeline as a picture (``.svg`` or ``.html``)."""
    write_timeline(result.ranks, path, _title(result), simulation_lines(result))


def print_schedule(result: SimResult, picture: Path | None) -> None:
    """The timeline, then bubble ratio and peak activations: coloured cells on a terminal, else a plain grid of
    labelled cells (a pipe or a log has no colours to tell the actions apart)."""
    if not sys.stdout.isatty():
        lines = simulation_lines(result) + ([f"timeline written to {picture}"] if picture is not None else [])
        sys.stdout.write(render_plain(result.ranks, _title(result)) + "".join(line + "\n" for line in lines))
        return
    from rich.console import Console

    console = Console()
    render_terminal(result.ranks, console, title=_title(result))
    for line in simulation_lines(result):
        console.print(line)
    if picture is not None:
        console.print(f"timeline written to {picture}")
