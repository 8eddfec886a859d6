"""Context-parallel attention: peak attention memory and step time per rank, by mode and cp size.

The total sequence length is fixed; each cp size runs on that many gloo workers, each
holding its ``seq / cp`` tokens. Every worker measures, for every mode in one run:

* peak attention memory: the most bytes that tensors allocated inside one attention
  forward + backward held at once (gathered or received key/value blocks, scores,
  softmax statistics, buffers in flight, the output and the input gradients; not the
  inputs themselves). It is measured, not computed: a ``TorchDispatchMode`` sees the
  output of every operation, counts each new storage once and subtracts it when the
  storage is freed. Scratch space inside a fused kernel (SDPA's own tiles) is not an
  operation output and is not seen.
* the median wall time of forward + backward over several repeats, the modes taking
  turns so that noise falls on all of them alike.

At cp=1 every mode is ``F.scaled_dot_product_attention(..., is_causal=True)``: one row,
the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import non_negative_int, positive_int  # noqa: E402
from ppctl.parallel.context_parallel import CP_COMM_MODES, CPGroup, context_parallel_attention  # noqa: E402
from ppctl.run.memory import StoragePeak  # noqa: E402
from tests.harness.spawn import run_workers  # noqa: E402


def attention_step(inputs: list[torch.Tensor], grad_out: torch.Tensor, cp: CPGroup) -> None:
    """One forward and backward of context-parallel attention; the input gradients are left in ``.grad``."""
    for tensor in inputs:
        tensor.grad = None
    out = context_parallel_attention(*inputs, cp)
    out.backward(grad_out)


def peak_attention_bytes(inputs: list[torch.Tensor], grad_out: torch.Tensor, cp: CPGroup) -> int:
    """Peak bytes of what one attention step allocates (the previous step's gradients freed first)."""
    for tensor in inputs:
        tensor.grad = None
    with StoragePeak([*inputs, grad_out]) as tracker:
        attention_step(inputs, grad_out, cp)
        for tensor in inputs:  # the gradients are the step's output: counted, then let go inside the mode
            tensor.grad = None
    return tracker.peak_bytes


def measure_worker(rank: int, world_size: int, modes: tuple[str, ...], shape: tuple[int, int, int, int],
                   repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    """On one of ``world_size`` CP ranks: ``{mode: {"peak_bytes", "median_ms"}}``."""
    batch, heads, seq, head_dim = shape
    generator = torch.Generator().manual_seed(rank)
    local_shape = (batch, heads, seq // world_size, head_dim)
    inputs = [torch.randn(local_shape, generator=generator).requires_grad_() for _ in range(3)]
    grad_out = torch.randn(local_shape, generator=generator)
    ranks = tuple(range(world_size))
    groups = {mode: CPGroup(dist.group.WORLD if world_size > 1 else None, world_size, rank,
                            ranks if world_size > 1 else (), mode) for mode in modes}
    durations = {mode: [] for mode in modes}
    for repeat in range(warmup + repeats):
        for mode in modes:  # modes take turns: a slow moment of the machine hits them all
            dist.barrier()
            started = time.perf_counter()
            attention_step(inputs, grad_out, groups[mode])
            if repeat >= warmup:
                durations[mode].append(time.perf_counter() - started)
    return {mode: {"peak_bytes": peak_attention_bytes(inputs, grad_out, groups[mode]),
                   "median_ms": 1000 * statistics.median(durations[mode])} for mode in modes}


def runnable_modes(cp_size: int, heads: int, seq: int) -> tuple[str, ...]:
    """The modes to measure at ``cp_size`` (one stands for all at cp=1; a2a needs heads divisible by cp)."""
    if seq % (2 * cp_size):
        return ()
    if cp_size == 1:
        return (CP_COMM_MODES[0],)
    return tuple(mode for mode in CP_COMM_MODES if mode != "a2a" or heads % cp_size == 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one is argparse's error, exit 2, before any worker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=positive_int, default=2304, help="total sequence length (a multiple of 2*cp)")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=12, help="12: a2a works at cp 2, 3 and 4")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--cp", type=positive_int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    args = parser.parse_args(argv)
    if not any(runnable_modes(cp_size, args.heads, args.seq) for cp_size in args.cp):
        parser.error(f"--seq {args.seq} is not a multiple of 2 x any --cp size ({' '.join(map(str, args.cp))}): "
                     f"nothing to measure")
    return args


def main() -> None:
    """Parse options, measure every cp size, print the table."""
    args = parse_args()
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    rows = {}
    for cp_size in args.cp:
        modes = runnable_modes(cp_size, args.heads, args.seq)
        if not modes:
            print(f"cp={cp_size}: skipped, seq {args.seq} is not a multiple of {2 * cp_size}")
            continue
        per_rank = run_workers(measure_worker, cp_size, modes, shape, args.repeats, args.warmup, timeout=1800)
        for mode in modes:
            rows[(mode if cp_size > 1 else "any (SDPA)", cp_size)] = (
                max(result[mode]["peak_bytes"] for result in per_rank),
                max(result[mode]["median_ms"] for result in per_rank))
    print_table(args, rows)


def print_table(args, rows: dict[tuple[str, int], tuple[int, float]]) -> None:
    """Peak bytes per rank (max over ranks), their ratio to cp=1, median step time."""
    from rich.console import Console
    from rich.table import Table

    baseline = next((peak for (_, cp_size), (peak, _) in rows.items() if cp_size == 1), None)
    table = Table(title=f"CP attention, float32: batch {args.batch} x {args.heads} heads x seq {args.seq} x "
                        f"head_dim {args.head_dim}; forward + backward, median of {args.repeats}")
    for column in ("mode", "cp", "peak bytes / rank", "ratio to cp=1", "1/cp", "median ms"):
        table.add_column(column, justify="right")
    for (mode, cp_size), (peak, milliseconds) in sorted(rows.items(), key=lambda item: (item[0][0] != "any (SDPA)",
                                                                                       item[0][0], item[0][1])):
        ratio = f"{peak / baseline:.3f}" if baseline else "-"
        table.add_row(mode, str(cp_size), f"{peak:,}", ratio, f"{1 / cp_size:.3f}", f"{milliseconds:.1f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
