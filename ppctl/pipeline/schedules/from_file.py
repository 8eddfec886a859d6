"""Your own schedule from a file (``schedule=custom schedule.file=PATH``): torch's CSV or ppctl's JSON.

Two forms, told apart by the file's suffix:

- ``.csv``: torch.distributed.pipelining's compute-only CSV (``_dump_csv`` / ``_load_csv``):
  one row per pp rank, one cell per action, ``<stage><kind><microbatch>`` with torch's
  kinds: ``F`` forward, ``B`` whole backward (ppctl's ``BW``), ``I`` input-gradient
  backward (ppctl's ``B``), ``W`` weight gradient; an empty cell is an idle slot, and
  ``(<forward>;<backward>)OVERLAP_F_B`` an overlapped pair. The placement is read from
  the file: each stage runs on the rank whose row names it (one model copy).
- ``.json``: what ``ppctl inspect-schedule --json`` prints (or its ``program`` alone):
  per rank its steps (``kind``, ``stage``, ``microbatch``) and ``overlapped`` pairs,
  and the ``placement`` (stage -> rank, and the model copies: DualPipe's two).

Either way the file gives the computations; ppctl lowers them to the program (the
messages and where receives are posted) and the checker proves it before anything
starts. The microbatch count is the file's (its largest microbatch + 1).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any, Optional

from ppctl.parallel.placement import Placement

from .base import (ACTION_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError,
                   ScheduleSpec, at_least_one_microbatch)

CUSTOM = "custom"
# torch's compute kinds -> ppctl's, and back
_FROM_TORCH = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
_TO_TORCH = {kind: torch_kind for torch_kind, kind in _FROM_TORCH.items()}
_TORCH_ACTION = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")
_TORCH_PAIR = re.compile(r"^\((.*);(.*)\)OVERLAP_F_B$")
MAX_FILE_BYTES = 256 * 2**20  # far above any schedule's (a million actions as JSON is about 60 MiB)


def read_schedule_file(path: str | Path) -> Schedule:
    """The schedule in the file at ``path`` (``.csv`` or ``.json``); ``ScheduleError`` naming the file otherwise."""
    path = Path(path)
    try:
        _refuse_unless_regular(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ScheduleError(f"schedule.file {path}: cannot read it ({getattr(error, 'strerror', None) or error})")
    if path.suffix.lower() == ".csv":
        ranks, overlapped, placement = _read_csv(path, text), None, None
    elif path.suffix.lower() == ".json":
        ranks, overlapped, placement = _read_json(path, text)
    else:
        raise ScheduleError(f"schedule.file {path}: a schedule file ends in .csv (torch's CSV) or .json (ppctl's)")
    return _schedule(path, ranks, overlapped, placement)


def _refuse_unless_regular(path: Path) -> None:
    """A schedule file is a regular file of sensible size: a FIFO or a device would block or never end."""
    if path.exists() and not path.is_file():
        raise ScheduleError(f"schedule.file {path}: not a regular file (a FIFO, a device or a folder would block or "
                            f"never end); give the path of a .csv or .json file")
    if path.is_file() and path.stat().st_size > MAX_FILE_BYTES:
        raise ScheduleError(f"schedule.file {path}: {path.stat().st_size:,} bytes, more than a schedule file's "
                            f"{MAX_FILE_BYTES // 2**20} MiB")


# --- torch's CSV ------------------------------------------------------------------------------------

def _read_csv(path: Path, text: str) -> list[list[Any]]:
    """Per rank, its actions and overlapped pairs as they come: an ``Action`` or a (forward, backward) tuple."""
    ranks = []
    for row_number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [cell.strip() for cell in row]
        ranks.append([_torch_cell(path, row_number, cell) for cell in cells if cell])
    return ranks


def _torch_cell(path: Path, row: int, cell: str):
    """One cell: an action, or an overlapped pair of two."""
    pair = _TORCH_PAIR.match(cell)
    if pair:
        return tuple(_torch_action(path, row, part.strip()) for part in pair.groups())
    return _torch_action(path, row, cell)


def _torch_action(path: Path, row: int, text: str) -> Action:
    """``2F0`` -> F(stage 2, mb 0); only compute actions with a microbatch."""
    match = _TORCH_ACTION.match(text)
    if not match or match.group(2) not in _FROM_TORCH or not match.group(3):
        raise ScheduleError(f"schedule.file {path}: row {row} (rank {row - 1}): {text!r} is not a compute action "
                            f"<stage><F|B|I|W><microbatch> (e.g. 0F0; a compute-only CSV has no sends or receives)")
    return Action(_FROM_TORCH[match.group(2)], int(match.group(1)), int(match.group(3)))


def schedule_csv(schedule: Schedule) -> str:
    """``schedule`` in torch's compute-only CSV (one row per rank; pairs as ``(F;B)OVERLAP_F_B``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for pp_rank, rank_actions in enumerate(schedule.actions):
        cells = [_torch_text(action) for action in rank_actions]
        for index in reversed(schedule.pair_starts(pp_rank)):
            cells[index:index + 2] = [f"({cells[index]};{cells[index + 1]})OVERLAP_F_B"]
        writer.writerow(cells)
    return buffer.getvalue()


def _torch_text(action: Action) -> str:
    return f"{action.stage}{_TO_TORCH[action.kind]}{action.microbatch}"


# --- ppctl's JSON -------------------------------------------------------------------------------------

def _read_json(path: Path, text: str) -> tuple[list[list[Any]], list[tuple[int, ...]], Optional[Placement]]:
    """Per rank its actions, its overlapped pair starts, and the placement the file gives (None: inferred)."""
    try:
        data = json.loads(text)
        program = data.get("program", data)
        ranks = sorted(program["ranks"], key=lambda rank: rank["rank"])
        actions = [[Action(str(step["kind"]), int(step["stage"]), int(step["microbatch"])) for step in rank["steps"]]
                   for rank in ranks]
        overlapped = [tuple(int(index) for index in rank.get("overlapped", ())) for rank in ranks]
        placement = program.get("placement")
        if placement is not None:
            placement = Placement(tuple(int(owner) for owner in placement["owners"]), int(placement.get("copies", 1)))
    except json.JSONDecodeError as error:
        raise ScheduleError(f"schedule.file {path}: not JSON ({error.msg}, line {error.lineno} column {error.colno})")
    except RecursionError:
        raise ScheduleError(f"schedule.file {path}: nested too deeply to be a ppctl schedule (inspect-schedule "
                            f"--json writes a few levels: program, ranks, steps)") from None
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ScheduleError(f"schedule.file {path}: not a ppctl schedule (inspect-schedule --json): "
                            f"{type(error).__name__} {error}")
    return actions, overlapped, placement


# --- the schedule -----------------------------------------------------------------------------------

def _schedule(path: Path, ranks: list[list[Any]], overlapped: Optional[list[tuple[int, ...]]],
              placement: Optional[Placement]) -> Schedule:
    """The ``custom`` schedule of the actions read, pairs unfolded; the placement inferred when not given."""
    if not ranks or not any(ranks):
        raise ScheduleError(f"schedule.file {path}: holds no actions")
    if overlapped is None:  # CSV: pairs come as tuples among the actions
        ranks, overlapped = _unfold_pairs(ranks)
    actions = tuple(tuple(rank) for rank in ranks)
    for pp_rank, rank_actions in enumerate(actions):
        for action in rank_actions:
            if action.kind not in ACTION_KINDS or action.stage < 0 or action.microbatch < 0:
                raise ScheduleError(f"schedule.file {path}: rank {pp_rank}: {action} is not an action "
                                    f"(kinds {', '.join(ACTION_KINDS)}; stage and microbatch from 0)")
    if placement is None:
        placement = _inferred_placement(path, actions)
    pp = len(actions)
    num_microbatches = 1 + max(action.microbatch for rank_actions in actions for action in rank_actions)
    pairs = tuple(overlapped) if any(overlapped) else ()
    return Schedule(CUSTOM, pp, max(1, len(placement) // pp), num_microbatches, placement, actions, pairs)


def _unfold_pairs(ranks: list[list[Any]]) -> tuple[list[list[Action]], list[tuple[int, ...]]]:
    """Each overlapped pair (a plain tuple of two actions) becomes its two actions; its start index is noted."""
    unfolded, starts = [], []
    for rank in ranks:
        actions, rank_starts = [], []
        for item in rank:
            if not isinstance(item, Action):  # a pair (an ``Action`` is a named tuple itself)
                rank_starts.append(len(actions))
                actions.extend(item)
            else:
                actions.append(item)
        unfolded.append(actions)
        starts.append(tuple(rank_starts))
    return unfolded, starts


def _inferred_placement(path: Path, actions: tuple[tuple[Action, ...], ...]) -> Placement:
    """Each stage on the rank whose actions name it; every stage from 0 up named, each by one rank."""
    owners: dict[int, int] = {}
    for pp_rank, rank_actions in enumerate(actions):
        for action in rank_actions:
            owner = owners.setdefault(action.stage, pp_rank)
            if owner != pp_rank:
                raise ScheduleError(f"schedule.file {path}: stage {action.stage} runs on rank {owner} and on rank "
                                    f"{pp_rank}; a stage belongs to one rank")
    missing = sorted(set(range(max(owners) + 1)) - set(owners))
    if missing:
        raise ScheduleError(f"schedule.file {path}: stage {missing[0]} has no action, yet stage {max(owners)} has; "
                            f"the stages are numbered from 0 without gaps")
    return Placement(tuple(owners[stage] for stage in range(len(owners))))


def _read_not_generated(*sizes: int) -> Schedule:
    raise ScheduleError("schedule custom is read from schedule.file, not generated")


def _placement_read_from_file(pp: int, chunks_per_rank: int) -> Placement:
    raise ScheduleError("schedule custom places its stages as schedule.file says")


# Not in the registry of generated schedules (``SCHEDULE_SPECS``): the config layer reads the file.
CUSTOM_SPEC = ScheduleSpec(
    name=CUSTOM,
    multi_chunk=True,
    splits_backward=False,
    description="your own schedule, read from schedule.file: torch's compute-only CSV or ppctl's JSON",
    microbatch_error=at_least_one_microbatch,
    generate=_read_not_generated,
    placement=_placement_read_from_file,
    placement_name="as schedule.file places them",
)
