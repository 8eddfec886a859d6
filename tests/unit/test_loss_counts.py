"""The counts a run reports beside its loss: input tokens per second (what the hardware computed) and trained tokens
(the loss weights summed: the loss's denominator), on the console line, in TensorBoard and ``metrics.jsonl``; and the
validation loss as the mean over every trained token of its batches (``ppctl.run.train.pooled_mean``)."""

import json
from types import SimpleNamespace

import pytest

from ppctl.resolve import compose_config
from ppctl.run.logging import METRICS_FILE, TrainingLogger, format_count, format_step, format_validation
from ppctl.run.train import StepResult, pooled_mean


def step_result(trained_tokens: float | None) -> StepResult:
    """Step 2 of a 128-input-token batch that took 64 ms."""
    return StepResult(step=2, loss=2.5, grad_norm=0.75, lr=1e-3, step_time_s=0.064, tokens_per_s=128 / 0.064,
                      trained_tokens=trained_tokens)


def test_the_step_line_shows_input_tokens_per_second_and_the_trained_tokens_of_the_input():
    line = format_step(step_result(37.0), max_steps=10, input_tokens=128)
    assert line == ("step     3/10 | loss 2.5000 | lr 1.00e-03 | grad norm 0.750 | 2,000 tok/s | trained 37/128 tok | "
                    "64.0 ms")
    # off the loss ranks, or without the batch's size, the line has no trained part
    assert "trained" not in format_step(step_result(None), max_steps=10, input_tokens=128)
    assert "trained" not in format_step(step_result(37.0), max_steps=10)


def test_trained_tokens_per_second_and_fractional_weights():
    assert step_result(32.0).trained_tokens_per_s == pytest.approx(500.0)
    assert step_result(None).trained_tokens_per_s is None
    assert format_count(12345.0) == "12,345" and format_count(2.5) == "2.50"


def test_the_validation_line_says_how_many_tokens_the_loss_averages():
    assert format_validation(4, 10, 1.25, 3.49, 193.0, 256) == (
        "step     5/10 | validation loss 1.2500 | perplexity 3.49 | trained 193/256 tok")
    assert format_validation(4, 10, 1.25, 3.49, None, 256) == "step     5/10 | validation loss 1.2500 | perplexity 3.49"


def test_the_validation_loss_is_the_mean_over_every_trained_token_not_the_mean_of_batch_means():
    # batch 0: 2 trained tokens of loss 5 each; batch 1: 90 of loss 1 each
    assert pooled_mean([(10.0, 2.0), (90.0, 90.0)]) == pytest.approx(100.0 / 92.0)
    assert pooled_mean([(10.0, 2.0), (90.0, 90.0)]) != pytest.approx((5.0 + 1.0) / 2)
    assert pooled_mean([(6.0, 4.0)]) == 1.5


def fake_trainer() -> SimpleNamespace:
    """What ``TrainingLogger`` reads of a trainer (its banner and numerics lines)."""
    return SimpleNamespace(schedule=SimpleNamespace(name="1f1b", num_microbatches=4), padded_vocab_size=64,
                           optimizer=SimpleNamespace(describe=lambda: "optimizer: replicated"))


def test_the_log_records_trained_tokens_in_metrics_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = compose_config(["data=synthetic", "trainer.global_batch_size=8", "trainer.seq_length=16",
                             "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_iters=2",
                             "trainer.tensorboard=true"])
    logger = TrainingLogger(config, tmp_path, fake_trainer())
    logger.log(step_result(37.0))
    logger.log_validation(2, 1.25, 193.0)
    logger.close()
    records = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert records[0]["trained_tokens"] == 37.0 and records[1]["val_trained_tokens"] == 193.0
    printed = capsys.readouterr().out
    assert "| 2,000 tok/s | trained 37/128 tok |" in printed and "| trained 193/256 tok" in printed
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    assert scalars["train/trained_tokens"] == 37.0 and scalars["val/trained_tokens"] == 193.0
    assert scalars["train/tokens_per_s"] == pytest.approx(2000.0)
    assert scalars["train/trained_tokens_per_s"] == pytest.approx(37 / 0.064)
