"""The rule that stops a run that trains nothing: ``trainer.max_skipped_steps`` skipped steps in a row (pure: the
counter, with the real fp16 loss scaler, and the one line the launcher shows of the worker's error)."""

import math

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from ppctl.optim.loss_scale import DynamicLossScaler
from ppctl.run.train import NonFiniteGradients, SkippedSteps, norm_outcome

NAN = float("nan")


def _run(norms, limit: int, scaler: DynamicLossScaler | None = None) -> tuple[int | None, SkippedSteps]:
    """Feed the norms to the counter as ``Trainer.apply_gradients`` does; the step it stopped at (None: never)."""
    skips = SkippedSteps(limit)
    for step, norm in enumerate(norms):
        finite, overflow = norm_outcome(norm, scaler)
        try:
            skips.record(step, norm, taken=finite, overflow=overflow)
        except NonFiniteGradients:
            return step, skips
    return None, skips


def test_a_run_of_skips_stops_at_the_limit_and_a_taken_step_resets_it():
    stopped, skips = _run([NAN] * 9 + [1.0] + [NAN] * 9 + [1.0], limit=10)
    assert stopped is None and skips.total == 18 and skips.in_a_row == 0
    stopped, skips = _run([1.0] + [NAN] * 20, limit=10)
    assert stopped == 10 and skips.total == 10
    with pytest.raises(NonFiniteGradients) as error:
        SkippedSteps(1).record(7, NAN, taken=False)
    assert str(error.value).startswith("step 8: the last 1 steps were all skipped (gradient norm nan): the run "
                                       "trains nothing; stopping (trainer.max_skipped_steps=1)")
    assert "\n" not in str(error.value)


def test_fp16_overflows_while_the_scale_falls_do_not_count_but_a_skip_at_the_minimum_does():
    # 65536 halves 16 times to the minimum 1: more overflows in a row than the default limit, and no fault.
    settling = [NAN] * 16 + [1.0] * 50
    stopped, skips = _run(settling, limit=10, scaler=DynamicLossScaler(2.0 ** 16, min_scale=1.0))
    assert stopped is None and skips.total == 16
    # Gradients non-finite at any scale: 16 overflows, then 10 skips at the minimum scale.
    stopped, _ = _run([NAN] * 100, limit=10, scaler=DynamicLossScaler(2.0 ** 16, min_scale=1.0))
    assert stopped == 16 + 10 - 1
    # An overflow neither counts nor ends the run of skips.
    skips = SkippedSteps(3)
    skips.record(0, NAN, taken=False)
    skips.record(1, NAN, taken=False, overflow=True)
    skips.record(2, NAN, taken=False)
    with pytest.raises(NonFiniteGradients):
        skips.record(3, NAN, taken=False)


def test_the_run_of_skips_resumes_from_a_checkpoint_and_an_older_one_reads():
    skips = SkippedSteps(10)
    skips.load_state_dict({"skipped_steps": 4})  # a checkpoint saved before the run of skips was kept
    assert (skips.total, skips.in_a_row) == (4, 0)
    skips.load_state_dict({"skipped_steps": 9, "skipped_in_a_row": 9})
    with pytest.raises(NonFiniteGradients):
        skips.record(30, math.inf, taken=False)
    assert skips.state_dict() == {"skipped_steps": 10, "skipped_in_a_row": 10}


def test_the_limit_is_a_positive_setting():
    assert compose_config([]).trainer.max_skipped_steps == 10
    with pytest.raises(ConfigError, match="trainer.max_skipped_steps=0 must be a positive integer"):
        validate(compose_config(["trainer.max_skipped_steps=0"]), prove_schedule=False, data=False)


def test_the_workers_error_reaches_the_user_as_one_line_naming_the_setting(tmp_path):
    from ppctl.run.failures import describe_failure
    from ppctl.cli.worker import _write_error

    skips = SkippedSteps(2)
    skips.record(2, NAN, taken=False)
    try:
        skips.record(3, NAN, taken=False)
    except NonFiniteGradients:
        _write_error(tmp_path, "1")  # what the worker does with any error, before the launcher reads it
    line = describe_failure(tmp_path, tmp_path / "absent.log", 1)
    assert line.startswith("worker rank 1 failed: NonFiniteGradients: step 4: the last 2 steps were all skipped"), line
    assert "(trainer.max_skipped_steps=2)" in line and "\n" not in line
