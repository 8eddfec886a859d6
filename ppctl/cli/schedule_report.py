"""What ``ppctl inspect-schedule`` shows: a simulated timeline of the configured schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from dataclasses import dataclass

from ppctl.cli.calibrate import Calibration, calibration_lines, calibration_of
from ppctl.config import PpctlConfig, configured_schedule
from ppctl.pipeline.render import render_plain, render_terminal, simulation_lines, write_timeline
from ppctl.pipeline.simulate import SimResult, parse_cost_values, parse_costs, simulate_steps

DEFAULT_COSTS = "F=1,B=1,W=1,comm=0"


@dataclass
class ScheduleReport:
    """A simulated schedule and, with ``--calibrate``, the measured run its costs came from."""

    result: SimResult
    calibration: Calibration | None = None

    def lines(self) -> list[str]:
        """The lines under the timeline."""
        result, calibration = self.result, self.calibration
        extra = [] if calibration is None else calibration_lines(calibration, result.makespan, result.schedule,
                                                                 result.pp)
        return simulation_lines(result) + extra

    def to_json(self) -> dict:
        """``inspect-schedule --json``: the simulation, and ``calibration`` (null without ``--calibrate``)."""
        return {**self.result.to_json(),
                "calibration": None if self.calibration is None else self.calibration.to_json()}


def simulate_config(config: PpctlConfig, cost_text: str | None, steps: int = 1,
                    calibrate: Path | None = None) -> ScheduleReport:
    """Build the configured schedule and replay ``steps`` steps of it (one stream for a schedule that streams
    steps, PipeDream-2BW; else each step after the last) against the costs of ``cost_text``, or those measured
    in the run directory ``calibrate`` with the costs ``cost_text`` names in their place."""
    schedule = configured_schedule(config)
    if calibrate is None:
        return ScheduleReport(simulate_steps(schedule, steps, parse_costs(cost_text or DEFAULT_COSTS)))
    calibration = calibration_of(calibrate, schedule.name).with_overrides(parse_cost_values(cost_text or ""))
    return ScheduleReport(simulate_steps(schedule, steps, calibration.costs), calibration)


def _title(result: SimResult) -> str:
    return f"{result.schedule}: simulated step" + (f"s (the {result.steps} steps)" if result.steps > 1 else "")


def write_schedule_picture(report: ScheduleReport, path: Path) -> None:
    """The timeline as a picture (``.svg`` or ``.html``)."""
    write_timeline(report.result.ranks, path, _title(report.result), report.lines())


def print_schedule(report: ScheduleReport | SimResult, picture: Path | None) -> None:
    """The timeline, then bubble ratio and peak activations: coloured cells on a terminal, else a plain grid of
    labelled cells (a pipe or a log has no colours to tell the actions apart)."""
    if isinstance(report, SimResult):
        report = ScheduleReport(report)
    result = report.result
    if not sys.stdout.isatty():
        lines = report.lines() + ([f"timeline written to {picture}"] if picture is not None else [])
        sys.stdout.write(render_plain(result.ranks, _title(result)) + "".join(line + "\n" for line in lines))
        return
    from rich.console import Console

    console = Console()
    render_terminal(result.ranks, console, title=_title(result))
    for line in report.lines():
        console.print(line)
    if picture is not None:
        console.print(f"timeline written to {picture}")
