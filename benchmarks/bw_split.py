"""Cost of a backward split into B (input gradient) and W (weight gradients) on one middle GPT chunk.

One ``PipelineStage`` wraps a chunk of transformer layers (no embedding, no loss) and
runs, in turns within one process: forward then whole backward (BW), and forward, B,
then W (the split: B stashes what each linear's weight gradient needs, X and dY, and
computes the norms' and biases' small gradients itself; W computes the linears' weight
gradients and accumulates all). The whole backward runs PyTorch's own ops (what a
schedule without B and W runs); the split stage runs the layers' split ops. The table shows the median time of each part and its ratio to the whole
backward, and the bytes held between B and W (the stash) against those held between
F and B (the activations autograd saves, the stage input and output), parameters left out.
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
from ppctl.model.gpt.model import GPTChunk, GPTConfig  # noqa: E402
from ppctl.parallel.layout import StageLayers  # noqa: E402
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec  # noqa: E402

KEY = 0  # the microbatch


def middle_stage(args, split_backward: bool) -> PipelineStage:
    """A stage of ``args.layers`` transformer layers receiving and sending hidden states."""
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                       ffn_hidden_size=4 * args.hidden, vocab_size=256, max_seq_length=args.seq)
    chunk = GPTChunk(config, StageLayers(0, tuple(range(args.layers)), False, False), seed=0)
    spec = TensorSpec((args.micro_batch, args.seq, args.hidden), torch.float32)
    return PipelineStage(1, chunk, StageIO(input=spec, output=spec, fields=()),
                         lambda module, stage_input, _microbatch: module(stage_input), is_last=False,
                         split_backward=split_backward)


def distinct_bytes(tensors, excluded: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those in ``excluded`` (parameters)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def timed(function) -> float:
    """Milliseconds ``function()`` takes."""
    started = time.perf_counter()
    function()
    return 1000 * (time.perf_counter() - started)


def forward(stage: PipelineStage, stage_input: torch.Tensor, saved: list | None = None) -> float:
    """Time the stage's forward; with ``saved``, record every tensor autograd saves for the backward."""
    def pack(tensor):
        saved.append(tensor)
        return tensor

    if saved is None:
        return timed(lambda: stage.forward(KEY, None, stage_input.clone(), None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        return timed(lambda: stage.forward(KEY, None, stage_input.clone(), None))


def one_round(stages: dict[str, PipelineStage], stage_input: torch.Tensor, grad_output: torch.Tensor,
              parameters: set[int]) -> dict[str, float]:
    """One turn of each: times in ms, and the bytes held between F and B, and between B and W."""
    whole = stages["whole"]
    saved: list[torch.Tensor] = []
    measured = {"F": forward(whole, stage_input, saved)}
    measured["activation bytes"] = distinct_bytes(saved + whole.held_tensors(), parameters)
    measured["BW"] = timed(lambda: whole.backward(KEY, grad_output))
    for name, stage in stages.items():
        if name != "whole":
            forward(stage, stage_input)
            measured[f"{name} B"] = timed(lambda: stage.backward_input(KEY, grad_output))
            measured[f"{name} stash bytes"] = distinct_bytes(stage.held_tensors(), parameters)
            measured[f"{name} W"] = timed(lambda: stage.backward_weight(KEY))
    for stage in stages.values():
        stage.module.zero_grad(set_to_none=True)
    return measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's): ``benchmarks.args.parse_block_args``."""
    return parse_block_args(__doc__.splitlines()[0], 4, argv)


def main() -> None:
    """Parse options, time the whole and the split backwards in turns, print the table."""
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    stages = {"whole": middle_stage(args, split_backward=False), "split": middle_stage(args, split_backward=True)}
    parameters = {param.untyped_storage().data_ptr()
                  for stage in stages.values() for param in stage.module.parameters()}
    generator = torch.Generator().manual_seed(0)
    stage_input = torch.randn(stages["whole"].io.input.shape, generator=generator)
    grad_output = torch.randn(stages["whole"].io.output.shape, generator=generator)
    rounds = [one_round(stages, stage_input, grad_output, parameters) for _ in range(args.warmup + args.repeats)]
    medians = {name: statistics.median(r[name] for r in rounds[args.warmup:]) for name in rounds[0]}
    print_table(args, medians, [name for name in stages if name != "whole"])


def print_table(args, medians: dict[str, float], variants: list[str]) -> None:
    """Median times with their ratio to the whole backward; bytes held between B and W against F to B."""
    from rich.console import Console
    from rich.table import Table

    whole, activations = medians["BW"], medians["activation bytes"]
    table = Table(title=f"B/W split: middle chunk of {args.layers} layers x {args.hidden} hidden, "
                        f"{args.micro_batch} x {args.seq} tokens, float32; median of {args.repeats} "
                        f"after {args.warmup} warm-up, {torch.get_num_threads()} threads")
    for column in ("backward", "B ms", "W ms", "B/BW", "W/BW", "(B+W)/BW", "B-to-W bytes", "/ F-to-B"):
        table.add_column(column)
    table.add_row("whole (BW)", f"{whole:.1f}", "-", "-", "-", "1.000", "-", "-")
    for name in variants:
        b_ms, w_ms, stash = medians[f"{name} B"], medians[f"{name} W"], medians[f"{name} stash bytes"]
        table.add_row(name, f"{b_ms:.1f}", f"{w_ms:.1f}", f"{b_ms / whole:.3f}", f"{w_ms / whole:.3f}",
                      f"{(b_ms + w_ms) / whole:.3f}", f"{stash:,.0f}", f"{stash / activations:.3f}")
    Console(width=120).print(table)
    print(f"forward: {medians['F']:.1f} ms ({medians['F'] / whole:.3f} of BW); held between F and B (activations "
          f"saved by autograd, the stage input and output): {activations:,.0f} bytes")


if __name__ == "__main__":
    main()
