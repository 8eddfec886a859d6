"""Shared by the equivalence tests: train a layout in gloo workers and compare with one process.

The reference is the single-process run as a user would launch it: the same overrides
with every ``parallel.*`` setting dropped and ``parallel=single`` added (so the default
vocabulary padding of tp=1), trained by the plain loop of ``ppctl.reference``. Nothing
of the parallel run's settings reaches it. Compared: every step's loss and global
gradient norm, every parameter's gradient at step 0, and every final parameter.
"""

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
# Labels equal to the end-of-document id (the last of 16 ids here) weigh zero: a loss mask with holes.
MASKED = ["model.vocab_size=16", "data.eod_mask_loss=true"]
STEPS = 3
RTOL = 1e-5          # float32: loss and norm relative difference; ||a - e|| / ||e|| per tensor
RTOL_FP64 = 1e-10    # float64: every element, max |a - e| / max |e| per tensor


# How a run is split over processes, nodes and pipeline ranks, not what it computes: one process
# runs no pipeline schedule (and a V schedule would refuse its single chunk).
LAYOUT_PREFIXES = ("parallel", "schedule", "launcher")


def single_process_overrides(overrides: list[str]) -> list[str]:
    """The same run as one process, as a user would ask for it: no parallel.*, schedule or launcher.*
    setting, ``parallel=single``."""
    return [item for item in overrides if not item.lstrip("+~").startswith(LAYOUT_PREFIXES)] + ["parallel=single"]


def _record_message_bytes(trainer) -> set[int]:
    """Make the trainer's transport note the bytes of every pipeline message it sends; return the record."""
    sent: set[int] = set()
    post = trainer.runtime.transport.post

    def recording_post(sends, receives):
        sent.update(tensor.numel() * tensor.element_size() for _message, tensor in sends)
        return post(sends, receives)

    trainer.runtime.transport.post = recording_post
    return sent


def _train_runs(rank, world_size, runs, schedule_builder=None):
    """Worker: for each override list, train STEPS steps; return losses, norms and this rank's shards.

    Runs may use different layouts of the same world size: each layout's groups are built once.
    Before training, the forward-only path evaluates batch 0 (it must give step 0's loss).
    ``schedule_builder(config)``, when given, replaces the configured schedule. The bytes
    of every pipeline message sent are recorded too.
    """
    from ppctl.config import compose_config, layout_of, validate
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.train import Trainer

    contexts, results = {}, []
    for overrides in runs:
        config = compose_config(overrides)
        validate(config)
        layout = layout_of(config)
        if layout not in contexts:
            contexts[layout] = build_parallel_context(layout, 60)
        context = contexts[layout]
        schedule = schedule_builder(config) if schedule_builder is not None else None
        trainer = Trainer(config, context, schedule=schedule)
        message_bytes = _record_message_bytes(trainer)
        eval_loss = trainer.evaluate(0)
        losses, norms, first_gradients = [], [], None
        for step in range(STEPS):
            loss, grad_norm = trainer.compute_gradients(step)
            if step == 0:
                first_gradients = {name: grad.detach().clone() for name, grad in trainer.gradients().items()}
            trainer.apply_gradients(step, grad_norm)
            losses.append(loss)
            norms.append(grad_norm)
        shards = {name: param.detach().clone() for name, param in trainer.named_parameters().items()}
        results.append({"losses": losses, "norms": norms, "gradients": first_gradients, "shards": shards,
                        "eval_loss": eval_loss, "message_bytes": message_bytes,
                        "optimizer_bytes": trainer.optimizer.state_bytes(),
                        "tp_rank": context.coords["tp"], "tp": context.layout.tp})
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


def expected_shard(name: str, dense: torch.Tensor, shard: torch.Tensor, tp_size: int, tp_rank: int,
                   vocab_size: int) -> torch.Tensor:
    """The TP shard of a single-process tensor, vocabulary padding rebuilt as zeros for the parallel run.

    The single process pads its vocabulary for tp=1 and the parallel run for its own tp;
    padded rows never enter the math, so they must hold exactly zero in both.
    """
    from ppctl.model.init import dense_to_tp_shard, parameter_rule
    from ppctl.parallel.tensor_parallel import TPGroup

    if parameter_rule(name).vocab_rows:
        assert not dense[vocab_size:].any(), f"{name}: the single process's padded rows are not zero"
        real = dense[:vocab_size]
        dense = torch.cat([real, real.new_zeros((shard.shape[0] * tp_size - vocab_size, *real.shape[1:]))])
    return dense_to_tp_shard(name, dense, TPGroup(None, tp_size, tp_rank))


def _compare_tensors(label: str, overrides, per_rank, index, key, reference: dict, vocab_size: int,
                     elementwise: bool, tolerance: float) -> None:
    """Every rank's shard of every tensor under ``key`` against the reference; all names must be covered."""
    seen = set()
    for result in per_rank:
        run = result[index]
        for name, shard in run[key].items():
            # A tied output layer on the last stage is a copy of the single process's word embedding.
            dense_name = "embedding.word.weight" if name not in reference else name
            expected = expected_shard(name, reference[dense_name], shard, run["tp"], run["tp_rank"], vocab_size)
            difference = relative_difference(shard, expected, elementwise)
            assert difference < tolerance, f"{overrides}: {label} of {name} differs by {difference:.2e}"
            seen.add(dense_name)
    assert seen == set(reference), f"{label}s never compared: {set(reference) - seen}"


def _compare_scalars(label: str, overrides, actual: list[float], expected: list[float], tolerance: float) -> None:
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert abs(got - want) <= tolerance * abs(want), f"{overrides}: step {step} {label} {got} != {want}"


def assert_equivalent(runs: list[list[str]], world_size: int, timeout: float = 240,
                      schedule_builder=None) -> list[list[dict]]:
    """Train every run (layouts of one world size, several schedules) in one launch; compare each with one process.

    ``schedule_builder(config) -> Schedule`` (module level, picklable) replaces the configured schedule.
    Returns every rank's results (per run: losses, norms, gradients, shards, message_bytes).
    """
    from ppctl.config import compose_config, validate
    from ppctl.reference import run_reference

    per_rank = run_workers(_train_runs, world_size, runs, schedule_builder, timeout=timeout)
    for index, overrides in enumerate(runs):
        single = compose_config(single_process_overrides(overrides))
        validate(single)
        reference = run_reference(single, STEPS)
        elementwise = single.trainer.precision == "fp64"
        tolerance = RTOL_FP64 if elementwise else RTOL
        losses = [r[index]["losses"] for r in per_rank if r[index]["losses"][0] is not None]
        assert losses, "no rank reported a loss"
        for rank_losses in losses:
            _compare_scalars("loss", overrides, rank_losses, reference.losses, tolerance)
        evaluated = [r[index]["eval_loss"] for r in per_rank if r[index]["eval_loss"] is not None]
        assert len(evaluated) == len(losses), "the forward-only loss is not on the ranks that hold the loss"
        _compare_scalars("forward-only loss", overrides, evaluated, [reference.losses[0]] * len(evaluated), tolerance)
        for result in per_rank:  # every rank computes the same global norm
            _compare_scalars("grad norm", overrides, result[index]["norms"], reference.grad_norms, tolerance)
        vocab = single.model.vocab_size
        _compare_tensors("step-0 gradient", overrides, per_rank, index, "gradients", reference.first_gradients,
                         vocab, elementwise, tolerance)
        _compare_tensors("parameter", overrides, per_rank, index, "shards", reference.parameters,
                         vocab, elementwise, tolerance)
    return per_rank
