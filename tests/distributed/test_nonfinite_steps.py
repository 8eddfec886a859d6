"""A step whose gradient norm is not finite changes nothing and is counted; or, if asked, stops the run; and
``trainer.max_skipped_steps`` skips in a row stop it on every rank alike.

The non-finite gradient is injected on one rank only (its first layer's output made
NaN for one step): the reduction spreads it, every rank sees the same NaN norm and
skips the same step, with the plain and the distributed optimizer alike.
"""

import math

import pytest
import torch

from tests.harness.pool import run_workers
from tests.distributed.equivalence import BASE

LAYOUT = ["parallel.pp=1", "parallel.dp=2"]


def _poison_first_layer(trainer):
    """Make rank-local outputs of the first transformer layer NaN until the returned handle is removed."""
    chunk = next(iter(trainer.chunks.values()))
    first_layer = next(iter(chunk.layers.values()))
    return first_layer.register_forward_hook(lambda _module, _inputs, output: output * float("nan"))


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and every AdamW state tensor of this rank, copied."""
    tensors = {f"param {name}": param.detach().clone() for name, param in trainer.named_parameters().items()}
    for index, state in enumerate(trainer.optimizer.optimizer.state.values()):
        for key, value in state.items():
            tensors[f"state {index} {key}"] = torch.as_tensor(value).clone()
    return tensors


def _skip_then_stop(rank, world_size):
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import NonFiniteGradients, Trainer

    context, report = None, {}
    for distributed in (False, True):
        run = resolve(compose_config(BASE + LAYOUT + [f"optimizer.distributed={str(distributed).lower()}"]))
        context = context or build_parallel_context(run.layout, 60)
        trainer = Trainer(run, context)
        trainer.train_step(0)  # AdamW state exists from here on
        before = _snapshot(trainer)
        handle = _poison_first_layer(trainer) if rank == 0 else None
        skipped = trainer.train_step(1)
        if handle is not None:
            handle.remove()
        after_skip = _snapshot(trainer)
        unchanged = all(torch.equal(before[name], after_skip[name]) for name in before)
        resumed = trainer.train_step(2)
        moved = any(not torch.equal(before[name], value) for name, value in _snapshot(trainer).items())
        report[distributed] = (skipped.skipped, skipped.skipped_steps, skipped.grad_norm, unchanged,
                               resumed.skipped, math.isfinite(resumed.grad_norm), moved)

    trainer = Trainer(resolve(compose_config(BASE + LAYOUT + ["trainer.stop_on_nonfinite=true"])), context)
    handle = _poison_first_layer(trainer) if rank == 0 else None
    try:
        trainer.train_step(0)
        report["stopped"] = None
    except NonFiniteGradients as error:
        report["stopped"] = str(error)
    report["skipped, then stopped"] = _skip_until_the_limit(context, rank)
    return report


def _skip_until_the_limit(context, rank) -> tuple[list[bool], str | None]:
    """Every step non-finite (rank 0's only) at trainer.max_skipped_steps=2: the steps' skips, then the error every
    rank raised at the same step."""
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.run.train import NonFiniteGradients, Trainer

    trainer = Trainer(resolve(compose_config(BASE + LAYOUT + ["trainer.max_skipped_steps=2"])), context)
    if rank == 0:
        _poison_first_layer(trainer)
    skipped = []
    try:
        for step in range(3):
            skipped.append(trainer.train_step(step).skipped)
    except NonFiniteGradients as error:
        return skipped, str(error)
    return skipped, None


@pytest.mark.timeout(180)
def test_nonfinite_step_is_skipped_untouched_counted_or_stops_the_run():
    for report in run_workers(_skip_then_stop, 2, timeout=150):
        for distributed in (False, True):
            skipped, count, norm, unchanged, resumed_skipped, resumed_finite, moved = report[distributed]
            assert skipped and count == 1 and math.isnan(norm), (distributed, report[distributed])
            assert unchanged, f"distributed={distributed}: a skipped step changed parameters or AdamW state"
            assert not resumed_skipped and resumed_finite and moved, (distributed, report[distributed])
        assert report["stopped"] == "step 0: the gradient norm is nan; stopping (trainer.stop_on_nonfinite=true)"
        skipped, stopped = report["skipped, then stopped"]
        assert skipped == [True] and stopped is not None, report["skipped, then stopped"]
        assert stopped.startswith("step 2: the last 2 steps were all skipped (gradient norm nan)"), stopped
