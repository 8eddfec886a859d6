"""What ``ppctl check-memory`` prints: each checked rank's measured memory by part next to the model's prediction."""

from __future__ import annotations

import sys
from typing import Sequence

GIB = 2 ** 30
TOLERANCE = 0.05  # the largest difference of a judged part, as a fraction: the 5%
# The parts a check judges: what the model predicts as such, and the rank's total. The step's peak on top of the
# held parts (activations and the model's buffers: messages and one microbatch's working memory) is shown beside
# them; the buffers are the model's bound on what an action holds while it runs, not a measured quantity of theirs.
JUDGED = ("parameters", "gradients", "optimizer", "activations", "total")
SHOWN = ("parameters", "gradients", "optimizer", "activations", "step peak", "total")


def part_bytes(check) -> dict[str, tuple[int, int]]:
    """(measured, predicted) bytes per shown part of one ``RankCheck``."""
    measured, predicted = check.measured, check.predicted
    return {"parameters": (measured.parameters, predicted.parameters),
            "gradients": (measured.gradients, predicted.gradients),
            "optimizer": (measured.optimizer, predicted.optimizer),
            "activations": (measured.activations, predicted.activations - check.rebuilt),
            "step peak": (measured.peak, predicted.activations + predicted.buffers),
            "total": (measured.total, predicted.total)}


def misses(checks: Sequence, tolerance: float) -> list[str]:
    """One line per judged part of a checked rank whose prediction is off the measurement by more than
    ``tolerance`` (a fraction)."""
    lines = []
    for check in checks:
        for part, difference in check.differences().items():
            if part in JUDGED and abs(difference) > tolerance:
                measured, predicted = part_bytes(check)[part]
                lines.append(f"rank {check.rank} (pp rank {check.coords['pp']}): {part} predicted "
                             f"{predicted / GIB:.3f} GiB, measured {measured / GIB:.3f} GiB ({difference:+.1%}, "
                             f"tolerance {tolerance:.0%})")
    return lines


def print_checks(checks: Sequence, title: str) -> None:
    """One table: per checked rank and part, the measured and predicted GiB and the difference."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("rank", "pp", "part", "measured GiB", "predicted GiB", "difference"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for check in checks:
        differences = check.differences()
        for part, (measured, predicted) in part_bytes(check).items():
            table.add_row(str(check.rank), str(check.coords["pp"]), part, f"{measured / GIB:.3f}",
                          f"{predicted / GIB:.3f}", f"{differences[part]:+.1%}")
        table.add_section()
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(f"{len(checks)} rank(s) in {sum(check.seconds for check in checks):.1f} s (fake tensors: a step "
                  "leaves out the allocator's fragmentation, kernel workspaces, the CUDA context and NCCL's buffers)",
                  soft_wrap=True)


def markdown_rows(label: str, checks: Sequence) -> list[str]:
    """Markdown table rows, one per checked rank: ``label``, the pp rank (and EP rank with ep > 1), measured and predicted total GiB, each
    shown part's difference and the seconds the rank took."""
    rows = []
    for check in checks:
        measured, predicted = part_bytes(check)["total"]
        differences = check.differences()
        expert = f" (ep {check.coords['ep']})" if "ep" in check.coords else ""
        rows.append(f"| {label} | {check.coords['pp']}{expert} | {measured / GIB:.2f} | {predicted / GIB:.2f} | "
                    + " | ".join(f"{differences[part]:+.1%}" for part in SHOWN) + f" | {check.seconds:.0f} |")
    return rows


MARKDOWN_HEADER = ["| config | pp rank | measured GiB | predicted GiB | " + " | ".join(SHOWN) + " | s |",
                   "|" + "---|" * (len(SHOWN) + 5)]
