"""``ppctl bench``'s table, and its refusal of a comparison whose two sides computed different losses."""

from __future__ import annotations

import sys
from pathlib import Path

MIB = 2 ** 20


def different_work(results: list[dict]) -> str | None:
    """One line naming the first schedule whose two sides' losses differ beyond the tolerance, or None."""
    for result in results:
        difference, tolerance = result["loss_max_rel_diff"], result["loss_tolerance"]
        if difference is not None and tolerance is not None and difference > tolerance:
            return (f"schedule={result['schedule']}: ppctl's and {result['against']}'s losses differ by up to "
                    f"{difference:.2e} (relative; tolerance {tolerance:.0e}): not the same work, no comparison")
    return None


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _ratio_cell(result: dict) -> str:
    if result["ratio"] is None:
        return "-"
    blocks = result["ratios_per_block"]
    return f"{result['ratio']:.3f} ({min(blocks):.3f}-{max(blocks):.3f})"


def _memory_cell(result: dict) -> str:
    """Largest per-rank peak of each side, in MiB."""
    return " / ".join(f"{max(per_rank) / MIB:.1f}" for per_rank in result["peak_memory_bytes"].values())


def _on_core_cell(result: dict) -> str:
    """The least share of a traced rank's time on a core, in its actions and between them (``on_core_share``)."""
    shares = result.get("on_core_share")
    if not shares:
        return "-"
    return f"{min(shares['actions']):.2f} / {min(shares['between']):.2f}"


def print_bench(results: list[dict], run_dir: Path) -> None:
    """The comparison table: step times (medians of the blocks), ratio, bubbles, peak memory, loss agreement."""
    from rich.console import Console
    from rich.table import Table

    first = results[0]
    other = {"torch": "torch.distributed.pipelining", "plain": "a plain PyTorch loop",
             "eager": "itself with eager blocks (trainer.compile=false)", "none": "nothing"}
    table = Table(title=f"ppctl against {other[first['against']]}: median of {first['repeats']} blocks of "
                        f"{first['steps_per_block']} steps each, taken in turns")
    for column in ("schedule", "pp x vpp", "m", "ppctl ms", "other ms", "ratio (blocks)", "bubble", "sim.",
                   "on core", "MiB", "loss diff"):
        table.add_column(column, overflow="fold")
    for result in results:
        difference = result["loss_max_rel_diff"]
        table.add_row(result["schedule"], f"{result['pp']} x {result['vpp']}", str(result["microbatches"]),
                      _milliseconds(result["ppctl_step_s"]), _milliseconds(result["other_step_s"]),
                      _ratio_cell(result), f"{result['bubble_measured']:.3f}", f"{result['bubble_simulated']:.3f}",
                      _on_core_cell(result), _memory_cell(result), "-" if difference is None else f"{difference:.1e}")
    console = Console(width=None if sys.stdout.isatty() else 150)  # a file or pipe gets the whole table
    console.print(table)
    for result in results:
        exchanged = result.get("all_to_all")
        if exchanged:
            console.print(f"{result['schedule']}: expert all-to-all {exchanged['total_ms']:.1f} ms per step and rank, "
                          f"exposed {exchanged['exposed_measured_ms']:.1f} ms measured, "
                          f"{exchanged['exposed_simulated_ms']:.1f} ms simulated at the fitted costs")
    console.print("ms: median step time of each side; ratio: ppctl / other, per block in brackets (below 1: ppctl "
                  "is faster). bubble: (makespan - busiest rank's compute) / that compute in one traced step; sim.: "
                  "the simulator's, given that step's mean F, B, W and the measured message time. on core: the "
                  "least share of a traced rank's time its thread was on a core, in its actions / between them (on "
                  "a CPU device, below 1 is waiting for a core or blocked in a post). MiB: largest "
                  "peak per rank, ppctl / other. loss diff: largest relative difference of the step losses. "
                  f"All figures: {run_dir / 'bench.json'}")
