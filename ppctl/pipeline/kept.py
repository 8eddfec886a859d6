"""Built schedules and their sends, kept per size: ``ppctl plan`` and config validation share them.

The planner builds a schedule for its memory model and times its sends (``sends_only``) for
its step time; the schedule checker, which validation runs on the few candidates the planner
keeps, lowers the same schedule: kept here, the checker starts from both instead of building
and numbering the schedule again. The four sizes decide a built schedule, and a schedule and
its ``SendsOnly`` are immutable, so sharing them changes nothing a caller sees. Both caches are
bounded: a large schedule holds hundreds of thousands of actions.
"""

from __future__ import annotations

from functools import lru_cache

from .program import SendsOnly, sends_only
from .schedules import Schedule, build_schedule

KEPT_SCHEDULES = 64  # the planner revisits a few sizes across thousands of layouts


@lru_cache(maxsize=KEPT_SCHEDULES)
def kept_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """``build_schedule``, kept (a ``ScheduleError`` is raised again each time, not kept)."""
    return build_schedule(name, pp, vpp, num_microbatches)


@lru_cache(maxsize=KEPT_SCHEDULES)
def kept_sends(name: str, pp: int, vpp: int, num_microbatches: int) -> SendsOnly:
    """``sends_only`` of ``kept_schedule``, kept."""
    return sends_only(kept_schedule(name, pp, vpp, num_microbatches))


__all__ = ["KEPT_SCHEDULES", "kept_schedule", "kept_sends"]
