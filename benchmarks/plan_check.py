"""``ppctl plan``'s predicted step times against ``ppctl bench``'s measured ones, on this machine's gloo workers.

One ``ppctl bench --against none`` run calibrates the device (its throughput, message time and
the runtime's time between actions: ``ppctl plan --calibrate``); then a fixed list of
candidates on ``--workers`` workers (2 or 4), chosen before any measurement to differ in tp, pp, dp,
schedule and recomputation, is predicted by the planner's own functions and measured by
``ppctl bench --against none`` (median step of R blocks). Prints each candidate's predicted and
measured step time with the error and how far apart its measured blocks were, the mean absolute
error, the rank correlation of the two orders (Spearman) and the blocks' median spread. Asserts
nothing.

    .venv/bin/python benchmarks/plan_check.py [--workers 2|4] [--steps 3] [--repeats 3] [--recalibrate]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.args import positive_int  # noqa: E402

MODEL = ["data=synthetic", "model.num_layers=8", "model.hidden_size=256", "model.num_heads=4",
         "model.ffn_hidden_size=1024", "model.tie_embeddings=false", "trainer.seq_length=64",
         "trainer.global_batch_size=16", "launcher.threads_per_worker=1", "trainer.tensorboard=false"]
# Per number of workers: the calibration run, then (tp, cp, pp, vpp, dp, schedule, micro-batch size, recompute,
# distributed optimizer) of each candidate, fixed before measuring. Two workers have a core each on the 2-core
# machine; four share two cores, which the calibration records (bench.json's ``cores``) and the planner then models
# (``Device.cores``: a processor-sharing replay).
CALIBRATION = {2: ["parallel.pp=2", "schedule=1f1b", "trainer.micro_batch_size=1"],
               4: ["parallel.pp=4", "schedule=1f1b", "trainer.micro_batch_size=1"]}
CANDIDATES = {
    2: [
        (1, 1, 2, 1, 1, "1f1b", 1, "none", False),
        (1, 1, 2, 1, 1, "gpipe", 1, "none", False),
        (1, 1, 2, 2, 1, "zbv", 1, "none", False),
        (1, 1, 2, 1, 1, "1f1b", 1, "full", False),
        (1, 1, 2, 2, 1, "interleaved_1f1b", 1, "none", False),
        (1, 1, 2, 1, 1, "zb_h1", 2, "none", False),
        (1, 1, 1, 1, 2, "1f1b", 1, "none", False),
        (1, 1, 1, 1, 2, "1f1b", 2, "none", True),
        (2, 1, 1, 1, 1, "1f1b", 1, "none", False),
        (2, 1, 1, 1, 1, "1f1b", 1, "selective", False),
    ],
    4: [
        (1, 1, 4, 1, 1, "1f1b", 1, "none", False),
        (1, 1, 4, 1, 1, "gpipe", 1, "none", False),
        (1, 1, 4, 2, 1, "zbv", 1, "none", False),
        (1, 1, 4, 1, 1, "1f1b", 1, "full", False),
        (1, 1, 2, 1, 2, "1f1b", 1, "none", False),
        (1, 1, 2, 2, 2, "interleaved_1f1b", 1, "none", True),
        (2, 1, 2, 1, 1, "1f1b", 1, "none", False),
        (1, 1, 1, 1, 4, "1f1b", 2, "none", False),
        (2, 1, 1, 1, 2, "1f1b", 1, "selective", False),
        (1, 1, 4, 1, 1, "zb_h1", 2, "none", False),
    ],
}

def bench(overrides: list[str], out_dir: Path, steps: int, repeats: int) -> dict:
    """One ``ppctl bench --against none`` launch; its JSON entry."""
    command = [sys.executable, "-m", "ppctl.cli.app", "bench", *MODEL, *overrides, f"trainer.out_dir={out_dir}",
               "--against", "none", "--steps", str(steps), "--repeats", str(repeats), "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])[0]


def spearman(first: list[float], second: list[float]) -> float:
    """Rank correlation of two lists (no ties expected)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0] * len(values)
        for rank, index in enumerate(order):
            result[index] = rank
        return result

    a, b = ranks(first), ranks(second)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one is argparse's error, exit 2, before any run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--workers", type=int, choices=sorted(CANDIDATES), default=2)
    parser.add_argument("--recalibrate", action="store_true",
                        help="calibrate again right before each candidate (twice the time): its prediction then "
                             "uses figures measured in the same minute, not the machine's speed minutes earlier")
    return parser.parse_args(argv)


def main() -> None:
    """Calibrate, then predict and measure every candidate; print each and the summary."""
    args = parse_args()

    from ppctl.resolve import compose_config
    from ppctl.plan.search import Candidate, predict

    work = Path(tempfile.mkdtemp(prefix="plan_check_"))
    base = compose_config(MODEL)
    device, calibration_entry = calibrate(args, work / "calibration")
    rows = []
    for index, fields in enumerate(CANDIDATES[args.workers]):
        candidate = Candidate(*fields)
        if args.recalibrate and index:
            device, _ = calibrate(args, work / f"calibration_{index}")
        predicted = predict(base, candidate, device).step_time_s
        entry = bench(candidate.overrides(), work / f"candidate_{index}", args.steps, args.repeats)
        measured, spread = entry["ppctl_step_s"], block_spread(entry)
        rows.append((candidate, predicted, measured, spread))
        print(f"{' '.join(candidate.overrides())}: predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} "
              f"ms (blocks {spread:.0%} apart), error {predicted / measured - 1:+.1%}", flush=True)
    errors = [abs(predicted / measured - 1) for _, predicted, measured, _ in rows]
    print(f"mean absolute error {statistics.mean(errors):.1%}, largest {max(errors):.1%}, rank correlation "
          f"{spearman([p for _, p, _, _ in rows], [m for _, _, m, _ in rows]):.2f} over {len(rows)} candidates; "
          f"the measured blocks of a candidate {statistics.median(spread for *_, spread in rows):.0%} apart "
          "(median), the first calibration's "
          f"{block_spread(calibration_entry):.0%}")


def calibrate(args, out_dir: Path):
    """One ``ppctl bench`` of the calibration layout into ``out_dir``: the device it calibrates, and its entry."""
    from ppctl.cli.calibrate import calibration_of
    from ppctl.plan.search import DEVICES, calibrated_device

    entry = bench(CALIBRATION[args.workers], out_dir, args.steps, args.repeats)
    calibration = calibration_of(out_dir, "1f1b")
    device = calibrated_device(DEVICES["h100"], calibration, calibration.measured_config())
    print(f"calibration: {' '.join(CALIBRATION[args.workers])}: {entry['ppctl_step_s'] * 1e3:.1f} ms per step; "
          f"device {device.describe()}", flush=True)
    return device, entry


def block_spread(entry: dict) -> float:
    """How far apart a measurement's blocks were: (slowest - fastest) / median, the measurement's own noise."""
    blocks = entry["ppctl_blocks_s"]
    return (max(blocks) - min(blocks)) / statistics.median(blocks)


if __name__ == "__main__":
    main()
