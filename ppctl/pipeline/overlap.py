"""The expert-exchange overlap (``parallel.overlap_ep_comm``): the runtime's handlers of its two-step actions.

``ExchangeOverlap.install`` registers two handlers in the runtime's table (``ppctl.pipeline.runtime``):

- an overlapped pair (``OVERLAP_F_B``, DualPipe's F&B) runs its two halves interleaved
  (``ppctl.pipeline.interleave``): the backward in a second thread (it takes its inputs there, once the batch that
  receives them is posted), the forward here, whose batch is posted as soon as it ends; then the backward's batch.
- a weight fill (``WEIGHT_FILL``, ZB's W beside a backward, ``Schedule.with_weight_fills``) runs the same way: the
  backward here, the W in the second thread, computing its layers' weight gradients while the backward's exchanges
  travel.

One half computes at a time, the turn changing at each posted expert all-to-all (and TP or CP collective; each
half's on its own communicators, ``ppctl.parallel.lanes``), so one half's exchange travels while the other computes.
The batches go out in the program's order, so the checked program's proof holds. The collectives find the turn
through the worker's lanes, whose pacer is this overlap's interleave (handed to
``ppctl.parallel.groups.rank_groups_of``).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from ppctl.pipeline.interleave import PairInterleave
from ppctl.pipeline.program import Step
from ppctl.pipeline.runtime import OVERLAP_F_B, WEIGHT_FILL, PipelineRuntime, StepState
from ppctl.pipeline.trace import FILL_LABEL


class ExchangeOverlap:
    """The handlers of overlapped pairs and weight fills (module docstring), one per worker; ``on_piece(half, start,
    end)``: told the ``perf_counter`` span of each piece (a tracer's), or None."""

    def __init__(self, on_piece: Optional[Callable[[str, float, float], None]] = None):
        self.interleave = PairInterleave(on_piece)  # also the lanes' pacer (``ppctl.parallel.lanes.Pacer``)

    def install(self, runtime: PipelineRuntime) -> None:
        """Run ``runtime``'s overlapped pairs and weight fills through this overlap's handlers."""
        runtime.register(OVERLAP_F_B, self.run_pair)
        runtime.register(WEIGHT_FILL, self.run_fill)

    def run_pair(self, runtime: PipelineRuntime, steps: Sequence[Step], state: StepState) -> None:
        """An overlapped pair's halves interleaved (module docstring): the backward in the pair thread."""
        forward, backward = steps
        forward_posted = threading.Event()
        if not set(backward.inputs) & set(forward.receives):
            forward_posted.set()  # its receives were posted by an earlier batch
        backward_inputs = []

        def take_backward_inputs():
            forward_posted.wait()
            backward_inputs.extend(runtime.inputs(backward, state))

        def run_forward():
            try:
                started = runtime.mark()
                produced = runtime.computation(forward)(forward, inputs, state)
                runtime.traced(forward, started)
                runtime.hand_over(forward, produced, state)
            finally:
                forward_posted.set()

        def run_backward():
            started = runtime.mark()
            produced = runtime.computation(backward)(backward, backward_inputs, state)
            return produced, started, runtime.mark()

        inputs = runtime.inputs(forward, state)
        runtime.before(forward)
        runtime.before(backward)
        _, (produced, started, ended) = self.interleave.run(run_forward, run_backward, take_backward_inputs)
        runtime.traced(backward, started, ended)
        runtime.hand_over(backward, produced, state)
        del inputs, produced  # posted: the pair's messages die with it (``PipelineRuntime.run_in_order``)
        backward_inputs.clear()
        runtime.after(forward, state)
        runtime.after(backward, state)

    def run_fill(self, runtime: PipelineRuntime, steps: Sequence[Step], state: StepState) -> None:
        """A weight fill (module docstring): the backward here, holding the turn first, its batch posted as soon as
        it ends; the W in the pair thread, computing in the backward's exchange waits (pausing between its pieces),
        then its batch."""
        backward, weight = steps
        inputs = runtime.inputs(backward, state)
        runtime.before(backward)
        runtime.before(weight)

        def run_backward():
            started = runtime.mark()
            produced = runtime.computation(backward)(backward, inputs, state)
            runtime.traced(backward, started)
            runtime.hand_over(backward, produced, state)

        def run_weight():
            started = runtime.mark()
            action = weight.action
            runtime.stages[action.stage].backward_weight(action.microbatch, self.interleave.pause)
            return started, runtime.mark()

        labels = (f"{FILL_LABEL} {backward.action.kind}", f"{FILL_LABEL} {weight.action.kind}")
        _, (started, ended) = self.interleave.run(run_backward, run_weight, labels=labels)
        runtime.traced(weight, started, ended)
        runtime.hand_over(weight, None, state)
        inputs.clear()  # posted: the backward's messages die with it (``PipelineRuntime.run_in_order``)
        runtime.after(backward, state)
        runtime.after(weight, state)
