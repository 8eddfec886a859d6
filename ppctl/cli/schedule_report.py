"""What ``ppctl inspect-schedule`` shows: a simulated timeline of the configured schedule, and each rank's activation
memory over it."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable, TypeVar

from dataclasses import dataclass

from ppctl.cli.calibrate import Calibration, calibration_lines, calibration_of
from ppctl.resolve.resolved import ResolvedConfig
from ppctl.pipeline.render import render_plain, render_terminal, simulation_lines, write_timeline
from ppctl.pipeline.schedules import Schedule
from ppctl.pipeline.simulate import SimResult, parse_cost_values, parse_costs, simulate_steps
from ppctl.plan.memory import config_activation_timelines

DEFAULT_COSTS = "F=1,B=1,W=1,comm=0"
# The most actions ``--steps`` may ask to simulate and draw (all ranks, all steps): about 20 s and 0.8 GB for the
# plain grid or the picture on one core (the time grows linearly with the actions)
MAX_TIMELINE_ACTIONS = 1_000_000
SPARK_COLUMNS = 40
SPARK_LEVELS = "▁▂▃▄▅▆▇█"  # a column holding no activations is blank
PLAIN_SPARK_LEVELS = "_.-=+*#@"  # the same, where the timeline is a plain grid

T = TypeVar("T")
ActivationPoints = list[tuple[float, int]]  # (time, bytes held from then on): plan.memory.activation_bytes_over_time


@dataclass
class ScheduleReport:
    """A simulated schedule, with ``--calibrate`` the measured run its costs came from, and each pp rank's activation
    bytes over the simulated time (None where the model's layers do not split into the schedule's stages:
    ``no_activations`` says why)."""

    result: SimResult
    calibration: Calibration | None = None
    activations: list[ActivationPoints] | None = None
    no_activations: str = ""

    def lines(self) -> list[str]:
        """The lines under the timeline."""
        result, calibration = self.result, self.calibration
        extra = [] if calibration is None else calibration_lines(calibration, result.makespan, result.schedule,
                                                                 result.pp)
        return simulation_lines(result) + extra

    def activation_lines(self, plain: bool) -> list[str]:
        """A heading, then per rank its peak activation bytes and a sparkline of them over the simulated time (ASCII
        where ``plain``); or one line saying why there are none; nothing for a bare simulation."""
        if self.activations is None:
            return [f"activation memory: not predicted: {self.no_activations}"] if self.no_activations else []
        return activation_memory_lines(self.activations, self.result.makespan, plain)

    def to_json(self) -> dict:
        """``inspect-schedule --json``: the simulation, each rank's ``activation_bytes`` (its peak) and
        ``activation_bytes_over_time`` (both null where the layers do not split), and ``calibration`` (null without
        ``--calibrate``)."""
        report = self.result.to_json()
        for rank in report["ranks"]:
            points = None if self.activations is None else self.activations[rank["rank"]]
            rank["activation_bytes"] = None if points is None else peak_bytes(points)
            rank["activation_bytes_over_time"] = None if points is None else [list(point) for point in points]
        return {**report, "calibration": None if self.calibration is None else self.calibration.to_json()}


def simulate_config(resolved: ResolvedConfig, cost_text: str | None, steps: int = 1,
                    calibrate: Path | None = None) -> ScheduleReport:
    """Build the configured schedule and replay ``steps`` steps of it (one stream for a schedule that streams
    steps, PipeDream-2BW; else each step after the last) against the costs of ``cost_text``, or those measured
    in the run directory ``calibrate`` with the costs ``cost_text`` names in their place; with each rank's
    activation bytes over the replayed time where the model's layers split into the schedule's stages."""
    schedule = resolved.schedule
    problem = steps_problem(schedule, steps)
    if problem is not None:
        raise ValueError(problem)
    calibration = None
    if calibrate is None:
        result = simulate_steps(schedule, steps, _cost_option(parse_costs, cost_text or DEFAULT_COSTS))
    else:
        given = _cost_option(parse_cost_values, cost_text or "")
        calibration = calibration_of(calibrate, schedule.name).with_overrides(given)
        result = simulate_steps(schedule, steps, calibration.costs)
    if resolved.split_problem is not None:  # inspect-schedule draws schedules whatever the layer split
        return ScheduleReport(result, calibration, no_activations=resolved.split_problem)
    return ScheduleReport(result, calibration, config_activation_timelines(resolved, result))


def parse_steps(text: str) -> int:
    """``--steps``'s value: a whole number of steps, at least 1; ValueError (one line) naming the rule."""
    try:
        steps = int(text)
    except ValueError:
        raise ValueError(f"--steps {text}: not a whole number of steps; give --steps 1 or more") from None
    if steps < 1:
        raise ValueError(f"--steps {text}: simulates at least 1 step; give --steps 1 or more")
    return steps


def steps_problem(schedule: Schedule, steps: int) -> str | None:
    """Why ``steps`` steps of ``schedule`` are too many to simulate and draw (``MAX_TIMELINE_ACTIONS``), or None."""
    per_step = sum(map(len, schedule.actions))
    if steps * per_step <= MAX_TIMELINE_ACTIONS:
        return None
    return (f"--steps {steps}: {steps:,} steps of {schedule.name} at pp={schedule.pp} are {steps * per_step:,} "
            f"actions to simulate and draw, more than {MAX_TIMELINE_ACTIONS:,}; give --steps "
            f"{max(MAX_TIMELINE_ACTIONS // per_step, 1):,} or fewer (the time and bubble per step settle after the "
            "first few)")


def _cost_option(parse: Callable[[str], T], text: str) -> T:
    """``parse(text)`` (``parse_costs`` or ``parse_cost_values``), its refusal naming ``--cost``."""
    try:
        return parse(text)
    except ValueError as error:
        raise ValueError(f"--cost {text}: {error}") from None


def peak_bytes(points: ActivationPoints) -> int:
    """The most bytes of a rank's activation points."""
    return max((held for _, held in points), default=0)


def format_bytes(count: float) -> str:
    """``12.3 MiB``; from 1 GiB on, ``1.50 GiB``."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def column_peaks(points: ActivationPoints, end: float, columns: int) -> list[int]:
    """The most bytes held in each of ``columns`` equal slices of the time from 0 to ``end``."""
    peaks, index, held = [], 0, 0
    for column in range(columns):
        start, stop = end * column / columns, end * (column + 1) / columns
        while index < len(points) and points[index][0] < start:
            held = points[index][1]
            index += 1
        changes_at_start = index < len(points) and points[index][0] <= start
        most = 0 if changes_at_start else held  # a change at the slice's start: what held before does not count
        while index < len(points) and points[index][0] < stop:
            held = points[index][1]
            most = max(most, held)
            index += 1
        peaks.append(most)
    return peaks


def sparkline(points: ActivationPoints, end: float, full: int, levels: str = SPARK_LEVELS,
              columns: int = SPARK_COLUMNS) -> str:
    """The bytes over time in ``columns`` characters, each its slice's most: blank for none, then ``levels`` from
    the lowest to ``full`` bytes."""
    characters = []
    for most in column_peaks(points, end, columns):
        level = math.ceil(most / full * len(levels)) if full > 0 else 0
        characters.append(levels[min(level, len(levels)) - 1] if level > 0 else " ")
    return "".join(characters).rstrip()


def activation_memory_lines(activations: list[ActivationPoints], end: float, plain: bool) -> list[str]:
    """A heading, then per rank ``  rank 0  12.3 MiB  ▁▃▅▇█▇▅▃▁`` (indented: no timeline row): its peak and its bytes
    over the time from 0 to ``end``, every rank's sparkline on one scale (a full column: the highest peak)."""
    levels = PLAIN_SPARK_LEVELS if plain else SPARK_LEVELS
    peaks = [peak_bytes(points) for points in activations]
    full = max(peaks, default=0)
    labels = [f"  rank {pp_rank}" for pp_rank in range(len(activations))]
    values = [format_bytes(peak) for peak in peaks]
    label_width = max(map(len, labels), default=0) + 2
    value_width = max(map(len, values), default=0) + 2
    heading = (f"activation memory per rank (what its microbatches in flight keep): peak, then over time 0 to "
               f"{end:.4g} ({SPARK_COLUMNS} columns, each its most; '{levels[-1]}' = {format_bytes(full)})")
    return [heading] + [label.ljust(label_width) + value.ljust(value_width) + sparkline(points, end, full, levels)
                        for label, value, points in zip(labels, values, activations)]


def _title(result: SimResult) -> str:
    return f"{result.schedule}: simulated step" + (f"s (the {result.steps} steps)" if result.steps > 1 else "")


def write_schedule_picture(report: ScheduleReport, path: Path) -> None:
    """The timeline as a picture (``.svg`` or ``.html``), a band under each rank's row its activation memory."""
    write_timeline(report.result.ranks, path, _title(report.result), report.lines(), memory=report.activations)


def print_schedule(report: ScheduleReport | SimResult, picture: Path | None) -> None:
    """The timeline, then bubble ratio, peak activations and the activation memory per rank: coloured cells on a
    terminal, else a plain grid of labelled cells (a pipe or a log has no colours to tell the actions apart)."""
    if isinstance(report, SimResult):
        report = ScheduleReport(report)
    result = report.result
    if not sys.stdout.isatty():
        lines = report.lines() + report.activation_lines(plain=True)
        lines += [f"timeline written to {picture}"] if picture is not None else []
        sys.stdout.write(render_plain(result.ranks, _title(result)) + "".join(line + "\n" for line in lines))
        return
    from rich.console import Console
    from rich.text import Text

    console = Console()
    render_terminal(result.ranks, console, title=_title(result))
    for line in report.lines():
        console.print(line)
    for line in report.activation_lines(plain=False):
        console.print(Text(line))
    if picture is not None:
        console.print(f"timeline written to {picture}")
