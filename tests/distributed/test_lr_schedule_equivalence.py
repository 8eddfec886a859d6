"""A learning-rate schedule and the weight-decay groups train a pipeline exactly like one process.

The harness trains 2 steps (0, 1). With warm-up 2 those use lr/2, then lr (the warm-up); with no
warm-up and cosine decay over 2 steps they use lr, then the midpoint of lr and min_lr (the decay),
so both phases are exercised. ``Trainer.train_step`` reports the lr each step used (three steps:
the decay ends at min_lr).
"""

import pytest

from tests.harness.pool import run_workers
from tests.distributed.equivalence import BASE, assert_equivalent

LAYOUT = ["parallel.tp=1", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b"]
WARMUP_THEN_COSINE = ["optimizer.warmup_steps=2", "optimizer.lr_decay_style=cosine", "optimizer.decay_steps=3",
                      "optimizer.min_lr=0.001"]
COSINE_TO_MINIMUM = ["optimizer.lr_decay_style=cosine", "optimizer.decay_steps=2", "optimizer.min_lr=0.001",
                     "model.tie_embeddings=true", "optimizer.decay_embeddings=true"]


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_scheduled_lr_and_decay_groups_match_single_process():
    runs = [BASE + LAYOUT + WARMUP_THEN_COSINE, BASE + LAYOUT + COSINE_TO_MINIMUM]
    assert_equivalent(runs, world_size=2)


def _step_learning_rates(rank, world_size, overrides):
    """Worker: train 3 steps with ``train_step``; return the lr each ``StepResult`` reports."""
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    run = resolve(compose_config(overrides))
    trainer = Trainer(run, build_parallel_context(run.layout, 60))
    return [trainer.train_step(step).lr for step in range(3)]


@pytest.mark.timeout(300)
def test_step_result_reports_the_lr_of_its_step():
    lr, min_lr = 0.01, 0.001  # BASE sets optimizer.lr=0.01
    per_rank = run_workers(_step_learning_rates, 2, BASE + LAYOUT + COSINE_TO_MINIMUM, timeout=240)
    for reported in per_rank:
        assert reported == pytest.approx([lr, (lr + min_lr) / 2, min_lr])
