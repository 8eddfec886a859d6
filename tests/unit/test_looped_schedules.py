"""The looped schedules torch.distributed.pipelining defines (breadth-first, interleaved zero bubble) in ppctl.

Each rank's order equals torch's, action by action; their simulated bubble is the closed
form docs/schedules.md tables, and their peak activations GPipe's and ZB-H1's.

torch builds a schedule's per-rank order (``_calculate_single_rank_operations``, with
``None`` for idle slots) from the group size, the local stage count and the microbatch
count; no process group or model is needed to ask it. Idle slots dropped and torch's
computation types mapped to ppctl's kinds, the orders must be equal.
"""

import pytest

from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.simulate import Costs, simulate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

KINDS = {"F": "F", "B": "BW", "I": "B", "W": "W"}  # torch's FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT


def torch_order(schedule_class, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[str]:
    """torch's order for one rank, as ``F3.0`` strings (kind, global stage, microbatch)."""
    return [f"{KINDS[action.computation_type.value]}{action.stage_index}.{action.microbatch_index}"
            for action in torch_order_actions(schedule_class, pp, vpp, num_microbatches, pp_rank) if action is not None]


def torch_order_actions(schedule_class, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list:
    """torch's own actions for one rank (``None``: an idle slot)."""
    schedule = schedule_class.__new__(schedule_class)  # only the order's inputs, no stages or process group
    schedule._stages = [None] * vpp
    schedule._n_microbatches = num_microbatches
    schedule.pp_group_size = pp
    schedule.n_local_stages = vpp
    schedule.rank = pp_rank
    schedule.number_of_rounds = max(1, num_microbatches // pp)
    schedule.microbatches_per_round = num_microbatches // schedule.number_of_rounds
    return schedule._calculate_single_rank_operations(pp_rank)


def ppctl_order(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[str]:
    """ppctl's order for one rank, in the same strings."""
    return [f"{a.kind}{a.stage}.{a.microbatch}" for a in build_schedule(name, pp, vpp, num_microbatches).actions[pp_rank]]


SIZES = [(pp, vpp, m) for pp in (1, 2, 3, 4, 8) for vpp in (1, 2, 3) for m in (1, 2, pp, 2 * pp, 3 * pp, 8, 12)]


@pytest.mark.parametrize("name, schedule_class", [("looped_bfs", "ScheduleLoopedBFS"),
                                                  ("interleaved_zb", "ScheduleInterleavedZeroBubble")])
def test_every_rank_runs_torch_order(name, schedule_class):
    from ppctl.pipeline.schedules import SCHEDULE_SPECS

    checked = 0
    for pp, vpp, num_microbatches in sorted(set(SIZES)):
        if SCHEDULE_SPECS[name].microbatch_error(pp, vpp, num_microbatches) is not None:
            continue
        for pp_rank in range(pp):
            expected = torch_order(getattr(schedules, schedule_class), pp, vpp, num_microbatches, pp_rank)
            assert ppctl_order(name, pp, vpp, num_microbatches, pp_rank) == expected, (pp, vpp, num_microbatches,
                                                                                       pp_rank)
        checked += 1
    assert checked > 80


@pytest.mark.parametrize("costs", [Costs(), Costs(F=1, B=2, W=1), Costs(F=2, B=2, W=1)], ids=str)
def test_bubbles_are_the_interleaved_forms(costs):
    """Breadth-first: interleaved 1F1B's (pp-1)(F+B+W)/vpp; interleaved zero bubble: ZB-H1's (pp-1)(F+B-W) / vpp."""
    for pp in (2, 3, 4, 6, 8):
        for vpp in (1, 2, 3):
            for num_microbatches in (pp, 2 * pp, 3 * pp):
                busy = num_microbatches * (costs.F + costs.B + costs.W)
                bfs = simulate(build_schedule("looped_bfs", pp, vpp, num_microbatches), costs)
                zb = simulate(build_schedule("interleaved_zb", pp, vpp, num_microbatches), costs)
                assert bfs.makespan - busy == pytest.approx((pp - 1) * (costs.F + costs.B + costs.W) / vpp)
                assert zb.makespan - busy == pytest.approx((pp - 1) * (costs.F + costs.B - costs.W) / vpp)
                assert [rank.peak_activations for rank in bfs.ranks] == [num_microbatches] * pp
                assert [rank.peak_activations for rank in zb.ranks] == [min(pp, num_microbatches)] * pp
