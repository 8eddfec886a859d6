"""The memory model against real-size ranks run in fake tensors (``ppctl check-memory``), as one markdown table.

For each model preset, three layouts each, six schedules (1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV, GPipe)
and the variants asked for (plain; the distributed optimizer; full recomputation; both), the chosen ranks of the
layout (``--ranks sample``: the first, a middle and the last pp rank; with ep > 1 the middle one at the last EP
rank) each run one training step at full size in this one process (``ppctl.run.fake_rank``), and one row per rank
gives its measured and predicted total and each part's difference (predicted / measured - 1). Asserts nothing;
rows print as they finish (flushed), a run ppctl refuses prints one row saying why.

    nice -n 5 .venv/bin/python benchmarks/memory_check.py [--models llama3_8b,gpt_small] [--layouts 0,1]
        [--schedules 1f1b,zbv] [--variants plain,both] [--ranks sample|all]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import names_in  # noqa: E402

# Each model's microbatch (one sequence of its usual length, in bf16) and three layouts: (name, overrides). The
# global batch gives each pipeline 2 * pp microbatches (GPipe then keeps all of them in flight). Layers divide
# into pp * 2 chunks for the schedules of two chunks a rank.
MODELS = {
    "llama3_8b": (["model=llama3_8b", "trainer.seq_length=8192", "trainer.precision=bf16"], [
        ("tp8 pp4 dp2 sp", ["parallel.tp=8", "parallel.pp=4", "parallel.dp=2", "parallel.sequence_parallel=true"]),
        ("tp4 pp8 dp1 sp", ["parallel.tp=4", "parallel.pp=8", "parallel.dp=1", "parallel.sequence_parallel=true"]),
        ("tp2 pp2 dp8", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=8"]),
    ]),
    "mixtral_8x7b": (["model=mixtral_8x7b", "trainer.seq_length=4096", "trainer.precision=bf16"], [
        ("tp1 pp4 dp8 ep8", ["parallel.tp=1", "parallel.pp=4", "parallel.dp=8", "parallel.ep=8"]),
        ("tp2 pp4 dp4 ep8 sp", ["parallel.tp=2", "parallel.pp=4", "parallel.dp=4", "parallel.ep=8",
                                "parallel.sequence_parallel=true"]),
        ("tp8 pp2 dp1 ep8 sp", ["parallel.tp=8", "parallel.pp=2", "parallel.dp=1", "parallel.ep=8",
                                "parallel.sequence_parallel=true"]),
    ]),
    "gpt_small": (["model=gpt_small", "trainer.seq_length=1024", "trainer.precision=bf16"], [
        ("pp2 dp4", ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4"]),
        ("tp2 pp3 dp2 sp", ["parallel.tp=2", "parallel.pp=3", "parallel.dp=2", "parallel.sequence_parallel=true"]),
        ("pp6 dp1", ["parallel.tp=1", "parallel.pp=6", "parallel.dp=1"]),
    ]),
}
SCHEDULES = {
    "1f1b": ["schedule=1f1b"],
    "interleaved": ["schedule=interleaved_1f1b", "parallel.vpp=2"],
    "zb_h1": ["schedule=zb_h1"],
    "zbv": ["schedule=zbv", "parallel.vpp=2"],
    "dualpipev": ["schedule=dualpipev", "parallel.vpp=2"],
    "gpipe": ["schedule=gpipe"],
}
VARIANTS = {
    "plain": [],
    "distributed": ["optimizer.distributed=true"],
    "recompute": ["model.recompute=full"],
    "both": ["optimizer.distributed=true", "model.recompute=full"],
}


def layout_sizes(layout: list[str]) -> list[str]:
    """The global batch of a layout: 2 * pp microbatches of one sequence on each pipeline."""
    sizes = dict(item.split("=") for item in layout)
    pp, dp = int(sizes["parallel.pp"]), int(sizes["parallel.dp"])
    return ["trainer.micro_batch_size=1", f"trainer.global_batch_size={2 * pp * dp}"]


def run_overrides(model: str, layout: list[str], schedule: str, variant: str) -> list[str]:
    """The overrides of one row group: the model's, the layout's, its batch, the schedule's and the variant's."""
    base, _ = MODELS[model]
    return ["data=synthetic", *base, *layout, *layout_sizes(layout), *SCHEDULES[schedule], *VARIANTS[variant]]


def check_one(overrides: list[str], ranks: str) -> list:
    """``ppctl check-memory``'s checks of one run (``ConfigError`` when ppctl refuses it)."""
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.run.fake_rank import check_ranks, chosen_ranks

    resolved = resolve(compose_config(overrides), data=False)
    return check_ranks(resolved, chosen_ranks(resolved, ranks))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments; argparse's one-line error (exit 2) for a name it does not know."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=names_in(MODELS), default=list(MODELS))
    parser.add_argument("--layouts", type=names_in("012"), default=["0", "1", "2"],
                        help="which of each model's three layouts (0, 1, 2; comma-separated)")
    parser.add_argument("--schedules", type=names_in(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--variants", type=names_in(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--ranks", choices=("sample", "all"), default="sample")
    return parser.parse_args(argv)


def main() -> None:
    """Parse the arguments, print the table's header, then each run's rows as they finish."""
    from ppctl.cli.memory_check_report import MARKDOWN_HEADER, markdown_rows
    from ppctl.config import ConfigError

    args = parse_args()
    print("\n".join(MARKDOWN_HEADER), flush=True)
    started = time.perf_counter()
    for model in args.models:
        for index in map(int, args.layouts):
            name, layout = MODELS[model][1][index]
            for schedule in args.schedules:
                for variant in args.variants:
                    label = f"{model} {name} {schedule} {variant}"
                    try:
                        checks = check_one(run_overrides(model, layout, schedule, variant), args.ranks)
                    except ConfigError as error:
                        print(f"| {label} | refused: {str(error)[:150]} |", flush=True)
                        continue
                    print("\n".join(markdown_rows(label, checks)), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
