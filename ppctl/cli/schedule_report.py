"""What ``ppctl inspect-schedule`` shows: a simulated timeline of the configured schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from ppctl.config import PpctlConfig, configured_schedule
from ppctl.config.derived import num_microbatches, schedule_specs
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.render import render_plain, render_terminal, simulation_lines, write_timeline
from ppctl.pipeline.simulate import SimResult, parse_costs, simulate, simulate_steps


def simulate_config(config: PpctlConfig, cost_text: str, steps: int = 1) -> SimResult:
    """Build the configured schedule and replay ``steps`` steps of it against the cost model ``cost_text``
    (one stream for a schedule that streams steps, PipeDream-2BW; else each step after the last)."""
    costs = parse_costs(cost_text)
    streams = schedule_specs()[config.schedule.name].streams_steps
    if steps == 1 and not streams:
        return simulate(configured_schedule(config), costs)
    parallel = config.parallel
    return simulate_steps(lambda microbatches: build_schedule(config.schedule.name, parallel.pp, parallel.vpp,
                                                              microbatches)
                          if streams else configured_schedule(config),
                          num_microbatches(config), steps, streams, costs)


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
