"""Pipeline schedules as data: the registry of schedule names and ``build_schedule``.

Every schedule is a pure function ``(pp, vpp, num_microbatches) -> Schedule`` in its
own module; this package maps names to them. ``schedule=custom`` is read from a file
instead (``read_schedule_file``; its entry ``CUSTOM_SPEC`` stands outside the registry).
Import from here::

    from ppctl.pipeline.schedules import SCHEDULE_SPECS, build_schedule, Action, Schedule
"""

from __future__ import annotations

from .base import (ACTION_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                   Schedule, ScheduleError, ScheduleSpec)
from .dualpipe import DUALPIPE_SPEC, DUALPIPEV_SPEC
from .from_file import CUSTOM, CUSTOM_SPEC, read_schedule_file, schedule_csv
from .gpipe import GPIPE_SPEC
from .hanayo import HANAYO_SPEC
from .interleaved import INTERLEAVED_SPEC
from .looped import INTERLEAVED_ZB_SPEC, LOOPED_BFS_SPEC
from .one_f_one_b import ONE_F_ONE_B_SPEC, PIPEDREAM_2BW_SPEC, PIPEDREAM_FLUSH_SPEC
from .vshape import V_HALF_SPEC, V_MIN_SPEC, ZBV_SPEC
from .zero_bubble import ZB_H1_SPEC


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        GPIPE_SPEC,
        ONE_F_ONE_B_SPEC,
        PIPEDREAM_FLUSH_SPEC,
        PIPEDREAM_2BW_SPEC,
        INTERLEAVED_SPEC,
        LOOPED_BFS_SPEC,
        ZB_H1_SPEC,
        INTERLEAVED_ZB_SPEC,
        HANAYO_SPEC,
        ZBV_SPEC,
        V_HALF_SPEC,
        V_MIN_SPEC,
        DUALPIPE_SPEC,
        DUALPIPEV_SPEC,
    )
}


def build_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build the named schedule for ``pp`` ranks, ``vpp`` chunks per rank and ``num_microbatches``.

    Raises ``ScheduleError`` (one line) for an unknown name or bad sizes.
    """
    spec = SCHEDULE_SPECS.get(name)
    if spec is None:
        raise ScheduleError(f"schedule {name!r} is unknown; choose one of {', '.join(SCHEDULE_SPECS)}")
    if pp < 1 or vpp < 1:
        raise ScheduleError(f"schedule {name}: pp={pp} and vpp={vpp} must both be at least 1")
    error = spec.microbatch_error(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule {name}: {error}")
    return spec.generate(pp, vpp, num_microbatches)


def streams_steps(schedule: Schedule) -> bool:
    """Whether ``schedule`` runs consecutive steps as one stream (its registry entry says so: PipeDream-2BW)."""
    spec = SCHEDULE_SPECS.get(schedule.name)
    return spec is not None and spec.streams_steps


def stream_of(schedule: Schedule, steps: int) -> Schedule:
    """``steps`` consecutive steps of a streaming ``schedule`` as one schedule: its generator over ``steps`` times its
    microbatches (step t's are the t-th run of them), so the pipeline fills and drains once."""
    return build_schedule(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches * steps)


__all__ = [
    "ACTION_KINDS", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "CUSTOM", "CUSTOM_SPEC", "FORWARD", "Action",
    "Schedule", "ScheduleError", "ScheduleSpec", "SCHEDULE_SPECS", "build_schedule", "read_schedule_file",
    "schedule_csv", "stream_of", "streams_steps",
]
