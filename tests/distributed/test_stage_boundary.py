"""The stage boundary: a backward split into B and W, run by the runtime, trains like one process.

ZB-H1 and ZB-V split the backward their own way (tests/distributed/test_zero_bubble_equivalence.py);
here 1F1B and interleaved 1F1B are rewritten by hand so that every whole backward
becomes an input-gradient B and the weight-gradient Ws all run at the end of the rank's
step. The runtime dispatches them to the stages' ``backward_input`` and
``backward_weight``; losses, grad norms, step-0 gradients and parameters must equal the
single-process run exactly as for the unsplit schedules.
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, MASKED, assert_equivalent


def deferred_weight_schedule(config):
    """The configured schedule with each BW split into B in place and W deferred to the end of the rank."""
    from ppctl.config import num_microbatches
    from ppctl.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Action, Schedule, build_schedule

    parallel = config.parallel
    whole = build_schedule(config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config))
    ranks = []
    for rank_actions in whole.actions:
        split = [Action(BACKWARD_INPUT, a.stage, a.microbatch) if a.kind == BACKWARD else a for a in rank_actions]
        weights = [Action(BACKWARD_WEIGHT, a.stage, a.microbatch) for a in rank_actions if a.kind == BACKWARD]
        ranks.append(tuple(split + weights))
    return Schedule(f"{whole.name} with deferred W", whole.pp, whole.chunks_per_rank, whole.num_microbatches,
                    whole.placement, tuple(ranks))


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_split_backward_matches_single_process():
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b"]
    runs = [BASE + layout + ["model.position_embedding=rope", "model.tie_embeddings=true"] + MASKED,
            BASE + layout + FP64]
    assert_equivalent(runs, world_size=4, schedule_builder=deferred_weight_schedule)


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_split_backward_interleaved_with_local_hand_overs_matches_single_process():
    layout = ["parallel.pp=1", "parallel.vpp=2", "schedule=interleaved_1f1b", "model.tie_embeddings=true"]
    assert_equivalent([BASE + layout + FP64], world_size=1, schedule_builder=deferred_weight_schedule)
