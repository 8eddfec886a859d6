"""End to end: `ppctl train` over a parallel layout logs what one process logs.

Each case launches `ppctl train` twice through the CLI, as a user would: once with a
parallel layout and once with the same other overrides and ``parallel=single`` (default
vocabulary padding, nothing taken from the parallel run). Every step's TensorBoard
``train/loss`` and ``train/grad_norm`` must agree within float32's equivalence tolerance (``tests/tolerances.py``).
"""

import pytest

from tests.cli.runs import assert_same_series

BASE = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=3", "trainer.log_every=1"]
# Labels equal to the end-of-document id (the last of 16 ids) weigh zero: a loss mask with holes.
MASKED = ["model.vocab_size=16", "data.eod_mask_loss=true"]
CASES = {
    # tp=2 pp=2 dp=2 with the masked loss is tests/cli/test_cli_workers.py's 8-rank run.
    # DualPipe with the distributed optimizer: the two parameter copies (mirror pp ranks) and the dp
    # replicas share the shards; tied embeddings summed on each end rank before the reduce-scatter.
    "tp2-pp2-dp2-dualpipe-distributed-tied": (
        ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "schedule=dualpipe"],
        ["optimizer.distributed=true", "model.tie_embeddings=true", "optimizer.clip_grad=1.0",
         "trainer.micro_batch_size=1"]),
    # tp=4's vocabulary padding (512 rows against one process's 320) runs in tests/cli/test_cli_checkpoints.py,
    # saved there and resumed at another layout.
    # The context-parallel command with ring attention and sequence parallelism (the other cp_comm
    # modes run the same trainer at the same layout in tests/distributed/test_context_parallel_equivalence.py).
    "tp2-cp2-pp2-ring-sp": (["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "schedule=1f1b",
                             "parallel.cp_comm=ring", "parallel.sequence_parallel=true"], MASKED),
}


def test_masked_case_really_has_zero_weight_labels():
    """Every trained global batch of the masked case holds end-of-document labels, unevenly over microbatches."""
    from ppctl.config import compose_config
    from ppctl.data.dataset import build_dataset, global_loss_tokens, step_microbatches
    from ppctl.data.prepare import CorpusSpec

    trainer = compose_config(BASE + MASKED).trainer
    dataset = build_dataset(CorpusSpec("synthetic"), trainer.seq_length, vocab_size=16, seed=trainer.seed,
                            eod_mask_loss=True)
    weights = set()
    for step in range(trainer.max_steps):
        assert global_loss_tokens(dataset, trainer.seed, step, trainer.global_batch_size) < (
            trainer.global_batch_size * trainer.seq_length)
        microbatches = step_microbatches(dataset, trainer.seed, step, trainer.global_batch_size,
                                         trainer.micro_batch_size, 0, 1)
        weights |= {float(microbatch.loss_mask.sum()) for microbatch in microbatches}
    assert len(weights) > 1, weights  # a per-microbatch mean would differ from the global token mean


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel, settings", list(CASES.values()), ids=list(CASES))
def test_parallel_run_logs_the_single_process_numbers(ppctl, single_run, tmp_path, parallel, settings):
    """Per-step loss and gradient norm of the parallel run equal the single-process run's."""
    from ppctl.config import compose_config, padded_vocab_size

    overrides = [*BASE, *settings, *parallel]
    config = compose_config(overrides)
    model, tp = config.model, config.parallel.tp
    padded = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)
    assert padded != padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)
    result = ppctl("train", *overrides, f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"vocab {model.vocab_size} padded to {padded}" in result.stdout
    if config.optimizer.distributed:
        assert "optimizer: distributed over 4 ranks (dp*cp x 2 parameter copies)" in result.stdout, result.stdout
    if config.parallel.cp > 1:
        assert f"context parallel attention: {config.parallel.cp_comm} | sequence parallel" in result.stdout
    assert_same_series(tmp_path, single_run(overrides))
