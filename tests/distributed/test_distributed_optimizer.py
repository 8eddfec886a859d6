"""The distributed optimizer trains exactly like one process, and holds 1/(dp*cp) of the optimizer memory.

Each run is compared with the single-process run as a user would launch it (per-step
loss and grad norm with clipping active, the forward-only loss, step-0 gradients
gathered from the shards, final parameters). Bucket sizes small enough that every
parameter is a bucket of its own and most are cut between two ranks' shards.
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, LLAMA, MASKED, assert_equivalent

DISTRIBUTED = ["optimizer.distributed=true"]
TINY_BUCKETS = ["optimizer.bucket_size=100"]
NO_OVERLAP = ["optimizer.overlap_grad_reduce=false", "optimizer.overlap_param_gather=false"]
TIED = ["model.tie_embeddings=true", "model.position_embedding=rope"]
# Clipping active at every step: the norms of these runs are well above 0.1.
CLIP = ["optimizer.clip_grad=0.1"]


def parallel(tp=1, cp=1, pp=1, dp=1, vpp=1, schedule="1f1b"):
    """The overrides of one layout."""
    return [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
            f"parallel.vpp={vpp}", f"schedule={schedule}"]


def state_bytes(per_rank: list, index: int) -> int:
    """The optimizer memory (main parameters and AdamW state) of run ``index`` on rank 0."""
    return per_rank[0][index]["optimizer_bytes"]


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_dp2_with_and_without_overlap_and_tiny_buckets():
    runs = [BASE + parallel(dp=2) + CLIP,
            BASE + parallel(dp=2) + CLIP + DISTRIBUTED,
            BASE + parallel(dp=2) + CLIP + DISTRIBUTED + TINY_BUCKETS,
            BASE + parallel(dp=2) + CLIP + DISTRIBUTED + TINY_BUCKETS + NO_OVERLAP + MASKED,
            BASE + parallel(dp=2) + CLIP + DISTRIBUTED + TINY_BUCKETS + FP64,
            BASE + parallel(dp=2) + CLIP + DISTRIBUTED + TIED]  # pp=1: one shared weight, nothing to sum
    per_rank = assert_equivalent(runs, world_size=2)
    plain = state_bytes(per_rank, 0)
    for index in (1, 2):
        assert abs(state_bytes(per_rank, index) / plain - 1 / 2) < 0.01, (index, state_bytes(per_rank, index), plain)


@pytest.mark.nccl
@pytest.mark.timeout(400)
def test_four_ranks_dp4_interleaved_and_context_parallel():
    runs = [BASE + parallel(dp=4) + CLIP,
            BASE + parallel(dp=4) + CLIP + DISTRIBUTED + TINY_BUCKETS,
            BASE + parallel(pp=2, vpp=2, dp=2, schedule="interleaved_1f1b") + CLIP + DISTRIBUTED + TIED,
            BASE + parallel(cp=2, dp=2) + CLIP + DISTRIBUTED + TINY_BUCKETS + MASKED,
            BASE + parallel(pp=4) + CLIP + DISTRIBUTED + TIED]  # copies on pp ranks 0 and 3
    per_rank = assert_equivalent(runs, world_size=4)
    assert abs(state_bytes(per_rank, 1) / state_bytes(per_rank, 0) - 1 / 4) < 0.02


@pytest.mark.nccl
@pytest.mark.timeout(600)
def test_tp2_pp2_dp2_with_tied_embeddings_and_sequence_parallelism():
    runs = [BASE + parallel(tp=2, pp=2, dp=2) + CLIP + DISTRIBUTED + TIED + MASKED,
            BASE + parallel(tp=2, pp=2, dp=2) + CLIP + DISTRIBUTED + TINY_BUCKETS + TIED
            + ["parallel.sequence_parallel=true"],
            # DualPipe's two parameter copies (mirror pp ranks) and the dp replicas share the shards; the tied
            # embeddings are summed on each end rank before the reduce-scatter.
            BASE + parallel(tp=2, pp=2, dp=2, vpp=2, schedule="dualpipe") + CLIP + DISTRIBUTED + TIED,
            # q/k/v and gate/up enter the TP region once and run as modules: the all-gathers' waits still fire.
            BASE + parallel(tp=2, pp=2, dp=2) + CLIP + DISTRIBUTED + LLAMA + ["optimizer.overlap_param_gather=true"]]
    assert_equivalent(runs, world_size=8, timeout=500)


def _trained_and_dropped(rank, world_size, overrides):
    """Train one step of the config's trainer and drop it: whether its optimizer outlived it."""
    import gc
    import weakref

    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    run = resolve(compose_config(overrides))
    trainer = Trainer(run, build_parallel_context(run.layout, 60))
    trainer.apply_gradients(0, trainer.compute_gradients(0)[1])
    optimizer = weakref.ref(trainer.optimizer)
    del trainer
    gc.collect()
    return optimizer() is not None


@pytest.mark.timeout(120)
def test_a_dropped_trainer_frees_its_bucketed_optimizer_and_groups():
    """The gradient hooks live in autograd's C++ nodes, out of the collector's sight: holding the optimizer there
    kept every trainer ever built alive, with its groups and their gloo threads (a test worker gathered 300)."""
    from tests.harness.pool import run_workers

    for extra in (DISTRIBUTED, ["trainer.precision=bf16"]):  # sharded, and the half-precision plain path
        assert not any(run_workers(_trained_and_dropped, 2, BASE + parallel(dp=2) + extra)), extra
