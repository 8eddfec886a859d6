"""Draw pipeline timelines: in the terminal (rich) and as a standalone SVG or HTML page.

The renderers take a generic timeline, a list of ``RankTimeline``: the simulator
produces one, and a measured run produces the same type from real timestamps (with
optional ``waits`` intervals, drawn hatched as "waiting for communication"). Colours:
forwards in blues, backwards (B or unsplit BW) in oranges, weight-gradient W in
purples; a rank's chunks are told apart by shade (chunk 0 darkest). An overlapped
forward-backward pair (both halves carry one ``pair`` number) is drawn as one box: in
the terminal one label ``f+b`` across both halves, in the SVG a dark outline around them.
Where there is no terminal (a log, a pipe), ``render_plain`` gives a grid of labelled cells
(``F3``, ``B3``, ``W3``, ``BW3``; ``F3.1`` on chunk 1) in fixed-width columns instead.
"""

from __future__ import annotations

import bisect
import collections
import errno
import math
import os
from pathlib import Path
from typing import Optional, Sequence
from xml.sax.saxutils import escape

from rich.console import Console
from rich.text import Text

from .schedules.base import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from .simulate import RankTimeline, SimResult, TimedAction

# Shades per kind, chunk 0 first (then cycling): dark to light.
PALETTES = {
    FORWARD: ("#1f5fa8", "#4a86c8", "#7eaadb", "#b0cdea"),
    BACKWARD_INPUT: ("#c4580a", "#e67e22", "#f0a35e", "#f7c99b"),
    BACKWARD: ("#c4580a", "#e67e22", "#f0a35e", "#f7c99b"),
    BACKWARD_WEIGHT: ("#6a3d9a", "#8e63b8", "#b394d3", "#d5c4e8"),
}
KIND_NAMES = {FORWARD: "forward", BACKWARD_INPUT: "backward (input grad)",
              BACKWARD_WEIGHT: "backward (weight grad)", BACKWARD: "backward"}
WAIT_COLOUR = "#9aa0a6"
MEMORY_COLOUR = "#7cb342"
PAIR_OUTLINE = "#202124"
SUPPORTED_SUFFIXES = (".svg", ".html")
MemoryPoints = Sequence[tuple[float, int]]  # (time, bytes held from then on): a rank's activation memory over time


def action_colour(kind: str, chunk: int) -> str:
    """Fill colour of an action of ``kind`` on local chunk ``chunk``."""
    palette = PALETTES.get(kind, ("#777777",))
    return palette[chunk % len(palette)]


def text_colour(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (``#rrggbb``)."""
    red, green, blue = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#ffffff"


def lighten(fill: str, amount: float) -> str:
    """``fill`` (``#rrggbb``) mixed with white by ``amount`` (0 keeps it, 1 gives white)."""
    channels = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in channels)


def chunk_indices(timeline: RankTimeline) -> dict[int, int]:
    """Stage -> local chunk index on this rank (its position among the rank's stages)."""
    return {stage: index for index, stage in enumerate(sorted({a.stage for a in timeline.actions}))}


def timeline_end(ranks: Sequence[RankTimeline]) -> float:
    """The latest end of any action or wait in ``ranks`` (0.0 when empty)."""
    ends = [a.end for r in ranks for a in r.actions] + [end for r in ranks for _, end in r.waits]
    return max(ends, default=0.0)


def simulation_lines(result: SimResult) -> list[str]:
    """Subtitle lines describing a simulation: sizes, costs, makespan, bubble, peak activations, parameters."""
    costs = result.costs
    overlapped = "" if costs.FB is None else f" FB={_number(costs.FB)}"
    exchange = "" if not costs.A2A else f" A2A={_number(costs.A2A)}"
    return [
        f"pp={result.pp} · vpp={result.vpp} · microbatches={result.num_microbatches} · "
        f"costs F={_number(costs.F)} B={_number(costs.B)} W={_number(costs.W)}{overlapped}{exchange} "
        f"comm={_number(costs.comm)}",
        f"makespan {_number(result.makespan)} · bubble ratio {result.bubble_ratio:.1%}",
        *_exposed_line(result),
        *_steps_line(result),
        _idle_line(result),
        *_fill_line(result),
        _peaks_line(result.ranks),
        _parameters_line(result),
    ]


def _exposed_line(result: SimResult) -> list[str]:
    """With an all-to-all cost: each rank's all-to-all time not hidden behind compute."""
    if not result.costs.A2A:
        return []
    exposed = " ".join(_number(time) for time in result.exposed_exchanges())
    lines = [f"exposed all-to-all per rank: {exposed} (of {_number(result.costs.A2A)} per microbatch each way)"]
    split = result.pair_split()
    if split:
        pieces = " ".join(f"{half}{index}" for half, index in split)
        lines.append(f"overlapped pairs interleaved (parallel.overlap_ep_comm): each half cut by its "
                     f"{int(result.costs.A2A_SPLIT)} exchange(s) per chunk (A2A_SPLIT), one piece at a time: {pieces}")
    fills = _fills_per_rank(result)
    if fills:
        lines.append(f"weight fills (parallel.overlap_ep_comm; B&W in the schedule): {fills} per rank; each W "
                     f"computes in its backward's all-to-all waits")
    return lines


def _fills_per_rank(result: SimResult) -> str:
    """Each rank's count of weight fills, or "" without any (``Schedule.with_weight_fills``)."""
    schedule = result.program.schedule if result.program is not None else None
    if schedule is None or not schedule.filled:
        return ""
    return " ".join(str(len(schedule.fill_starts(rank))) for rank in range(schedule.pp))


def _fill_line(result: SimResult) -> list[str]:
    """The idle time no order removes (a rank's wait for its first input) and what is left beyond it."""
    fill = result.beyond_the_fill()
    if fill is None or result.steps > 1:
        return []
    longest_wait, beyond = fill
    return [f"beyond the fill (up to {_number(longest_wait)}: a rank waiting for its first input): "
            f"{_number(beyond)} idle"]


def _steps_line(result: SimResult) -> list[str]:
    """With several steps: when each ends, and the time and bubble per step after the first (the steady state)."""
    if result.steps == 1:
        return []
    step_time, bubble = result.steady_step()
    ends = ", ".join(_number(end) for end in result.step_ends())
    return [f"{result.steps} steps, ending at {ends} · after the first: {_number(step_time)} per step, "
            f"bubble ratio {bubble:.1%} per step"]


def _parameters_line(result: SimResult) -> str:
    """The share of the model's parameters each rank holds: copies/pp (DualPipe's two copies: twice 1/pp)."""
    line = f"parameters per rank: {result.copies}/{result.pp} of the model"
    if result.copies > 1:
        line += f" ({result.copies} model copies: {result.copies}x a one-copy schedule's)"
    if result.weight_versions > 1:
        line += (f", kept in {result.weight_versions} weight versions ({result.weight_versions}x a one-version "
                 f"schedule's)")
    return line


def _peaks_line(ranks: Sequence[RankTimeline]) -> str:
    return _per_rank_line("peak in-flight activations", "(microbatches)", [r.peak_activations for r in ranks])


def _idle_line(result: SimResult) -> str:
    return _per_rank_line("idle time", "(makespan - the rank's compute)", result.idle_times())


def _per_rank_line(name: str, unit: str, values: Sequence[float]) -> str:
    """``name per rank unit: v0, v1, ...``; beyond 16 ranks only the highest and the lowest."""
    if len(values) <= 16:
        return f"{name} per rank {unit}: " + ", ".join(_number(value) for value in values)
    highest = max(range(len(values)), key=values.__getitem__)
    lowest = min(range(len(values)), key=values.__getitem__)
    return (f"{name} {unit}: highest {_number(values[highest])} on rank {highest}, "
            f"lowest {_number(values[lowest])} on rank {lowest}")


def _number(value: float) -> str:
    value = round(value, 9)  # sums of durations: no 1e-15 residues
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _used_kinds(ranks: Sequence[RankTimeline]) -> list[str]:
    present = {a.kind for r in ranks for a in r.actions}
    return [kind for kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if kind in present]


def _max_chunks(ranks: Sequence[RankTimeline]) -> int:
    return max((len(chunk_indices(r)) for r in ranks), default=1)


# --- terminal ---------------------------------------------------------------------------------

def render_terminal(ranks: Sequence[RankTimeline], console: Console, width: Optional[int] = None,
                    title: str = "Pipeline timeline") -> None:
    """Print one row per rank (time scaled to the width), each action a coloured cell, then a legend.

    When actions are narrower than a character the later one in a cell wins: the
    picture is scaled, never truncated.
    """
    label_width = len(f"rank {max((r.rank for r in ranks), default=0)} ") + 1
    peak_width = 12
    columns = max(10, (width or console.width) - label_width - peak_width)
    end = timeline_end(ranks) or 1.0
    console.print(Text(title, style="bold"))
    plain = console.color_system is None  # no colours: fill cells with the action's letter instead
    for timeline in ranks:
        row = Text(f"rank {timeline.rank}".ljust(label_width), style="bold")
        row.append_text(_terminal_row(timeline, columns, columns / end, plain))
        row.append(f" peak {_number(timeline.peak_activations)}", style="dim")
        console.print(row, no_wrap=True, overflow="crop")
    axis = f"0{_number(end).rjust(columns - 1)}" if columns > len(_number(end)) + 1 else ""
    console.print(Text(" " * label_width + axis, style="dim"), no_wrap=True, overflow="crop")
    console.print(_terminal_legend(ranks), no_wrap=False)


def _terminal_row(timeline: RankTimeline, columns: int, scale: float, plain: bool) -> Text:
    cells: list[Optional[tuple[str, str]]] = [None] * columns  # (character, style)
    for start, stop in timeline.waits:
        for column in range(*_column_span(start, stop, scale, columns)):
            cells[column] = ("░", WAIT_COLOUR)
    chunks = chunk_indices(timeline)
    for action in timeline.actions:
        _paint_action(cells, action, chunks[action.stage], scale, plain)
    for forward, backward in overlapped_pairs(timeline):
        _label_pair(cells, forward, backward, scale, plain)
    row = Text()
    for cell in cells:
        row.append(*(cell or (" ", "")))
    return row


def _paint_action(cells: list, action: TimedAction, chunk: int, scale: float, plain: bool) -> None:
    first, stop = _column_span(action.start, action.end, scale, len(cells))
    fill = action_colour(action.kind, chunk)
    if action.microbatch % 2:  # neighbours of one colour stay apart even without room for labels
        fill = lighten(fill, 0.18)
    style = f"bold {text_colour(fill)} on {fill}"
    label = str(action.microbatch)
    span = stop - first
    filler = action.kind[0] if plain else " "
    text = label.center(span, filler) if span >= len(label) else filler * span
    for offset, column in enumerate(range(first, stop)):
        cells[column] = (text[offset], style)


def _label_pair(cells: list, forward: TimedAction, backward: TimedAction, scale: float, plain: bool) -> None:
    """One label ``f+b`` (the two microbatches) centred across both halves of a pair, each keeping its colour."""
    first, _ = _column_span(forward.start, forward.end, scale, len(cells))
    backward_first, stop = _column_span(backward.start, backward.end, scale, len(cells))
    label = f"{forward.microbatch}+{backward.microbatch}"
    if stop - first < len(label):
        return  # too narrow: the halves keep what they show
    for offset, character in enumerate(label.center(stop - first)):
        column = first + offset
        if character == " ":  # the halves' own labels give way to the pair's
            half = forward if column < backward_first else backward
            character = half.kind[0] if plain else " "
        cells[column] = (character, cells[column][1] if cells[column] else "")


def overlapped_pairs(timeline: RankTimeline) -> list[tuple[TimedAction, TimedAction]]:
    """The rank's overlapped pairs: consecutive actions carrying the same ``pair`` number."""
    return _joined(timeline, "pair")


def _joined(timeline: RankTimeline, number: str) -> list[tuple[TimedAction, TimedAction]]:
    """Consecutive actions of the rank carrying the same ``number`` (``pair`` or ``fill``)."""
    actions = timeline.actions
    return [(first, second) for first, second in zip(actions, actions[1:])
            if getattr(first, number) is not None and getattr(first, number) == getattr(second, number)]


def _column_span(start: float, end: float, scale: float, columns: int) -> tuple[int, int]:
    first = min(columns - 1, int(start * scale + 1e-9))
    stop = min(columns, max(first + 1, int(round(end * scale))))
    return first, stop


def _terminal_legend(ranks: Sequence[RankTimeline]) -> Text:
    legend = Text("legend: ", style="dim")
    for kind in _used_kinds(ranks):
        fill = action_colour(kind, 0)
        legend.append(f" {kind} ", style=f"bold {text_colour(fill)} on {fill}")
        legend.append(f" {KIND_NAMES[kind]}  ")
    chunks = _max_chunks(ranks)
    if chunks > 1:
        legend.append("chunks 0..{}: ".format(chunks - 1))
        for chunk in range(chunks):
            legend.append(f"{chunk}", style=f"on {action_colour(FORWARD, chunk)}")
        legend.append(" (darker = earlier chunk)  ")
    if any(r.waits for r in ranks):
        legend.append("░", style=WAIT_COLOUR)
        legend.append(" waiting for communication  ")
    if _has_pairs(ranks):
        legend.append("f+b", style="bold")
        legend.append(" overlapped forward f and backward b  ")
    legend.append("numbers: microbatch", style="dim")
    return legend


def _has_pairs(ranks: Sequence[RankTimeline]) -> bool:
    """Whether any rank has an overlapped forward-backward pair."""
    return any(action.pair is not None for timeline in ranks for action in timeline.actions)


# --- plain text (no terminal) ------------------------------------------------------------------

PLAIN_IDLE, PLAIN_GOES_ON = ".", "-"


def render_plain(ranks: Sequence[RankTimeline], title: str = "Pipeline timeline") -> str:
    """The timeline as a plain grid: a header of times, one row per rank, one fixed-width column per moment an
    action starts (on any rank), each cell an action's label, ``-`` while it goes on, ``.`` idle; then a legend.

    Readable without colours (a log, an issue). An action of zero duration gets a column of its own.
    """
    starts = [_start_keys(timeline) for timeline in ranks]
    columns = sorted({key for keys in starts for key in keys} | _unit_columns(ranks))
    rows = [_plain_row(timeline, keys, columns) for timeline, keys in zip(ranks, starts)]
    header = [_number(time) if index == 0 else "" for time, index in columns]
    width = max((len(cell) for cells in [header, *rows] for cell in cells), default=1) + 1
    label_width = len(f"rank {max((r.rank for r in ranks), default=0)}") + 2
    lines = [title, "time".ljust(label_width) + "".join(cell.ljust(width) for cell in header).rstrip()]
    lines += [f"rank {timeline.rank}".ljust(label_width) + "".join(cell.ljust(width) for cell in cells).rstrip()
              for timeline, cells in zip(ranks, rows)]
    lines.append(_plain_legend(ranks))
    return "\n".join(lines) + "\n"


def _unit_columns(ranks: Sequence[RankTimeline]) -> set[tuple[float, int]]:
    """A column at every multiple of the shortest action when every start and end falls on one (as with
    ``F=B=W=1``), so that equal times take equal widths; else none (columns at the starts only)."""
    times = [round(t, 9) for timeline in ranks for action in timeline.actions for t in (action.start, action.end)]
    durations = [action.end - action.start for timeline in ranks for action in timeline.actions]
    unit = min((duration for duration in durations if duration > 1e-9), default=0.0)
    if unit == 0.0 or any(abs(t / unit - round(t / unit)) > 1e-6 for t in times):
        return set()
    steps = round(max(times) / unit)
    if steps > 2 * len(set(times)):  # a tiny unit would spread the picture thin
        return set()
    return {(round(step * unit, 9), 0) for step in range(steps)}


def _start_keys(timeline: RankTimeline) -> list[tuple[float, int]]:
    """Each action's column key: its start, and its place among the rank's actions starting then (0, 1, ...)."""
    keys, seen = [], collections.Counter()
    for action in timeline.actions:
        start = round(action.start, 9)  # sums of durations: no 1e-15 residues
        keys.append((start, seen[start]))
        seen[start] += 1
    return keys


def _plain_row(timeline: RankTimeline, keys: list[tuple[float, int]], columns: list[tuple[float, int]]) -> list[str]:
    cells = dict.fromkeys(columns, PLAIN_IDLE)
    for action in timeline.actions:
        # walked by index: a slice of the columns after each action's start copied the rest of them (quadratic)
        index, end = bisect.bisect_right(columns, (round(action.start, 9), math.inf)), round(action.end, 9)
        while index < len(columns) and columns[index][0] < end:
            cells[columns[index]] = PLAIN_GOES_ON
            index += 1
    chunks = chunk_indices(timeline)
    paired = {id(forward) for forward, _ in overlapped_pairs(timeline)}
    filled = {id(backward) for backward, _ in weight_fills(timeline)}
    for key, action in zip(keys, timeline.actions):
        joint = "+" if id(action) in paired else "&" if id(action) in filled else ""
        cells[key] = plain_label(action, chunks[action.stage] if len(chunks) > 1 else None) + joint
    return [cells[column] for column in columns]


def plain_label(action: TimedAction, chunk: Optional[int] = None) -> str:
    """``F3``; on chunk 1 of a rank holding several, ``F3.1`` (the grid adds ``+`` to the first half of an overlapped
    pair, ``&`` to a weight fill's backward)."""
    return f"{action.kind}{action.microbatch}" + (f".{chunk}" if chunk is not None else "")


def weight_fills(timeline: RankTimeline) -> list[tuple[TimedAction, TimedAction]]:
    """The rank's weight fills: consecutive actions carrying the same ``fill`` number (the backward, then its W)."""
    return _joined(timeline, "fill")


def _plain_legend(ranks: Sequence[RankTimeline]) -> str:
    kinds = ", ".join(f"{kind} {KIND_NAMES[kind]}" for kind in _used_kinds(ranks))
    parts = [f"cells: kind and microbatch ({kinds})"]
    if _max_chunks(ranks) > 1:
        parts.append("then .chunk (the rank's chunk 0, 1, ...)")
    if _has_pairs(ranks):
        parts.append("X+ then Y: an overlapped forward-backward pair")
    if any(action.fill is not None for timeline in ranks for action in timeline.actions):
        parts.append("X& then W: a weight fill (the W also computes in X's all-to-all waits)")
    parts.append(f"'{PLAIN_GOES_ON}' the action goes on, '{PLAIN_IDLE}' idle; header: the time each column starts")
    return "; ".join(parts)


# --- SVG / HTML ------------------------------------------------------------------------------

LEFT, RIGHT, PLOT_WIDTH = 74, 92, 1100


def _row_geometry(num_ranks: int) -> tuple[int, int]:
    """Row height and gap: roomy up to 16 ranks, then shrinking so 64 ranks stay on one screen."""
    if num_ranks <= 16:
        return 26, 6
    return max(8, 26 * 16 // num_ranks), 2
FONT = "font-family=\"Helvetica, Arial, sans-serif\""


def render_svg(ranks: Sequence[RankTimeline], title: str, subtitle_lines: Sequence[str] = (),
               time_label: str = "time", memory: Optional[Sequence[MemoryPoints]] = None) -> str:
    """A standalone SVG: one row per rank, a time axis, boxes labelled with their microbatch, a legend.

    Each action is exactly one ``<rect class="action">`` (with a hover tooltip);
    waits are ``<rect class="wait">`` filled with a hatch. ``memory``: per rank, the
    activation bytes it holds over time (``(time, bytes)`` points of a step function),
    drawn as a thin ``<path class="memory">`` band under its row, every rank on one scale.
    """
    end = timeline_end(ranks) or 1.0
    scale = PLOT_WIDTH / end
    row_height, row_gap = _row_geometry(len(ranks))
    band = max(3, row_height // 3) if memory is not None else 0
    top = 38 + 18 * len(subtitle_lines) + 10
    rows_bottom = top + len(ranks) * (row_height + band + row_gap)
    legend_y = rows_bottom + 48
    width, height = LEFT + PLOT_WIDTH + RIGHT, legend_y + 34
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>',
        _svg_defs(),
        f'<rect class="background" x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="26" font-size="17" font-weight="bold" fill="#202124">{escape(title)}</text>',
    ]
    parts += [f'<text x="{LEFT}" y="{48 + 18 * i}" font-size="12.5" fill="#5f6368">{escape(line)}</text>'
              for i, line in enumerate(subtitle_lines)]
    full = max((held for points in memory or () for _, held in points), default=0)
    for index, timeline in enumerate(ranks):
        y = top + index * (row_height + band + row_gap)
        parts += _svg_row(timeline, y, row_height, scale)
        if memory is not None:
            parts.append(_svg_memory_band(memory[index], y + row_height + 1, band - 1, scale, full))
    parts += _svg_axis(end, scale, rows_bottom, time_label)
    memory_note = f"; band under each row: activation memory (full: {full / 2**20:.1f} MiB)" if memory else ""
    parts += _svg_legend(ranks, legend_y, memory_note)
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_defs() -> str:
    return ('<defs><pattern id="wait-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eceff1"/>'
            f'<line x1="0" y1="0" x2="0" y2="6" stroke="{WAIT_COLOUR}" stroke-width="2"/></pattern></defs>')


def _svg_row(timeline: RankTimeline, y: float, height: int, scale: float) -> list[str]:
    font_size = min(12, height - 1)
    baseline = y + height / 2 + font_size / 3
    parts = [
        f'<rect class="lane" x="{LEFT}" y="{y}" width="{PLOT_WIDTH}" height="{height}" fill="#f1f3f4"/>',
        f'<text x="{LEFT - 10}" y="{baseline:.1f}" font-size="{font_size}" text-anchor="end" fill="#202124">'
        f'rank {timeline.rank}</text>',
        f'<text x="{LEFT + PLOT_WIDTH + 10}" y="{baseline:.1f}" font-size="{min(11, font_size)}" fill="#5f6368">'
        f'peak {_number(timeline.peak_activations)}</text>',
    ]
    for start, stop in timeline.waits:
        parts.append(f'<rect class="wait" x="{LEFT + start * scale:.2f}" y="{y}" '
                     f'width="{max((stop - start) * scale, 0.5):.2f}" height="{height}" fill="url(#wait-hatch)">'
                     f'<title>waiting for communication {start:g}-{stop:g}</title></rect>')
    chunks = chunk_indices(timeline)
    for action in timeline.actions:
        parts += _svg_action(action, chunks[action.stage], y, height, scale)
    for forward, backward in overlapped_pairs(timeline):
        parts.append(_svg_pair(forward, backward, y, height, scale))
    return parts


def _svg_memory_band(points: MemoryPoints, y: float, height: int, scale: float, full: int) -> str:
    """A rank's activation bytes over time as a filled step path ``height`` high, ``full`` bytes filling it."""
    bottom, steps = y + height, []
    for time, held in points:
        level = bottom - (held / full * height if full > 0 else 0)
        steps.append(f"H{LEFT + time * scale:.2f}V{level:.2f}")
    peak = max((held for _, held in points), default=0)
    return (f'<path class="memory" d="M{LEFT} {bottom}{"".join(steps)}H{LEFT + PLOT_WIDTH}V{bottom}Z" '
            f'fill="{MEMORY_COLOUR}"><title>activation memory: peak {peak / 2**20:.1f} MiB ({peak} bytes)'
            f'</title></path>')


def _svg_pair(forward: TimedAction, backward: TimedAction, y: float, height: int, scale: float) -> str:
    """A dark outline around both halves of an overlapped pair: one box, as DualPipe draws it."""
    x, end = LEFT + forward.start * scale, LEFT + backward.end * scale
    tooltip = (f"overlapped pair: {forward.kind} stage {forward.stage} microbatch {forward.microbatch} + "
               f"{backward.kind} stage {backward.stage} microbatch {backward.microbatch}: "
               f"{forward.start:g}-{backward.end:g}")
    return (f'<rect class="pair" x="{x:.2f}" y="{y}" width="{max(end - x, 0.5):.2f}" height="{height}" '
            f'fill="none" stroke="{PAIR_OUTLINE}" stroke-width="1.5"><title>{escape(tooltip)}</title></rect>')


def _svg_action(action: TimedAction, chunk: int, y: float, height: int, scale: float) -> list[str]:
    x, box_width = LEFT + action.start * scale, max((action.end - action.start) * scale, 0.5)
    fill = action_colour(action.kind, chunk)
    stroke = ' stroke="#ffffff" stroke-width="1"' if box_width >= 8 else ""
    tooltip = (f"{action.kind} stage {action.stage} (chunk {chunk}) microbatch {action.microbatch}: "
               f"{action.start:g}-{action.end:g}")
    parts = [f'<rect class="action" x="{x:.2f}" y="{y}" width="{box_width:.2f}" height="{height}" '
             f'fill="{fill}"{stroke}><title>{escape(tooltip)}</title></rect>']
    label = str(action.microbatch)
    font_size = 11 if box_width >= 7 * len(label) + 4 else 9 if box_width >= 5.5 * len(label) + 2 else 0
    if font_size and height >= 14:
        parts.append(f'<text x="{x + box_width / 2:.2f}" y="{y + height / 2 + font_size / 3:.1f}" '
                     f'font-size="{font_size}" text-anchor="middle" fill="{text_colour(fill)}" '
                     f'pointer-events="none">{label}</text>')
    return parts


def _svg_axis(end: float, scale: float, y: float, time_label: str) -> list[str]:
    step = nice_step(end, target_ticks=10)
    parts = [f'<line x1="{LEFT}" y1="{y + 2}" x2="{LEFT + PLOT_WIDTH}" y2="{y + 2}" stroke="#5f6368"/>']
    for tick in range(int(end / step + 1e-9) + 1):
        x = LEFT + tick * step * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y + 2}" x2="{x:.2f}" y2="{y + 7}" stroke="#5f6368"/>')
        parts.append(f'<text x="{x:.2f}" y="{y + 20}" font-size="11" text-anchor="middle" fill="#5f6368">'
                     f'{_number(round(tick * step, 10))}</text>')
    parts.append(f'<text x="{LEFT + PLOT_WIDTH}" y="{y + 36}" font-size="11" text-anchor="end" '
                 f'fill="#5f6368">{escape(time_label)}</text>')
    return parts


def nice_step(span: float, target_ticks: int = 10) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about ``target_ticks`` ticks."""
    if span <= 0:
        return 1.0
    raw = span / target_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _svg_legend(ranks: Sequence[RankTimeline], y: float, memory_note: str = "") -> list[str]:
    parts, x = [], LEFT
    chunks = _max_chunks(ranks)
    for kind in _used_kinds(ranks):
        for chunk in range(chunks):
            parts.append(f'<rect class="legend" x="{x + 14 * chunk}" y="{y}" width="14" height="14" '
                         f'fill="{action_colour(kind, chunk)}"/>')
        name = KIND_NAMES[kind] + (f" (chunks 0-{chunks - 1})" if chunks > 1 else "")
        x += 14 * chunks + 6
        parts.append(f'<text x="{x}" y="{y + 11.5}" font-size="12" fill="#202124">{kind}: {escape(name)}</text>')
        x += 8 * (len(kind) + len(name)) + 28
    if any(r.waits for r in ranks):
        parts.append(f'<rect class="legend" x="{x}" y="{y}" width="14" height="14" fill="url(#wait-hatch)"/>')
        parts.append(f'<text x="{x + 20}" y="{y + 11.5}" font-size="12" fill="#202124">'
                     f'waiting for communication</text>')
        x += 200
    if _has_pairs(ranks):
        parts.append(f'<rect class="legend" x="{x}" y="{y}" width="28" height="14" fill="none" '
                     f'stroke="{PAIR_OUTLINE}" stroke-width="1.5"/>')
        parts.append(f'<text x="{x + 34}" y="{y + 11.5}" font-size="12" fill="#202124">'
                     f'overlapped forward + backward</text>')
    note = "numbers in boxes: microbatch"
    if chunks > 1:
        note += "; darker shade = earlier chunk of the rank"
    note += "; right: peak in-flight activations (microbatches through all of the rank's layers)" + memory_note
    parts.append(f'<text x="{LEFT}" y="{y + 30}" font-size="11" fill="#5f6368">{escape(note)}</text>')
    return parts


def render_html(ranks: Sequence[RankTimeline], title: str, subtitle_lines: Sequence[str] = (),
                time_label: str = "time", memory: Optional[Sequence[MemoryPoints]] = None) -> str:
    """The SVG of ``render_svg`` embedded in a minimal HTML page."""
    svg = render_svg(ranks, title, subtitle_lines, time_label, memory)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title></head>\n"
            "<body style=\"margin:16px;background:#ffffff\">\n" + svg + "\n</body></html>\n")


def write_timeline(ranks: Sequence[RankTimeline], path: str | Path, title: str,
                   lines: Sequence[str] = (), time_label: str = "time",
                   memory: Optional[Sequence[MemoryPoints]] = None) -> Path:
    """Write the timeline to ``path`` as ``.svg`` or ``.html`` (by suffix), its folders created; returns the path.

    ``lines`` are the subtitle lines; ``time_label`` names the axis (e.g. ``"time (ms)"``); ``memory``: per rank,
    its activation bytes over time, drawn as a band under its row (``render_svg``).
    """
    path = Path(path)
    renderers = {".svg": render_svg, ".html": render_html}
    renderer = renderers.get(path.suffix.lower())
    if renderer is None:
        raise ValueError(f"timeline file {path}: suffix {path.suffix or '(none)'!r} is not supported; "
                         f"use one of {', '.join(SUPPORTED_SUFFIXES)}")
    if path.parent.exists() and not path.parent.is_dir():  # mkdir would only say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(renderer(ranks, title, lines, time_label, memory), encoding="utf-8")
    return path
