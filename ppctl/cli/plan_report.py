"""What ``ppctl plan`` prints: the ranked candidates as a table, the refusals by reason, and ``--explain``."""

from __future__ import annotations

import shlex
import sys
from typing import Sequence

from ppctl.plan.budget import MemoryBudget
from ppctl.plan.memory import MemoryParts
from ppctl.plan.search import Plan, Prediction

GIB = 2 ** 30


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)  # a file or pipe gets the whole table


def train_command(user_overrides: Sequence[str], prediction: Prediction) -> str:
    """The ``ppctl train`` command line of a candidate: the user's overrides, then the candidate's."""
    return shlex.join(["ppctl", "train", *user_overrides, *prediction.candidate.overrides()])


def print_plan(plan: Plan, user_overrides: Sequence[str], devices: int, budget: MemoryBudget, device_text: str,
               checked: Sequence[dict] = ()) -> None:
    """The best candidates (fastest first) with their overrides, step time, bubble and largest rank's memory (and
    with ``checked``, ``ppctl plan --check``'s marks: the largest difference of a judged part on the candidate's
    ranks in fake tensors, then the parts off by more than 5%), then how many others were refused and why."""
    from rich.table import Table

    console = _console()
    table = Table(title=f"ppctl plan: {devices} devices of {budget.device_bytes / GIB:.0f} GiB ({device_text}), fastest "
                        f"first; each rank's prediction fits {budget.usable_bytes / GIB:.1f} GiB (reserved "
                        f"{budget.reserve_bytes / GIB:g} GiB and {budget.fragmentation:.0%} for fragmentation)")
    experts = any(prediction.candidate.ep is not None for prediction in plan.candidates)  # a mixture: its ep too
    for column in ("#", "tp", "cp", "pp", "vpp", "dp", *(("ep",) if experts else ()), "schedule", "mbs", "recompute",
                   "dist. opt.", "step ms", "bubble", "GiB (max rank)", *(("checked",) if checked else ())):
        table.add_column(column, justify="right" if column not in ("schedule", "recompute") else "left")
    marks = {entry["candidate"]: candidate_mark(entry) for entry in checked}
    for index, prediction in enumerate(plan.candidates, 1):
        candidate = prediction.candidate
        ep = (str(candidate.ep),) if experts else ()
        table.add_row(str(index), str(candidate.tp), str(candidate.cp), str(candidate.pp), str(candidate.vpp),
                      str(candidate.dp), *ep, candidate.schedule, str(candidate.micro_batch_size), candidate.recompute,
                      "yes" if candidate.distributed_optimizer else "no", f"{prediction.step_time_s * 1e3:.2f}",
                      f"{prediction.bubble_ratio:.1%}", f"{prediction.peak_memory_bytes / GIB:.2f}",
                      *((marks.get(index, "-"),) if checked else ()))
    console.print(table)
    for entry in checked:
        for line in entry["misses"]:
            console.print(f"checked #{entry['candidate']}: {line}", soft_wrap=True)
    if not plan.candidates:
        console.print("no candidate fits: see the refusals below")
    for reason, count in plan.refused.most_common():
        console.print(f"left out {count:,}: {reason}", soft_wrap=True)
    if plan.candidates:
        console.print(f"the fastest, to paste: {train_command(user_overrides, plan.candidates[0])}", soft_wrap=True)
        console.print("ppctl plan ... --explain N shows candidate N's memory per rank and its simulated timeline",
                      soft_wrap=True)


def candidate_mark(entry: dict) -> str:
    """A checked candidate's mark: ``ok`` or ``off`` (a judged part beyond 5% on one of its ranks), and the largest
    difference of a judged part over its checked ranks."""
    from ppctl.cli.memory_check_report import JUDGED

    worst = max((abs(check["difference"][part]) for check in entry["checks"] for part in JUDGED), default=0.0)
    return f"{'off' if entry['misses'] else 'ok'} {worst:.1%}"


def print_explanation(prediction: Prediction, result, user_overrides: Sequence[str]) -> None:
    """One candidate: its command, its predicted memory per rank by part, and the simulated timeline of its step
    (``result``: the simulator's ``SimResult`` at the candidate's costs, in ms)."""
    from ppctl.cli.schedule_report import print_schedule

    console = _console()
    console.print(f"candidate: {train_command(user_overrides, prediction)}", soft_wrap=True)
    console.print(f"predicted step {prediction.step_time_s * 1e3:.2f} ms (the pipeline's makespan "
                  f"{result.makespan:.2f} ms, then the data-parallel reduction), bubble {prediction.bubble_ratio:.1%}",
                  soft_wrap=True)
    console.print(memory_table(prediction.memory))
    sys.stdout.flush()
    print_schedule(result, None)


def memory_table(memory: Sequence[MemoryParts]):
    """Predicted bytes per pp rank by part, in GiB (every TP, CP and DP rank of a pp rank alike)."""
    from rich.table import Table

    table = Table(title="predicted memory per pp rank (GiB)")
    names = ("parameters", "gradients", "optimizer", "activations", "buffers", "total")
    for column in ("pp rank", *names):
        table.add_column(column, justify="right")
    for pp_rank, parts in enumerate(memory):
        values = parts.to_json()
        table.add_row(str(pp_rank), *(f"{values[name] / GIB:.3f}" for name in names))
    return table
