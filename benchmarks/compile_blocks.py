"""Transformer blocks compiled (``trainer.compile``) against eager, whole and split backward, on one middle GPT chunk.

Each variant is a ``PipelineStage`` over its own chunk (the same weights) of ``--layers`` GPT layers, no embedding
and no loss, timed in turns (one round runs every variant once; the table shows medians over rounds):

- ``eager BW`` / ``compiled BW``: forward then whole backward, the layers' PyTorch ops (what a schedule without a
  B/W split runs), eager or each layer compiled (``ppctl.model.compiled.compile_blocks``: the linears inside the
  graph);
- ``compiled BW, split ops eager``: the same whole backward through a stage that can split (its linears and norms
  are the split ops, outside the graph): what leaving them out of the graph costs;
- ``eager F+B+W`` / ``compiled F+B+W``: forward, B (input gradient), then W (weight gradients), as zero-bubble
  schedules run them.

A compiled variant's first round (its compilation, included in nothing else) is reported apart; rounds after it
are the warm-up and the timed ones. Run both sizes: ``--layers 1`` (a block) and ``--layers 4`` (a chunk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import parse_block_args
from ppctl.model.compiled import compile_blocks  # noqa: E402
from ppctl.model.gpt.model import GPTChunk, GPTConfig  # noqa: E402
from ppctl.parallel.layout import StageLayers  # noqa: E402
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec  # noqa: E402

KEY = 0  # the microbatch
# name -> (compiled, stage can split, backward run as B then W)
VARIANTS = {
    "eager BW": (False, False, False),
    "compiled BW": (True, False, False),
    "compiled BW, split ops eager": (True, True, False),
    "eager F+B+W": (False, True, True),
    "compiled F+B+W": (True, True, True),
}


def middle_stage(args, compiled: bool, split_backward: bool) -> PipelineStage:
    """A stage of ``args.layers`` GPT layers receiving and sending hidden states; compiled blocks when asked."""
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                       ffn_hidden_size=4 * args.hidden, vocab_size=256, max_seq_length=args.seq)
    chunk = GPTChunk(config, StageLayers(0, tuple(range(args.layers)), False, False), seed=0)
    if compiled:
        compile_blocks(chunk)
    spec = TensorSpec((args.micro_batch, args.seq, args.hidden), torch.float32)
    return PipelineStage(1, chunk, StageIO(input=spec, output=spec, fields=()),
                         lambda module, stage_input, _microbatch: module(stage_input), is_last=False,
                         split_backward=split_backward)


def one_step(stage: PipelineStage, split: bool, stage_input: torch.Tensor, grad_output: torch.Tensor) -> float:
    """Milliseconds of one microbatch's forward and backward (whole, or B then W) through ``stage``."""
    started = time.perf_counter()
    stage.forward(KEY, None, stage_input.clone(), None)
    if split:
        stage.backward_input(KEY, grad_output)
        stage.backward_weight(KEY)
    else:
        stage.backward(KEY, grad_output)
    elapsed = 1000 * (time.perf_counter() - started)
    stage.module.zero_grad(set_to_none=True)
    return elapsed


def measure(args) -> tuple[dict[str, float], dict[str, float]]:
    """Every variant's first call (compilation included) and its median step after the warm-up, in ms."""
    stages = {name: (middle_stage(args, compiled, can_split), split)
              for name, (compiled, can_split, split) in VARIANTS.items()}
    generator = torch.Generator().manual_seed(0)
    stage_input = torch.randn((args.micro_batch, args.seq, args.hidden), generator=generator)
    grad_output = torch.randn(stage_input.shape, generator=generator)
    first = {name: one_step(stage, split, stage_input, grad_output) for name, (stage, split) in stages.items()}
    rounds = [{name: one_step(stage, split, stage_input, grad_output) for name, (stage, split) in stages.items()}
              for _ in range(args.warmup + args.repeats)]
    medians = {name: statistics.median(timed[name] for timed in rounds[args.warmup:]) for name in stages}
    return first, medians


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's): ``benchmarks.args.parse_block_args``."""
    return parse_block_args(__doc__.splitlines()[0], 1, argv)


def main() -> None:
    """Parse options, time the variants in turns, print the table."""
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    first, medians = measure(args)
    print(f"{args.layers} GPT layer(s) x {args.hidden} hidden ({args.heads} heads, MLP {4 * args.hidden}), "
          f"{args.micro_batch} x {args.seq} tokens, float32; median of {args.repeats} rounds after {args.warmup} "
          f"warm-up, variants in turns, {torch.get_num_threads()} threads")
    eager = {"BW": medians["eager BW"], "F+B+W": medians["eager F+B+W"]}
    print(f"{'variant':<30} {'median ms':>10} {'/ eager':>8} {'first call ms':>14}")
    for name, median in medians.items():
        baseline = eager["F+B+W" if name.endswith("F+B+W") else "BW"]
        print(f"{name:<30} {median:>10.1f} {median / baseline:>8.3f} {first[name]:>14.0f}")


if __name__ == "__main__":
    main()
