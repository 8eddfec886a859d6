"""The masked-loss data the end-to-end runs train on really has holes.

The 8-rank CLI run (tests/cli/test_cli_workers.py) trains on it and logs the single-process
run's numbers; this checks, without a launch, that its loss mask is uneven over microbatches.
"""

BASE = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=3", "trainer.log_every=1"]
# Labels equal to the end-of-document id (the last of 16 ids) weigh zero: a loss mask with holes.
MASKED = ["model.vocab_size=16", "data.eod_mask_loss=true"]


def test_masked_case_really_has_zero_weight_labels():
    """Every trained global batch of the masked case holds end-of-document labels, unevenly over microbatches."""
    from ppctl.resolve import compose_config
    from ppctl.data.dataset import build_dataset, global_loss_tokens, step_microbatches
    from ppctl.data.corpus import CorpusSpec

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
