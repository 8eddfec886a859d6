"""Activation memory of the runtime, measured by accounting the storage it holds between F and B.

With 1F1B the first rank holds at most pp microbatches' stage outputs; releasing each
output right after sending it (keeping only its autograd node) lowers that peak to
almost nothing; GPipe without release holds every microbatch.
"""

import pytest

from tests.harness.pool import run_workers

PP, MICROBATCHES = 4, 8
BASE = ["data=synthetic", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
        "model.ffn_hidden_size=64", "trainer.seq_length=16", "trainer.micro_batch_size=2",
        f"trainer.global_batch_size={2 * MICROBATCHES}", f"parallel.pp={PP}", "trainer.tensorboard=false"]


def _peak_bytes(rank, world_size):
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    context = None
    peaks = {}
    for schedule, release in (("1f1b", True), ("1f1b", False), ("gpipe", False), ("gpipe", True)):
        run = resolve(compose_config(BASE + [f"schedule={schedule}"]))
        context = context or build_parallel_context(run.layout, 60)
        trainer = Trainer(run, context, release_outputs=release, track_memory=True)
        trainer.train_step(0)
        peaks[(schedule, release)] = trainer.last_step_state.peak_held_bytes
    activation_bytes = 2 * 16 * 32 * 4  # micro_batch_size x seq_length x hidden_size x float32
    return peaks, activation_bytes


@pytest.mark.timeout(180)
def test_1f1b_first_rank_holds_at_most_pp_microbatches_and_release_lowers_it():
    results = run_workers(_peak_bytes, PP, timeout=150)
    first_rank_peaks, activation = results[0]
    assert first_rank_peaks[("1f1b", False)] == PP * activation  # pp outputs in flight, no more
    assert first_rank_peaks[("gpipe", False)] == MICROBATCHES * activation
    assert first_rank_peaks[("1f1b", True)] < activation  # released after sending: only autograd nodes
    assert first_rank_peaks[("gpipe", True)] < activation
    for pp_rank, (peaks, _) in enumerate(results):
        # Every rank: stage outputs and saved inputs of 1F1B stay within what pp microbatches need.
        assert peaks[("1f1b", True)] <= (PP - pp_rank) * activation + PP * 4
