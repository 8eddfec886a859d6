"""The runtime's table (``ppctl.pipeline.runtime``): every action kind runs through its handler, the two-step ones
included (an overlapped pair, ``OVERLAP_F_B``; a weight fill, ``WEIGHT_FILL``). The runtime's own handler runs the
steps one after the other; the expert-exchange overlap (``ppctl.pipeline.overlap``) registers its own for the two
two-step kinds, which compute every step once and still post the batches in the program's order.

No process: DualPipeV's program at pp=4 with its weight fills, one rank's steps run over stand-in stages and a
transport that records what is posted and taken.
"""

import pytest
import torch

from ppctl.pipeline.kept import kept_schedule
from ppctl.pipeline.overlap import ExchangeOverlap
from ppctl.pipeline.program import lower
from ppctl.pipeline.runtime import OVERLAP_F_B, WEIGHT_FILL, PipelineRuntime
from ppctl.pipeline.schedules import ACTION_KINDS, BACKWARD_WEIGHT

PP_RANK = 1


class _Transport:
    """Records each posted batch (sends, receives) and hands a zero tensor for each message taken."""

    def __init__(self):
        self.batches = []

    def post(self, sends, receives):
        self.batches.append(([message for message, _ in sends], list(receives)))

    def take(self, message):
        return torch.zeros(1)

    def finish(self):
        pass


class _Stage:
    """A stage that holds nothing; its W (as a weight fill runs it) is recorded with whether it could pause."""

    def __init__(self, computed: list):
        self.computed = computed

    def backward_weight(self, microbatch, pause=None):
        if pause is not None:
            pause()
        self.computed.append("paused W")

    def holds_work(self) -> bool:
        return False


class _Hooks:
    def __init__(self):
        self.seen = []

    def before(self, action):
        self.seen.append(("before", action))

    def after(self, action):
        self.seen.append(("after", action))


def _program():
    program = lower(kept_schedule("dualpipev", 4, 2, 8).with_weight_fills())
    schedule = program.schedule
    assert schedule.pair_starts(PP_RANK) and schedule.fill_starts(PP_RANK)  # the rank has both two-step kinds
    return program


def _runtime(program, computed: list) -> PipelineRuntime:
    """A runtime over stand-ins whose every computation records its action."""
    stages = {stage: _Stage(computed) for stage in range(8)}
    runtime = PipelineRuntime(PP_RANK, stages, _Transport())

    def compute(step, inputs, state):
        computed.append(step.action)
        return None if step.action.kind == BACKWARD_WEIGHT else torch.zeros(1)

    runtime.computations = dict.fromkeys(ACTION_KINDS, compute)
    return runtime


def _program_batches(program) -> list:
    """What the rank posts, in the program's order: its initial receives, then each step's batch."""
    steps = program.steps[PP_RANK]
    batches = [([], [program.messages[number] for number in program.initial_receives[PP_RANK]])]
    return batches + [([program.messages[number] for number in step.sends],
                       [program.messages[number] for number in step.receives]) for step in steps]


def test_the_runtimes_own_handler_runs_pairs_and_fills_one_step_after_the_other():
    program, computed = _program(), []
    runtime = _runtime(program, computed)
    assert not runtime.overlap_pairs
    runtime.run(program, [None] * 8, None)
    assert computed == [step.action for step in program.steps[PP_RANK]]
    assert runtime.transport.batches == _program_batches(program)


def test_the_two_step_kinds_are_dispatched_to_the_handler_registered_for_them():
    program, computed, dispatched = _program(), [], []
    runtime = _runtime(program, computed)

    def recording(kind):
        def handler(on, steps, state):
            dispatched.append((kind, tuple(steps)))
            PipelineRuntime.run_in_order(on, steps, state)
        return handler

    runtime.register(OVERLAP_F_B, recording(OVERLAP_F_B))
    runtime.register(WEIGHT_FILL, recording(WEIGHT_FILL))
    runtime.run(program, [None] * 8, None)
    steps, schedule = program.steps[PP_RANK], program.schedule
    expected = sorted([(index, OVERLAP_F_B) for index in schedule.pair_starts(PP_RANK)]
                      + [(index, WEIGHT_FILL) for index in schedule.fill_starts(PP_RANK)])
    assert dispatched == [(kind, steps[index:index + 2]) for index, kind in expected]
    assert computed == [step.action for step in steps]
    with pytest.raises(ValueError, match="runs action kind 'F' itself"):
        runtime.register("F", recording("F"))


@pytest.mark.timeout(60)
def test_the_overlaps_handlers_compute_every_step_once_and_post_in_the_programs_order():
    program, computed, hooks = _program(), [], _Hooks()
    runtime = _runtime(program, computed)
    ExchangeOverlap().install(runtime)
    assert runtime.overlap_pairs
    runtime.run(program, [None] * 8, None, hooks=hooks)
    steps, schedule = program.steps[PP_RANK], program.schedule
    fill_ws = [steps[index + 1].action for index in schedule.fill_starts(PP_RANK)]
    # a fill's W goes to its stage's backward_weight with the interleave's pause; every other step is computed
    assert sorted(computed, key=str) == sorted([step.action for step in steps if step.action not in fill_ws]
                                               + ["paused W"] * len(fill_ws), key=str)
    assert runtime.transport.batches == _program_batches(program)
    assert sorted(seen for seen in hooks.seen if seen[0] == "before") == sorted(
        ("before", step.action) for step in steps)
