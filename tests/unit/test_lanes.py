"""Two communication lanes (``ppctl.parallel.lanes``): a collective inside a backward (a recomputed forward too)
goes through the group's second communicator, every other one through the first; each is posted asynchronously
and finished through the pacer (the overlap's interleave) when there is one, so a half of a pair never waits holding
the turn. The worker's one ``Lanes`` says it all; the group objects only carry it."""

import torch

import pytest

from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.lanes import BACKWARD_LANE, FORWARD_LANE, ONE_LANE, Lanes, current_lane
from ppctl.parallel.tensor_parallel import TPGroup


class _LaneSeen(torch.autograd.Function):
    """Records the lane of its forward and of its backward."""

    @staticmethod
    def forward(ctx, tensor, seen):
        ctx.seen = seen
        seen.append(current_lane())
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(current_lane())
        return grad, None


def test_a_backward_runs_on_the_backward_lane_and_everything_else_on_the_forward_lane():
    seen = []
    _LaneSeen.apply(torch.ones(2, requires_grad=True), seen).sum().backward()
    assert seen == [FORWARD_LANE, BACKWARD_LANE]
    lanes = Lanes((("forward", "backward"),))
    assert lanes.communicator("forward") == "forward"
    assert lanes.communicator("forward", BACKWARD_LANE) == "backward"
    assert lanes.communicator("other", BACKWARD_LANE) == "other"  # a group without a second one: both lanes on it
    assert ONE_LANE.communicator("forward", BACKWARD_LANE) == "forward"


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class _Interleave:
    def __init__(self):
        self.exchanged_work = []

    def exchanged(self, work):
        self.exchanged_work.append(work)


def test_a_collective_is_finished_through_the_pacer_when_there_is_one():
    plain, interleave = _Work(), _Interleave()
    ONE_LANE.finish(plain)
    assert plain.waited
    handed = _Work()
    Lanes(pacer=interleave).finish(handed)
    assert interleave.exchanged_work == [handed] and not handed.waited  # the interleave waits for it


@pytest.mark.parametrize("make", [lambda lanes: TPGroup("tp", 2, 0, lanes=lanes),
                                   lambda lanes: CPGroup("tp", 2, 0, (0, 1), "allgather", lanes)], ids=["tp", "cp"])
def test_a_groups_collectives_go_through_the_current_lanes_communicator_asynchronously(make):
    calls, interleave = [], _Interleave()

    def collective(tensor, group, async_op):
        calls.append((group, async_op))
        return _Work()

    tp = make(Lanes((("tp", "tp backward"),), interleave))
    tp.post(collective, torch.zeros(1))

    class _InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.clone()

        @staticmethod
        def backward(ctx, grad):
            tp.post(collective, grad)
            return grad

    _InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert calls == [("tp", True), ("tp backward", True)]
    assert len(interleave.exchanged_work) == 2


def test_without_a_pacer_a_groups_collective_is_one_blocking_call_on_its_lanes_communicator():
    calls = []

    def collective(tensor, group):
        calls.append(group)

    TPGroup("tp", 2, 0, lanes=Lanes((("tp", "tp backward"),))).post(collective, torch.zeros(1))
    TPGroup("tp", 2, 0).post(collective, torch.zeros(1))
    assert calls == ["tp", "tp"]
