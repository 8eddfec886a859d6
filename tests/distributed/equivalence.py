"""Shared by the equivalence tests: train a layout in gloo workers and compare with one process."""

from __future__ import annotations

import torch

from ppctl.testing import run_workers

BASE = [
    "data=synthetic", "model=gpt_tiny", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
    "model.ffn_hidden_size=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
    "trainer.seq_length=16", "trainer.tensorboard=false", "optimizer.lr=0.01", "optimizer.clip_grad=1.0",
    # AdamW divides each gradient element by its own running scale: where the true gradient is ~0
    # (a dead GELU unit, a byte absent from the batch) float32 rounding of another, equally valid,
    # summation order becomes a full-size step. eps=1e-5 damps those elements; float64 runs use 1e-8.
    "optimizer.eps=1e-5",
]
FP64 = ["trainer.precision=fp64", "optimizer.eps=1e-8"]
STEPS = 3
RTOL = 1e-5          # float32: loss relative difference, and parameter ||a - e|| / ||e|| per tensor
RTOL_FP64 = 1e-10    # float64: every element, max |a - e| / max |e| per tensor


def _train_schedules(rank, world_size, runs):
    """Worker: for each override list, train STEPS steps; return losses and this rank's parameter shards."""
    from ppctl.config import compose_config, layout_of, validate
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.train import Trainer

    context, results = None, []
    for overrides in runs:
        config = compose_config(overrides)
        validate(config)
        context = context or build_parallel_context(layout_of(config), 60)
        trainer = Trainer(config, context)
        losses = [trainer.train_step(step).loss for step in range(STEPS)]
        shards = {name: param.detach().clone() for name, param in trainer.named_parameters().items()}
        results.append({"losses": losses, "shards": shards, "tp_rank": context.coords["tp"], "tp": context.layout.tp})
    return results


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, elementwise: bool) -> float:
    """``max |a - e| / max |e|`` (elementwise) or ``||a - e|| / ||e||`` (0 for equal tensors).

    Float32 runs use the norm: AdamW divides each gradient element by its own running
    scale, so an element whose true gradient is ~0 turns float32 rounding noise of a
    different (but equally valid) summation order into a full-size step.
    """
    difference = actual.double() - expected.double()
    if elementwise:
        return difference.abs().max().item() / (expected.abs().max().item() or 1.0)
    return difference.norm().item() / (expected.double().norm().item() or 1.0)


def assert_equivalent(runs: list[list[str]], world_size: int, timeout: float = 240) -> None:
    """Train every run (same layout, e.g. several schedules) in one launch; compare each with the reference."""
    from ppctl.config import compose_config, validate
    from ppctl.model.init import dense_to_tp_shard
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.reference import run_reference

    per_rank = run_workers(_train_schedules, world_size, runs, timeout=timeout)
    for index, overrides in enumerate(runs):
        config = compose_config(overrides)
        reference = run_reference(config, STEPS, validate(config).padded_vocab_size)
        fp64 = config.trainer.precision == "fp64"
        tolerance = RTOL_FP64 if fp64 else RTOL
        losses = [r[index]["losses"] for r in per_rank if r[index]["losses"][0] is not None]
        assert losses, "no rank reported a loss"
        for rank_losses in losses:
            for step, (got, want) in enumerate(zip(rank_losses, reference.losses)):
                assert abs(got - want) / abs(want) < tolerance, f"{overrides}: step {step} loss {got} != {want}"
        seen = set()
        for result in per_rank:
            run = result[index]
            tp = TPGroup(None, run["tp"], run["tp_rank"])
            for name, shard in run["shards"].items():
                # A tied output layer on the last stage is a copy of the single process's word embedding.
                dense_name = "embedding.word.weight" if name not in reference.parameters else name
                expected = dense_to_tp_shard(name, reference.parameters[dense_name], tp)
                difference = relative_difference(shard, expected, elementwise=fp64)
                assert difference < tolerance, f"{overrides}: parameter {name} differs by {difference:.2e}"
                seen.add(dense_name)
        assert seen == set(reference.parameters), f"parameters never compared: {set(reference.parameters) - seen}"
