"""End to end: save, list, refuse, and resume a run at another layout through `ppctl`.

The first run trains 3 steps at tp=4 (its 257-id vocabulary padded to 512 rows, where one
process pads it to 320) and saves at its end; the second resumes that run directory at
pp=2 dp=2 with ZB-V and the distributed optimizer and trains to step 5, logging into the
same TensorBoard files. Every step's loss and grad norm, and the validation losses, must
be the single-process run's of all 5 steps (launched as a user would, with
``parallel=single``), each step logged once.
"""

from pathlib import Path

import pytest

from tests.cli.runs import assert_same_series, scalars

pytestmark = [pytest.mark.cli, pytest.mark.timeout(400)]

COMMON = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
          "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_iters=1", "model.num_heads=4"]
FIRST = ["parallel.tp=4", "parallel.pp=1", "trainer.max_steps=3"]
SECOND = ["parallel.pp=2", "parallel.dp=2", "schedule=zbv", "optimizer.distributed=true", "trainer.max_steps=5"]


def test_resume_a_run_at_another_layout_continues_its_logs(ppctl, single_run, tmp_path):
    single = [*COMMON, "trainer.max_steps=5"]
    single_run.start(single)  # trains beside the two launches, which spend much of their time starting workers
    run = tmp_path / "run"
    first = ppctl("train", *COMMON, *FIRST, f"trainer.out_dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoint saved (end)" in first.stdout
    second = ppctl("train", *COMMON, *SECOND, f"trainer.resume_from={run}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"run directory: {run}" in second.stderr and "at step 3" in second.stdout
    assert_same_series(run, single_run(single),
                       tags=("train/loss", "train/grad_norm", "val/loss", "val/perplexity"))
    events = scalars(run).Scalars("train/loss")
    assert sorted(event.step for event in events) == [0, 1, 2, 3, 4], "a step logged twice or missing"

    listing = ppctl("checkpoints", str(run))
    lines = listing.stdout.strip().splitlines()
    assert listing.returncode == 0 and len(lines) == 2, listing.stdout
    assert "step        3" in lines[0] and "tp=4 pp=1" in lines[0] and "plain optimizer" in lines[0]
    assert "step        5" in lines[1] and "zbv, distributed optimizer" in lines[1] and "latest" in lines[1]
    # The checkpoints folder lists the run; one checkpoint (what trainer.resume_from takes) lists itself.
    assert ppctl("checkpoints", str(run / "checkpoints")).stdout.strip().splitlines() == lines
    one = ppctl("checkpoints", str(run / "checkpoints" / "step_00000003"))
    assert one.returncode == 0 and one.stdout.strip().splitlines() == lines[:1], one.stdout

    data_file = next((run / "checkpoints" / "step_00000005").glob("*.distcp"))
    corrupt = data_file.read_bytes()
    data_file.write_bytes(corrupt[:-1] + bytes([corrupt[-1] ^ 0xFF]))  # one bit pattern flipped, same size
    refused = ppctl("train", *COMMON, *SECOND, "trainer.max_steps=7", f"trainer.resume_from={run}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "step_00000005 refused:" in refused.stderr and "is corrupt" in refused.stderr


def test_pipedream_2bw_trains_like_its_delayed_single_process_run(ppctl, single_run, tmp_path):
    """PipeDream-2BW end to end: streams of at most 2 steps, cut by validation every 2 steps; every step's loss,
    grad norm and validation loss are those of one process with the same delayed update, each logged once."""
    delayed = [*COMMON, "optimizer.gradient_delay=1", "optimizer.clip_grad=0", "trainer.max_steps=5"]
    single_run.start(delayed)  # trains beside the launch below
    run = tmp_path / "2bw"
    result = ppctl("train", *delayed, "parallel.pp=2", "schedule=pipedream_2bw", "schedule.stream_steps=2",
                   f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training gpt_tiny with pipedream_2bw" in result.stdout and "checkpoint saved (end)" in result.stdout
    assert_same_series(run, single_run(delayed), tags=("train/loss", "train/grad_norm", "val/loss"))
    assert sorted(event.step for event in scalars(run).Scalars("train/loss")) == [0, 1, 2, 3, 4]
