"""Timeline rendering: SVG/HTML files and the rich terminal view, for simulated and measured timelines."""

import io
import xml.etree.ElementTree as ElementTree

import pytest
from rich.console import Console

from ppctl.pipeline.render import (
    lighten,
    nice_step,
    render_svg,
    render_terminal,
    simulation_lines,
    text_colour,
    write_timeline,
)
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.simulate import Costs, RankTimeline, TimedAction, simulate

SVG = "{http://www.w3.org/2000/svg}"


def simulated(name="interleaved_1f1b", pp=4, vpp=2, num_microbatches=8):
    return simulate(build_schedule(name, pp, vpp, num_microbatches), Costs(F=1, B=2, W=0, comm=0.05))


def measured() -> list[RankTimeline]:
    """A hand-written 'measured' timeline with waits, as a real run would record it."""
    return [
        RankTimeline(0, [TimedAction("F", 0, 0, 0.0, 1.0), TimedAction("BW", 0, 0, 3.5, 5.5)], 1.0,
                     waits=[(1.0, 3.5)]),
        RankTimeline(1, [TimedAction("F", 1, 0, 1.2, 2.2), TimedAction("BW", 1, 0, 2.2, 3.3)], 1.0),
    ]


def svg_rects(svg: str, css_class: str) -> list:
    root = ElementTree.fromstring(svg)
    return [rect for rect in root.iter(f"{SVG}rect") if rect.get("class") == css_class]


# --- SVG / HTML ----------------------------------------------------------------------------------

def test_svg_parses_and_has_one_rect_per_action():
    result = simulated()
    svg = render_svg(result.ranks, "interleaved", simulation_lines(result))
    actions = svg_rects(svg, "action")
    assert len(actions) == sum(len(rank.actions) for rank in result.ranks) == 4 * 2 * 2 * 8
    texts = [t.text for t in ElementTree.fromstring(svg).iter(f"{SVG}text")]
    assert "interleaved" in texts and "rank 3" in texts
    assert any(text and text.startswith("makespan") and "bubble ratio" in text for text in texts)
    assert any(text and text.startswith("peak in-flight activations per rank") for text in texts)


def test_svg_draws_waits_hatched_and_lists_them_in_the_legend():
    svg = render_svg(measured(), "measured step", ["2 ranks"])
    assert len(svg_rects(svg, "wait")) == 1 and len(svg_rects(svg, "action")) == 4
    assert "url(#wait-hatch)" in svg and "waiting for communication" in svg


def test_svg_escapes_text():
    svg = render_svg(measured(), "a < b & c", ["x > y"])
    assert "a &lt; b &amp; c" in svg
    ElementTree.fromstring(svg)


def test_svg_of_a_large_pipeline_scales_without_labels():
    ranks = [RankTimeline(r, [TimedAction("F", r, mb, mb * 0.1, mb * 0.1 + 0.1) for mb in range(2000)], 1.0)
             for r in range(40)]
    svg = render_svg(ranks, "large", [])
    assert len(svg_rects(svg, "action")) == 80000


@pytest.mark.parametrize("suffix", [".svg", ".html"])
def test_write_timeline_by_suffix(tmp_path, suffix):
    result = simulated("1f1b", 2, 1, 4)
    path = write_timeline(result.ranks, tmp_path / f"timeline{suffix}", "1f1b", simulation_lines(result))
    text = path.read_text()
    assert "<svg" in text
    if suffix == ".html":
        assert text.startswith("<!DOCTYPE html>") and "<title>1f1b</title>" in text
    else:
        ElementTree.fromstring(text)


def test_write_timeline_refuses_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"suffix '.png' is not supported; use one of .svg, .html"):
        write_timeline(measured(), tmp_path / "timeline.png", "x")


# --- terminal ------------------------------------------------------------------------------------

def render_to_text(ranks, width=120) -> str:
    buffer = io.StringIO()
    render_terminal(ranks, Console(file=buffer, width=width), title="my schedule")
    return buffer.getvalue()


def test_terminal_has_a_row_per_rank_and_a_legend():
    result = simulated("1f1b", 4, 1, 8)
    text = render_to_text(result.ranks)
    lines = text.splitlines()
    assert lines[0] == "my schedule"
    for pp_rank in range(4):
        row = next(line for line in lines if line.startswith(f"rank {pp_rank} "))
        assert len(row) <= 120 and f"peak {4 - pp_rank}" in row
    assert "legend:" in text and "forward" in text and "backward" in text


def test_terminal_labels_actions_with_their_microbatch():
    result = simulate(build_schedule("gpipe", 1, 1, 3))
    row = next(line for line in render_to_text(result.ranks).splitlines() if line.startswith("rank 0"))
    assert [c for c in row[len("rank 0 "):] if c.isdigit()][:6] == ["0", "1", "2", "0", "1", "2"]


def test_terminal_scales_many_actions_into_few_columns():
    result = simulate(build_schedule("1f1b", 16, 1, 128))
    text = render_to_text(result.ranks, width=80)
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == 16 and all(len(row) <= 80 for row in rows)


def test_terminal_shows_waits_and_chunks_in_the_legend():
    text = render_to_text(measured())
    assert "░" in text and "waiting for communication" in text
    chunked = render_to_text(simulated().ranks)
    assert "chunks 0..1" in chunked


# --- helpers -------------------------------------------------------------------------------------

def test_nice_step_is_one_two_or_five_times_a_power_of_ten():
    assert nice_step(33) == 5
    assert nice_step(1725) == 200
    assert nice_step(0.9) == 0.1
    assert nice_step(0) == 1.0


def test_colour_helpers():
    assert text_colour("#ffffff") == "#111111" and text_colour("#1f5fa8") == "#ffffff"
    assert lighten("#000000", 0.5) == "#808080" and lighten("#123456", 0) == "#123456"


# --- overlapped pairs and two model copies ----------------------------------------------------------

def test_svg_outlines_each_overlapped_pair_once_and_keeps_one_rect_per_action():
    result = simulate(build_schedule("dualpipe", 4, 2, 8), Costs(F=1, B=1, W=1, FB=2.5))
    svg = render_svg(result.ranks, "dualpipe", simulation_lines(result))
    pairs = sum(len({a.pair for a in rank.actions if a.pair is not None}) for rank in result.ranks)
    assert pairs > 0 and len(svg_rects(svg, "pair")) == pairs
    assert len(svg_rects(svg, "action")) == sum(len(rank.actions) for rank in result.ranks)
    assert "overlapped forward + backward" in svg


def test_terminal_labels_a_pair_once_with_both_microbatches():
    result = simulate(build_schedule("dualpipe", 2, 2, 4))
    text = render_to_text(result.ranks, width=200)
    row = next(line for line in text.splitlines() if line.startswith("rank 0"))
    assert "3+0" in row  # F of microbatch 3 overlapped with the BW of microbatch 0
    assert "overlapped forward f and backward b" in text


def test_simulation_lines_give_idle_time_and_parameters_per_rank():
    lines = simulation_lines(simulate(build_schedule("dualpipe", 4, 2, 8), Costs(FB=2.5)))
    assert "FB=2.5" in lines[0]
    assert "idle time per rank (makespan - the rank's compute): " in lines[2]
    assert lines[-1] == "parameters per rank: 2/4 of the model (2 model copies: 2x a one-copy schedule's)"
    assert simulation_lines(simulated("1f1b", 4, 1, 8))[-1] == "parameters per rank: 1/4 of the model"


# --- plain text (no terminal) -------------------------------------------------------------------------

def grid_rows(text: str) -> dict[str, list[str]]:
    """``rank N`` / ``time`` -> the row's cells (split on spaces: labels hold none)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith(("rank ", "time ")):
            name = " ".join(line.split()[:2]) if line.startswith("rank") else "time"
            rows[name] = line.split()[2:] if line.startswith("rank") else line.split()[1:]
    return rows


def test_plain_grid_labels_every_cell_in_fixed_width_columns():
    from ppctl.pipeline.render import render_plain

    result = simulate(build_schedule("1f1b", 2, 1, 4))  # F=B=W=1: one column per time unit
    text = render_plain(result.ranks, "1f1b")
    rows = grid_rows(text)
    assert rows["time"] == [str(t) for t in range(15)]
    assert rows["rank 0"][:6] == ["F0", "F1", ".", ".", "BW0", "-"]  # BW = B+W takes two units
    assert rows["rank 1"][:4] == [".", "F0", "BW0", "-"]
    lines = [line for line in text.splitlines() if line.startswith(("time", "rank"))]
    first = lines[0].index(" 0 ") + 1  # where the cells begin, after the row labels
    width = lines[0].index(" 1 ") + 1 - first
    for line in lines:  # every cell begins on a column boundary
        cells = [index for index in range(first, len(line)) if line[index] != " " and line[index - 1] == " "]
        assert all((index - first) % width == 0 for index in cells), line
    assert "\x1b[" not in text and "cells: kind and microbatch (F forward, BW backward)" in text


def test_plain_grid_marks_chunks_the_split_backward_and_overlapped_pairs():
    from ppctl.pipeline.render import render_plain

    chunked = grid_rows(render_plain(simulate(build_schedule("zbv", 2, 2, 4)).ranks))
    cells = set(chunked["rank 0"])
    assert {"F0.0", "F0.1", "B0.1", "W0.0"} <= cells
    paired = render_plain(simulate(build_schedule("dualpipe", 2, 2, 4), Costs(F=1, B=1, W=1, FB=2.5)).ranks)
    assert any(cell.endswith("+") for cell in grid_rows(paired)["rank 0"]) and "overlapped" in paired


def test_plain_grid_of_irregular_times_has_a_column_per_start():
    from ppctl.pipeline.render import render_plain

    result = simulate(build_schedule("1f1b", 2, 1, 2), Costs(F=1, B=2, W=0, comm=0.1))
    rows = grid_rows(render_plain(result.ranks))
    assert rows["time"][:3] == ["0", "1", "1.1"] and rows["rank 1"][:3] == [".", ".", "F0"]


def test_inspect_schedule_without_a_terminal_prints_the_plain_grid(capsys):
    from ppctl.cli.schedule_report import print_schedule

    print_schedule(simulate(build_schedule("1f1b", 4, 1, 8)), None)  # pytest's stdout is no terminal
    text = capsys.readouterr().out
    assert grid_rows(text)["rank 3"][:4] == [".", ".", ".", "F0"]
    assert "bubble ratio 37.5%" in text and "\x1b[" not in text


def test_write_timeline_creates_missing_folders(tmp_path):
    path = write_timeline(measured(), tmp_path / "new" / "deeper" / "t.svg", "x")
    assert path.is_file()


def smallest_sizes():
    """(name, pp, vpp, microbatches): every registered schedule at pp=4 with its chunks and the fewest
    microbatches it takes from 8 up."""
    from ppctl.pipeline.schedules import SCHEDULE_SPECS

    for name, spec in SCHEDULE_SPECS.items():
        vpp = spec.chunks_per_rank or (2 if spec.multi_chunk else 1)
        yield name, 4, vpp, next(m for m in range(8, 64) if spec.microbatch_error(4, vpp, m) is None)


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", list(smallest_sizes()))
def test_every_schedule_draws_on_a_terminal_as_svg_and_as_json(name, pp, vpp, num_microbatches):
    """One box per action in the SVG, one row per rank on the terminal, the program in the JSON."""
    import json

    result = simulate(build_schedule(name, pp, vpp, num_microbatches))
    actions = sum(len(rank.actions) for rank in result.ranks)
    svg = render_svg(result.ranks, name, simulation_lines(result))
    assert len(svg_rects(svg, "action")) == actions
    console = Console(file=io.StringIO(), width=160, color_system=None)
    render_terminal(result.ranks, console, title=name)
    text = console.file.getvalue()
    assert all(f"rank {rank}" in text for rank in range(pp))
    data = json.loads(json.dumps(result.to_json()))
    assert sum(len(rank["actions"]) for rank in data["ranks"]) == actions
    assert sum(len(rank["steps"]) for rank in data["program"]["ranks"]) == actions
