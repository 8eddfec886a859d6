"""DualPipe and DualPipeV train exactly like one process (gloo workers).

DualPipe holds two parameter copies: pp rank r runs model stage r of copy 0 and model
stage pp-1-r of copy 1, so ranks r and pp-1-r hold the same parameters and feed them
different halves of the microbatches. Their gradients are summed over the ``replica``
group (dp x cp and that mirror rank) before the step, and both copies stay equal to the
single process's parameters. Each rank at pp's ends holds the embedding of one copy and
the output layer of the other, so a tied embedding is summed on the rank first.
DualPipeV holds one copy on the V placement (like ZB-V).
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, LLAMA, assert_equivalent

TIED = ["model.tie_embeddings=true"]
DISTRIBUTED = ["optimizer.distributed=true"]
DUALPIPE = ["schedule=dualpipe", "parallel.dp=1"]
DUALPIPEV = ["schedule=dualpipev", "parallel.dp=1"]


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_dualpipe_and_dualpipev_at_pp2_match_single_process():
    """One launch of two workers: the mirror pair is the whole pipeline, sharded or not."""
    runs = [BASE + DUALPIPE + ["parallel.pp=2"] + TIED,
            BASE + DUALPIPE + ["parallel.pp=2"] + FP64 + DISTRIBUTED,  # shards split over the two copies
            BASE + DUALPIPEV + ["parallel.pp=2"] + TIED + DISTRIBUTED]
    assert_equivalent(runs, world_size=2)


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_dualpipe_and_dualpipev_at_world_size_4_match_single_process():
    """DualPipe at pp=4, at tp=2 pp=2 (tied) and at pp=2 dp=2 sharded over dp x mirror; DualPipeV at pp=4 (tied)."""
    runs = [BASE + DUALPIPE + ["parallel.pp=4"],
            BASE + DUALPIPE + ["parallel.tp=2", "parallel.pp=2"] + TIED,
            BASE + ["schedule=dualpipe", "parallel.pp=2", "parallel.dp=2"] + TIED + DISTRIBUTED,
            BASE + DUALPIPEV + ["parallel.pp=4", "model.num_layers=8"] + TIED,
            BASE + DUALPIPE + ["parallel.tp=2", "parallel.pp=2"] + LLAMA + FP64]
    assert_equivalent(runs, world_size=4)
