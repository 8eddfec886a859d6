"""Distributed optimizer: optimizer memory per rank and step time against the plain optimizer, at several dp sizes.

For each dp size one launch of dp gloo workers (pp=1, tp=1) trains the same GPT three
ways, side by side:

* ``plain``: every rank keeps the fp32 parameters and the AdamW state of the whole model;
  gradients are all-reduced.
* ``distributed, overlap``: ZeRO-1 (``optimizer.distributed=true``) with several buckets,
  each bucket's reduce-scatter launched during the backward and each bucket's parameter
  all-gather waited for by the next forward.
* ``distributed, no overlap``: the same, every reduce-scatter issued after the backward
  and every all-gather waited for at the end of the step.

Optimizer memory is ``optimizer.state_bytes()`` after the warm-up steps (AdamW creates its
state at the first step): the fp32 main parameters and AdamW state a rank holds, the
largest over ranks. Step time is the wall time of ``Trainer.train_step``; the variants
take turns in blocks of steps so that a slow moment of a shared machine falls on all of
them, and each step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import at_least, check_ppctl_config, positive_int  # noqa: E402
from tests.harness.spawn import run_workers  # noqa: E402

VARIANTS = {
    "plain": ["optimizer.distributed=false"],
    "distributed, overlap": ["optimizer.distributed=true", "optimizer.overlap_grad_reduce=true",
                             "optimizer.overlap_param_gather=true"],
    "distributed, no overlap": ["optimizer.distributed=true", "optimizer.overlap_grad_reduce=false",
                                "optimizer.overlap_param_gather=false"],
}

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "model.ffn_hidden_size=1024",
         "trainer.seq_length=64", "trainer.micro_batch_size=1"]


def variant_overrides(dp: int, variant: str, bucket_size: int, extra: list[str]) -> list[str]:
    """The full override list of one variant at data-parallel size ``dp`` (4 microbatches per rank)."""
    return ["parallel=single", "parallel.pp=1", f"parallel.dp={dp}", "data=synthetic", "trainer.tensorboard=false",
            *MODEL, f"trainer.global_batch_size={4 * dp}", f"optimizer.bucket_size={bucket_size}",
            *VARIANTS[variant], *extra]


def build_trainers(runs: dict[str, list[str]]) -> dict:
    """One ``Trainer`` per variant; all share one parallel context (they have one layout)."""
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    contexts, trainers = {}, {}
    for name, overrides in runs.items():
        run = resolve(compose_config(overrides))
        if run.layout not in contexts:
            contexts[run.layout] = build_parallel_context(run.layout, 60)
        trainers[name] = Trainer(run, contexts[run.layout])
    return trainers


def timed_block(trainer, first_step: int, steps: int) -> list[float]:
    """Seconds of ``steps`` consecutive steps, every all-gather in flight finished before returning.

    With ``overlap_param_gather`` the last step's all-gathers are normally waited for by
    the next forward. Another variant runs next, so they are waited for here and their
    time is charged to the last step, as the next forward of a real run would pay it.
    """
    durations = [trainer.train_step(first_step + index).step_time_s for index in range(steps)]
    started = time.perf_counter()
    trainer.optimizer.sync_parameters()
    durations[-1] += time.perf_counter() - started
    return durations


def measure_worker(rank: int, world_size: int, runs: dict[str, list[str]], warmup: int, rounds: int,
                   steps: int) -> dict[str, dict]:
    """On one dp rank: ``{variant: {"state_bytes", "buckets", "durations"}}`` (durations in seconds, by step)."""
    trainers = build_trainers(runs)
    next_step = {name: 0 for name in runs}
    for name, trainer in trainers.items():
        timed_block(trainer, 0, warmup)
        next_step[name] = warmup
    results = {name: {"state_bytes": trainer.optimizer.state_bytes(),
                      "buckets": len(getattr(trainer.optimizer, "buckets", ())),
                      "durations": []} for name, trainer in trainers.items()}
    for _ in range(rounds):
        for name, trainer in trainers.items():  # variants take turns, a block of steps each
            results[name]["durations"] += timed_block(trainer, next_step[name], steps)
            next_step[name] += steps
    return results


def measure(dp: int, args) -> dict[str, dict]:
    """Launch ``dp`` workers; per variant: the largest state bytes over ranks, buckets, median step seconds.

    A step's time is the slowest rank's (the ranks meet in every collective), then the
    median over the timed steps.
    """
    runs = {name: variant_overrides(dp, name, args.bucket_size, args.overrides) for name in VARIANTS}
    per_rank = run_workers(measure_worker, dp, runs, args.warmup, args.rounds, args.steps, timeout=1800)
    summary = {}
    for name in runs:
        step_seconds = [max(steps) for steps in zip(*(result[name]["durations"] for result in per_rank))]
        summary[name] = {"state_bytes": max(result[name]["state_bytes"] for result in per_rank),
                         "buckets": per_rank[0][name]["buckets"],
                         "median_s": statistics.median(step_seconds)}
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one, or a variant ppctl refuses with them, is
    argparse's error, exit 2, before any worker starts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=positive_int, nargs="+", default=[2, 4],
                        help="data-parallel sizes (one launch each)")
    parser.add_argument("--warmup", type=at_least(1, "AdamW creates its state at the first step"), default=2,
                        help="untimed steps per variant (at least 1: AdamW state exists after the first step)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="turns each variant takes")
    parser.add_argument("--steps", type=positive_int, default=4, help="timed steps per variant per round")
    parser.add_argument("--bucket-size", type=positive_int, default=200_000,
                        help="optimizer.bucket_size (elements) of the distributed variants")
    parser.add_argument("overrides", nargs="*", default=[], help="further config overrides for every variant")
    args = parser.parse_args(argv)
    for dp in args.dp:
        for variant in VARIANTS:
            check_ppctl_config(parser, variant_overrides(dp, variant, args.bucket_size, args.overrides))
    return args


def main() -> None:
    """Parse options, measure every dp size, print the table."""
    args = parse_args()
    rows = {dp: measure(dp, args) for dp in args.dp}
    print_table(args, rows)


def print_table(args, rows: dict[int, dict[str, dict]]) -> None:
    """Optimizer MiB per rank and median step time, each with its ratio to the plain optimizer at the same dp."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Optimizer memory and step time: {' '.join(MODEL)}, 4 microbatches per rank, "
                        f"bucket_size {args.bucket_size:,}; median of {args.rounds} x {args.steps} steps after "
                        f"{args.warmup} warm-up")
    for column in ("dp", "variant", "buckets", "optimizer MiB / rank", "ratio", "1/dp", "median step ms", "ratio"):
        table.add_column(column, justify="right")
    for dp, summary in rows.items():
        plain = summary["plain"]
        for name, row in summary.items():
            table.add_row(str(dp), name, str(row["buckets"] or "-"), f"{row['state_bytes'] / 2**20:.2f}",
                          f"{row['state_bytes'] / plain['state_bytes']:.3f}", f"{1 / dp:.3f}",
                          f"{1000 * row['median_s']:.1f}", f"{row['median_s'] / plain['median_s']:.3f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
