"""Exposed expert all-to-all per step at ep=2: measured in traces beside the simulator's prediction.

Each variant trains a Mixtral-like model (``model=mixtral_tiny`` widened, 8 experts top-2 on every layer) at
pp=2 dp=2 ep=2 on 4 gloo workers with ``trainer.trace=true``, under 1F1B, ZB-V (plain, and with its W's filling
the all-to-all waits of the backwards beside them: ``parallel.overlap_ep_comm=true``) and DualPipeV (its pairs one
half after the other, the default, and interleaved: ``parallel.overlap_ep_comm=true``, ``ppctl.pipeline.interleave``).
From each traced step (the first, warm-up, left out) it reads per rank:

- the all-to-all time (every dispatch and combine, both directions: the ``a2a`` spans the tracer records);
- the exposed all-to-all: the part during which the rank computed nothing (``ppctl.pipeline.trace
  .exposed_exchange_seconds``: an action computes over its span less its own lane's exchanges, or over its pieces
  where the interleave ran it);
- the step time (first action's start to last action's end, the slowest rank).

The prediction: the costs fitted from the same trace (each action kind's mean time less the mean all-to-all an
action of that kind waited, and that all-to-all as ``A2A``), simulated by ``ppctl.pipeline.simulate`` for the
schedule, whose ``exposed_exchanges`` gives each rank's exposed all-to-all. Figures are medians over steps of the
mean over ranks, in ms. Four workers share the machine's cores: every figure moves with what else runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import at_least, check_ppctl_config, positive_int  # noqa: E402

VARIANTS = {  # label -> the overrides that make it
    "1f1b": ["schedule=1f1b"],
    "zbv": ["schedule=zbv"],
    "zbv, weight fills": ["schedule=zbv", "parallel.overlap_ep_comm=true"],
    "dualpipev, pairs in turn": ["schedule=dualpipev"],
    "dualpipev, pairs interleaved": ["schedule=dualpipev", "parallel.overlap_ep_comm=true"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one, or a variant ppctl refuses with them, is
    argparse's error, exit 2, before any run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(2, "the first step warms up and is left out"), default=6)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--microbatches", type=positive_int, default=8, help="global batch (micro batch 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    for variant in VARIANTS.values():
        check_ppctl_config(parser, overrides_of(args, variant, Path(tempfile.gettempdir()) / "moe_overlap"))
    return args


def overrides_of(args, variant: list[str], out_dir: Path) -> list[str]:
    """The ``ppctl train`` overrides of one variant."""
    return ["data=synthetic", "model=mixtral_tiny", f"model.hidden_size={args.hidden}",
            f"model.ffn_hidden_size={2 * args.hidden}", f"model.max_seq_length={args.seq}",
            f"trainer.seq_length={args.seq}", "trainer.micro_batch_size=1",
            f"trainer.global_batch_size={args.microbatches}", f"trainer.max_steps={args.steps}",
            "trainer.trace=true", "trainer.tensorboard=false", "trainer.log_every=100",
            "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", f"trainer.out_dir={out_dir}", *variant]


def traced_steps(trace: dict) -> dict[int, dict[int, dict]]:
    """step -> rank -> ``{actions: [(kind, start, end)], exchanges: [(start, end, lane)], pieces: [(half, start,
    end)]}`` (seconds)."""
    from ppctl.pipeline.trace import EXCHANGE_CATEGORY, PIECE_CATEGORY

    steps: dict[int, dict[int, dict]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or "step" not in event.get("args", {}):
            continue
        rank = steps.setdefault(event["args"]["step"], {}).setdefault(event["tid"],
                                                                      {"actions": [], "exchanges": [], "pieces": []})
        start, end = event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6
        if event["cat"] == EXCHANGE_CATEGORY:
            rank["exchanges"].append((start, end, 1 if event["args"]["lane"] == "backward" else 0))
        elif event["cat"] == PIECE_CATEGORY:
            rank["pieces"].append((event["name"].removesuffix(" piece"), start, end))
        elif event["cat"] != "wait":
            rank["actions"].append((event["cat"], start, end))
    return steps


def measured(step: dict[int, dict]) -> dict[str, float]:
    """One step's mean over ranks of the all-to-all and exposed all-to-all, and its time, in ms."""
    from ppctl.pipeline.trace import exposed_exchange_seconds

    ranks = list(step.values())
    total = statistics.mean(sum(end - start for start, end, _ in rank["exchanges"]) for rank in ranks)
    exposed = statistics.mean(exposed_exchange_seconds(rank["actions"], rank["exchanges"], rank["pieces"])
                              for rank in ranks)
    time = max(max(end for *_, end in rank["actions"]) - min(start for _, start, _ in rank["actions"])
               for rank in ranks)
    return {"a2a_ms": total * 1e3, "exposed_ms": exposed * 1e3, "step_ms": time * 1e3}


def fitted_costs(step: dict[int, dict], chunks_per_copy: int, pairs_at_once: bool):
    """Costs (ms per microbatch through a rank's layers) of one step (``ppctl.pipeline.trace.exchange_costs``)."""
    from ppctl.pipeline.trace import exchange_costs

    return exchange_costs([(rank["actions"], rank["exchanges"], rank["pieces"]) for rank in step.values()],
                          chunks_per_copy, pairs_at_once)


def predicted_exposed_ms(schedule, costs) -> float:
    """The simulator's mean over ranks of the exposed all-to-all, in ms, for the pairs run at once or in turn."""
    from ppctl.pipeline.simulate import simulate
    return statistics.mean(simulate(schedule, costs).exposed_exchanges())


def run_variant(args, label: str, variant: list[str], root: Path) -> dict:
    """Train one variant; its measured and predicted figures."""
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve

    out_dir = root / label.replace(",", "").replace(" ", "_")
    overrides = overrides_of(args, variant, out_dir)
    result = subprocess.run([sys.executable, "-m", "ppctl.cli.app", "train", *overrides], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label}: ppctl train failed: {result.stderr.strip().splitlines()[-1]}")
    schedule = resolve(compose_config(overrides)).schedule
    steps = traced_steps(json.loads((out_dir / "trace.json").read_text()))
    kept = [steps[step] for step in sorted(steps)[1:]]  # step 0 warms up
    figures = [measured(step) for step in kept]
    predictions = []
    for step in kept:
        costs = fitted_costs(step, schedule.chunks_per_copy, "parallel.overlap_ep_comm=true" in variant)
        predictions.append(predicted_exposed_ms(schedule, costs))
    median = {key: statistics.median(figure[key] for figure in figures) for key in figures[0]}
    spread = {key: (min(figure[key] for figure in figures), max(figure[key] for figure in figures))
              for key in figures[0]}
    return {"variant": label, **median, "spread": spread, "predicted_exposed_ms": statistics.median(predictions),
            "steps": len(figures)}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as root:
        rows = [run_variant(args, label, variant, Path(root)) for label, variant in VARIANTS.items()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"pp=2 dp=2 ep=2, mixtral_tiny at hidden {args.hidden}, {args.microbatches} microbatches of 1 x {args.seq} "
          f"tokens; medians over {rows[0]['steps']} steps (min-max), ms, mean over ranks")
    print(f"{'variant':<26} {'step':>18} {'all-to-all':>18} {'exposed':>18} {'predicted exposed':>18}")
    for row in rows:
        cells = [f"{row[key]:7.1f} ({row['spread'][key][0]:.0f}-{row['spread'][key][1]:.0f})"
                 for key in ("step_ms", "a2a_ms", "exposed_ms")]
        print(f"{row['variant']:<26} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} {row['predicted_exposed_ms']:18.1f}")


if __name__ == "__main__":
    main()
