"""PipeDream-2BW's stream against 1F1B with the same delayed update: step time, side by side in one launch.

Both variants compute the same thing (``optimizer.gradient_delay=1``, no clipping, the same
data): ``1f1b`` flushes the pipeline at every step, ``pipedream_2bw`` runs each block of K
steps as one stream (the fill once, then each rank updating after its last backward of a
step). One launch of pp gloo workers trains both; they take turns in blocks of K steps so
that a slow moment of a shared machine falls on both, and a block's time is the slowest
rank's. The losses of the two must agree (the same work), else the script stops.

With equal F and B per microbatch, 1F1B's step takes (m + pp - 1)(F+B) and a stream of K
steps (K m + pp - 1)(F+B): the ideal ratio printed beside the measured one.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import check_ppctl_config, positive_int  # noqa: E402
from tests.harness.spawn import run_workers  # noqa: E402

DELAYED = ["optimizer.gradient_delay=1", "optimizer.clip_grad=0"]
VARIANTS = {"1f1b": ["schedule=1f1b", *DELAYED], "pipedream_2bw": ["schedule=pipedream_2bw", *DELAYED]}
MODEL = ["model.num_layers=8", "model.hidden_size=256", "model.num_heads=4", "model.ffn_hidden_size=1024",
         "trainer.seq_length=64", "trainer.micro_batch_size=1"]


def variant_overrides(pp: int, microbatches: int, block: int, variant: str, extra: list[str]) -> list[str]:
    """The full override list of one variant: ``pp`` stages, ``microbatches`` per step, streams of ``block``."""
    return [f"parallel.pp={pp}", "data=synthetic", "trainer.tensorboard=false", *MODEL,
            f"trainer.global_batch_size={microbatches}", f"schedule.stream_steps={block}", *VARIANTS[variant],
            "launcher.threads_per_worker=1", *extra]


def build_trainers(runs: dict[str, list[str]]) -> dict:
    """One ``Trainer`` per variant on one parallel context (they share the layout)."""
    import torch

    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    torch.set_num_threads(1)
    context, trainers = None, {}
    for name, overrides in runs.items():
        run = resolve(compose_config(overrides))
        context = context or build_parallel_context(run.layout, 120)
        trainers[name] = Trainer(run, context)
    return trainers


def measure_worker(rank: int, world_size: int, runs: dict[str, list[str]], block: int, rounds: int) -> dict:
    """On one pp rank: ``{variant: {"seconds": [per block], "losses": [per step]}}`` after one untimed block."""
    trainers = build_trainers(runs)
    results = {name: {"seconds": [], "losses": []} for name in runs}
    for round_index in range(rounds + 1):
        for name, trainer in trainers.items():  # the variants take turns, a block of steps each
            started = time.perf_counter()
            steps = trainer.train_steps(round_index * block, block)
            if round_index:  # the first block warms up (AdamW state, buffers, the stream's program)
                results[name]["seconds"].append(time.perf_counter() - started)
            results[name]["losses"] += [step.loss for step in steps]
    return results


def summarise(per_rank: list[dict], block: int) -> dict[str, float]:
    """Median seconds per step per variant (each block the slowest rank's); refuses different losses."""
    loss_rank = next(result for result in per_rank if result["1f1b"]["losses"][0] is not None)
    flushed, streamed = loss_rank["1f1b"]["losses"], loss_rank["pipedream_2bw"]["losses"]
    for step, (a, b) in enumerate(zip(flushed, streamed, strict=True)):
        if not math.isclose(a, b, rel_tol=1e-5):
            raise SystemExit(f"step {step}: 1f1b's loss {a} and pipedream_2bw's {b} differ: not the same work")
    return {name: statistics.median(max(blocks) / block for blocks in zip(*(r[name]["seconds"] for r in per_rank)))
            for name in VARIANTS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one, or a variant ppctl refuses with them, is
    argparse's error, exit 2, before any worker starts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (gloo workers)")
    parser.add_argument("--microbatches", type=positive_int, default=8, help="microbatches per step (m >= pp)")
    parser.add_argument("--block", type=positive_int, default=8, help="steps per block: one stream for pipedream_2bw")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed blocks per variant")
    parser.add_argument("overrides", nargs="*", default=[], help="further config overrides for both variants")
    args = parser.parse_args(argv)
    for variant in VARIANTS:
        check_ppctl_config(parser, variant_overrides(args.pp, args.microbatches, args.block, variant, args.overrides))
    return args


def main() -> None:
    """Parse options, measure, print medians and ratios."""
    args = parse_args()
    runs = {name: variant_overrides(args.pp, args.microbatches, args.block, name, args.overrides)
            for name in VARIANTS}
    per_rank = run_workers(measure_worker, args.pp, runs, args.block, args.rounds, timeout=3600)
    medians = summarise(per_rank, args.block)
    m, pp, k = args.microbatches, args.pp, args.block
    ideal = (k * m + pp - 1) / (k * (m + pp - 1))
    print(f"pp={pp}, m={m}, streams of {k} steps, {' '.join(MODEL)}; median of {args.rounds} blocks, each the "
          f"slowest rank's; losses equal")
    print(f"1f1b (flush every step): {medians['1f1b'] * 1e3:.1f} ms/step")
    print(f"pipedream_2bw (stream):  {medians['pipedream_2bw'] * 1e3:.1f} ms/step")
    print(f"ratio 2bw / 1f1b: {medians['pipedream_2bw'] / medians['1f1b']:.3f} "
          f"(ideal at equal F and B: {ideal:.3f})")


if __name__ == "__main__":
    main()
