"""1F1B (PipeDream-flush, Megatron's non-interleaved schedule), one chunk per rank.

``pipedream_flush`` is the same schedule under the name the PipeDream-2BW paper gives it
(Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training"): 1F1B with a flush
at the end of every step, so every microbatch of a step sees the same weights (vanilla
semantics), unlike PipeDream-2BW's double-buffered weights.

``pipedream_2bw`` is PipeDream-2BW's pipeline: 1F1B run as one stream across steps. The
stream of K steps is 1F1B over K * m microbatches (step t's are t*m .. t*m+m-1): the
warm-up comes once before the first step and the cool-down once after the last; in
between, each rank's steady forward/backward pairs run on from one step into the next,
and the rank takes its optimizer step right after its last backward of a step, with no
flush and no barrier. Microbatches of step t+1 that entered before that update ran on
the version of step t+1 (``ppctl.optim.delay``): two weight versions per rank, and the
update W(t+1) = W(t) - lr * g_t(W(t-1)) of ``optimizer.gradient_delay=1``. It needs
m >= pp: a rank's first forward of step t+2 must come after its update of step t.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ppctl.parallel.placement import looped_placement

from .base import BACKWARD, FORWARD, Action, Schedule, ScheduleSpec, at_least_one_microbatch, single_chunk_only


def one_f_one_b(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build 1F1B: per rank, warm-up forwards, then one forward / one backward, then the remaining backwards.

    Rank r runs ``min(pp - r - 1, num_microbatches)`` warm-up forwards, so at most
    ``pp - r`` microbatches are in flight on it. With ``pp=1`` this is plain
    gradient accumulation: F0 BW0 F1 BW1 ...
    """
    single_chunk_only("1f1b", vpp)
    actions = tuple(_rank_actions(pp_rank, pp, num_microbatches) for pp_rank in range(pp))
    return Schedule("1f1b", pp, 1, num_microbatches, looped_placement(pp, 1), actions)


def _rank_actions(pp_rank: int, pp: int, num_microbatches: int) -> tuple[Action, ...]:
    num_warmup = min(pp - pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    warmup = [Action(FORWARD, pp_rank, mb) for mb in range(num_warmup)]
    steady = []
    for i in range(num_steady):
        steady += [Action(FORWARD, pp_rank, num_warmup + i), Action(BACKWARD, pp_rank, i)]
    cooldown = [Action(BACKWARD, pp_rank, mb) for mb in range(num_steady, num_microbatches)]
    return tuple(warmup + steady + cooldown)


ONE_F_ONE_B_SPEC = ScheduleSpec(
    name="1f1b",
    multi_chunk=False,
    splits_backward=False,
    description="one forward, one backward (PipeDream-flush); at most pp microbatches in flight",
    microbatch_error=at_least_one_microbatch,
    generate=one_f_one_b,
)


def pipedream_flush(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """1F1B under its PipeDream name: the same actions, the same placement."""
    return dataclasses.replace(one_f_one_b(pp, vpp, num_microbatches), name="pipedream_flush")


PIPEDREAM_FLUSH_SPEC = dataclasses.replace(
    ONE_F_ONE_B_SPEC,
    name="pipedream_flush",
    description="PipeDream-flush, the PipeDream-2BW paper's name for 1F1B: an alias of 1f1b (vanilla semantics)",
    generate=pipedream_flush,
)


def pipedream_2bw(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """PipeDream-2BW's stream: 1F1B over ``num_microbatches`` (one step's, or the steps' of a stream together)."""
    single_chunk_only("pipedream_2bw", vpp)
    return dataclasses.replace(one_f_one_b(pp, vpp, num_microbatches), name="pipedream_2bw")


def microbatches_cover_pipeline(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """2BW's rule: a step has at least pp microbatches, so a rank's update of step t comes before its first
    forward of step t+2 (only two weight versions are kept)."""
    if num_microbatches < pp:
        return (f"num_microbatches={num_microbatches} must be at least pp={pp} (each rank keeps two weight "
                f"versions: its update after step t must come before its first forward of step t+2)")
    return None


PIPEDREAM_2BW_SPEC = ScheduleSpec(
    name="pipedream_2bw",
    multi_chunk=False,
    splits_backward=False,
    description="PipeDream-2BW: 1F1B streamed across steps with no flush, two weight versions per rank and "
                "one step of gradient delay (optimizer.gradient_delay=1)",
    microbatch_error=microbatches_cover_pipeline,
    generate=pipedream_2bw,
    streams_steps=True,
)
