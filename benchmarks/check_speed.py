"""Speed of the lowering, the schedule checker and the simulator on large schedules.

For each case the table shows the median wall time, over several repeats, of
``lower`` (the program with its sends and receives), ``check_schedule`` and ``simulate`` (unit costs). The checker
runs at config validation on every ``train``, so its time at pp=64 with 512
microbatches is the one to watch. Times on a shared CPU are noisy: compare them
side by side from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import positive_int  # noqa: E402
from ppctl.pipeline.check import check_schedule  # noqa: E402
from ppctl.pipeline.program import lower  # noqa: E402
from ppctl.pipeline.schedules import Schedule, build_schedule  # noqa: E402
from ppctl.pipeline.simulate import simulate  # noqa: E402

CASES = [  # (schedule, pp, vpp, microbatches)
    ("1f1b", 64, 1, 512),
    ("interleaved_1f1b", 64, 2, 512),
    ("gpipe", 8, 1, 64),
]
MEASURED: dict[str, Callable[[Schedule], object]] = {
    "lower": lower,
    "check_schedule": check_schedule,
    "simulate": simulate,
}


def median_seconds(function: Callable[[Schedule], object], schedule: Schedule, repeats: int) -> float:
    """Median wall time of ``function(schedule)`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function(schedule)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one is argparse's error, exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5, help="calls per function and case (default 5)")
    return parser.parse_args(argv)


def main() -> None:
    """Print one row per case: its size and the median milliseconds of each measured function."""
    args = parse_args()
    header = f"{'schedule':<18} {'pp':>3} {'vpp':>3} {'mb':>4} {'actions':>8}" + "".join(
        f" {name + ' ms':>21}" for name in MEASURED)
    print(header)
    print("-" * len(header))
    for name, pp, vpp, num_microbatches in CASES:
        schedule = build_schedule(name, pp, vpp, num_microbatches)
        actions = sum(len(rank_actions) for rank_actions in schedule.actions)
        cells = [f" {median_seconds(function, schedule, args.repeats) * 1e3:>21.1f}" for function in MEASURED.values()]
        print(f"{name:<18} {pp:>3} {vpp:>3} {num_microbatches:>4} {actions:>8}" + "".join(cells))


if __name__ == "__main__":
    main()
