"""Measured timelines: per-rank timestamps of each action and each wait for communication.

A ``Tracer`` is handed to the runtime only when ``trainer.trace=true``; with tracing
off the runtime skips every call (one ``is None`` check per action). Times are
``time.perf_counter`` seconds relative to the step's start on each rank. Each action also
records the CPU time its thread spent in it (``time.thread_time``): on a CPU device, a wall
time well above it means the thread waited for a core (another worker, gloo's threads),
which no cost model of the schedule contains.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ppctl.pipeline.schedules import Action


@dataclass
class Tracer:
    """Collects one rank's actions and waits for the current step."""

    rank: int
    step_start: float = field(default_factory=time.perf_counter)
    actions: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    exchanges: list[tuple[float, float, int]] = field(default_factory=list)  # expert-parallel all-to-alls
    pieces: list[tuple[str, float, float]] = field(default_factory=list)  # overlapped pairs' halves, piece by piece
    step_cpu_start: float = field(default_factory=time.thread_time)
    # the thread's CPU clock at each action's start and end, in order, relative to the step's start
    cpu_spans: list[tuple[float, float]] = field(default_factory=list)

    def start_step(self) -> None:
        """Forget the previous step and take the time origins."""
        self.step_start, self.step_cpu_start = time.perf_counter(), time.thread_time()
        self.actions.clear()
        self.waits.clear()
        self.cpu_spans.clear()
        self.exchanges.clear()
        self.pieces.clear()

    @staticmethod
    def mark() -> tuple[float, float]:
        """(wall, thread CPU) seconds now: an action's start, for ``action``."""
        return time.perf_counter(), time.thread_time()

    def action(self, action: Action, started: tuple[float, float], ended: tuple[float, float] | None = None) -> None:
        """Record one computed action that began at ``started`` (``mark``) and ends now; or, for the backward half of
        an overlapped pair (run in another thread), ended at ``ended`` (a ``mark`` in that thread): its CPU span is
        that thread's, placed to end at this thread's present CPU time."""
        cpu_end, end = time.thread_time(), time.perf_counter()
        cpu_start = started[1]
        if ended is not None:
            end, cpu_start = ended[0], cpu_end - (ended[1] - started[1])
        self.actions.append((action.kind, action.stage, action.microbatch,
                             started[0] - self.step_start, end - self.step_start))
        self.cpu_spans.append((cpu_start - self.step_cpu_start, cpu_end - self.step_cpu_start))

    def exchange(self, start: float, end: float, lane: int) -> None:
        """Record one expert-parallel all-to-all (``perf_counter`` span; ``lane``: 0 forward, 1 backward)."""
        self.exchanges.append((start - self.step_start, end - self.step_start, lane))

    def piece(self, half: str, start: float, end: float) -> None:
        """Record one piece of an overlapped pair's half (``ppctl.pipeline.interleave``; ``half``: F or B)."""
        self.pieces.append((half, start - self.step_start, end - self.step_start))

    def exchange_seconds(self) -> float:
        """Total time spent in expert-parallel all-to-alls this step (both lanes)."""
        return sum(end - start for start, end, _lane in self.exchanges)

    def wait(self, start: float, end: float) -> None:
        """Record time spent waiting for a message."""
        self.waits.append((start - self.step_start, end - self.step_start))

    def compute_seconds(self) -> float:
        """Total time spent computing actions this step."""
        return sum(end - start for *_, start, end in self.actions)

    def wait_seconds(self) -> float:
        """Total time spent waiting for messages this step."""
        return sum(end - start for start, end in self.waits)

    def snapshot(self) -> dict:
        """A picklable record of this step for gathering to one rank."""
        return {"rank": self.rank, "actions": list(self.actions), "waits": list(self.waits),
                "cpu_spans": list(self.cpu_spans), "exchanges": list(self.exchanges), "pieces": list(self.pieces)}


def chrome_trace(snapshots: list[dict], step: int) -> dict:
    """A Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one track per rank."""
    events = []
    for snapshot in snapshots:
        rank = snapshot["rank"]
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        cpu_spans = snapshot.get("cpu_spans") or [None] * len(snapshot["actions"])
        for (kind, stage, microbatch, start, end), cpu in zip(snapshot["actions"], cpu_spans, strict=True):
            arguments = {"stage": stage, "microbatch": microbatch, "step": step}
            if cpu is not None:
                arguments["cpu_ms"] = round((cpu[1] - cpu[0]) * 1e3, 4)
            events.append({"name": f"{kind}{microbatch}", "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": arguments})
        for start, end in snapshot["waits"]:
            events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": rank,
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {"step": step}})
        for start, end, lane in snapshot.get("exchanges", []):  # on a track of their own below the rank's
            events.append({"name": "a2a", "cat": EXCHANGE_CATEGORY, "ph": "X", "pid": 1, "tid": rank,
                           "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "args": {"lane": "backward" if lane else "forward", "step": step}})
        for index, (half, start, end) in enumerate(snapshot.get("pieces", [])):  # the interleave's, on a third
            events.append({"name": f"{half} piece", "cat": PIECE_CATEGORY, "ph": "X", "pid": 2, "tid": rank,
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {"order": index, "step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


EXCHANGE_CATEGORY = "a2a"
PIECE_CATEGORY = "piece"
FILL_LABEL = "fill"  # a weight fill's pieces are labelled "fill B" and "fill W" (``ppctl.pipeline.runtime``)


def exposed_exchange_seconds(actions, exchanges, pieces=()) -> float:
    """The time one rank spent in expert all-to-alls while it computed nothing: ``actions`` are ``(kind, start,
    end)``, ``exchanges`` ``(start, end, lane)``, ``pieces`` ``(half, start, end)`` (the interleave's, when its
    pairs and weight fills ran interleaved). An action computes over its span less its own exchanges
    (``_own_exchanges``), one that holds pieces over its pieces only (the two halves' spans overlap); an exchange is
    exposed where nothing computes. Run one after another, every exchange is exposed; in an overlapped pair or a
    weight fill, the part the other half's compute covers is not."""
    computing = [(start, end) for _half, start, end in pieces]
    for kind, start, end in _actions_without_pieces(actions, pieces):
        computing += _minus([(start, end)], _own_exchanges(kind, start, end, exchanges))
    return sum(stop - begin for begin, stop in _minus(_union([(s, e) for s, e, _ in exchanges]), computing))


def _actions_without_pieces(actions, pieces, label: str = "") -> list:
    """The ``(kind, start, end)`` actions no piece falls inside (no piece of a half whose label starts with
    ``label``)."""
    spans = [(start, end) for half, start, end in pieces if half.startswith(label)]
    return [(kind, start, end) for kind, start, end in actions
            if not any(start <= piece_start and piece_end <= end for piece_start, piece_end in spans)]


def _own_exchanges(kind: str, start: float, end: float, exchanges) -> list[tuple[float, float]]:
    """The spans of an action's own lane's exchanges inside its span: a forward's are the forward lane's, a
    backward's and a W's the backward lane's (the first stage's W runs its whole backward)."""
    lane = 0 if kind == "F" else 1
    return [(max(s, start), min(e, end)) for s, e, exchange_lane in exchanges
            if exchange_lane == lane and s < end and e > start]


def exchange_costs(ranks, chunks_per_copy: int, pairs_at_once: bool):
    """Costs in ms (per microbatch through a rank's layers of one copy) of traced ranks, each ``(actions,
    exchanges)`` as ``exposed_exchange_seconds`` takes them (seconds): each kind's mean time less the all-to-all its
    actions waited (their own lane's), and the mean all-to-all a forward waited as ``A2A``; unless the run had its
    overlapped pairs ``pairs_at_once``, ``FB`` is both halves in turn, each with its all-to-all. ``A2A_SPLIT``: the
    mean count of a backward's own exchanges (dispatch and combine of each of its MoE layers), at least 1. A rank may
    also give its pieces (``(actions, exchanges, pieces)``): the actions of weight fills are then left out, their
    spans holding both halves."""
    from ppctl.pipeline.simulate import Costs

    computing: dict[str, list[float]] = {}
    waited: list[float] = []
    splits: list[int] = []
    for actions, exchanges, *pieces in ranks:
        for kind, start, end in _actions_without_pieces(actions, pieces[0] if pieces else [], FILL_LABEL):
            spans = _own_exchanges(kind, start, end, exchanges)
            own = sum(stop - begin for begin, stop in spans)
            computing.setdefault(kind, []).append((end - start - own) * 1e3)
            if kind == "F":
                waited.append(own * 1e3)
            elif kind in ("B", "BW"):
                splits.append(len(spans))
    mean = {kind: sum(values) / len(values) * chunks_per_copy for kind, values in computing.items()}
    backward = mean["B"] if "B" in mean else mean.get("BW", 0.0)
    forward, weight = mean.get("F", 0.0), mean.get("W", 0.0)
    exchange = sum(waited) / len(waited) * chunks_per_copy if waited else 0.0
    in_turn = None if pairs_at_once else forward + backward + weight + 2 * exchange
    split = max(1, round(sum(splits) / len(splits))) if splits else 1
    return Costs(F=forward, B=backward, W=weight, A2A=exchange, FB=in_turn, A2A_SPLIT=split)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted spans covering exactly ``spans``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _minus(spans: list[tuple[float, float]], removed: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` less every span of ``removed``."""
    left = _union(spans)
    for cut_start, cut_end in _union(removed):
        left = [piece for start, end in left
                for piece in ((start, min(end, cut_start)), (max(start, cut_end), end)) if piece[1] > piece[0]]
    return left


def _laid_out_in_sequence(all_traces: list[tuple[int, list[dict]]]) -> list[tuple[int, list[dict]]]:
    """Shift each step's times (relative to its own start) to follow the previous step."""
    shifted, offset = [], 0.0
    for step, snapshots in all_traces:
        moved = []
        for snapshot in snapshots:
            actions = [(k, s, m, start + offset, end + offset) for k, s, m, start, end in snapshot["actions"]]
            waits = [(start + offset, end + offset) for start, end in snapshot["waits"]]
            exchanges = [(start + offset, end + offset, lane) for start, end, lane in snapshot.get("exchanges", [])]
            pieces = [(half, start + offset, end + offset) for half, start, end in snapshot.get("pieces", [])]
            moved.append({"rank": snapshot["rank"], "actions": actions, "waits": waits,
                          "cpu_spans": snapshot.get("cpu_spans", []), "exchanges": exchanges, "pieces": pieces})
        shifted.append((step, moved))
        offset += max((end for snap in snapshots for *_, end in snap["actions"]), default=0.0) * 1.02
    return shifted


def measured_timelines(snapshots: list[dict], pipeline_ranks: list[int], program):
    """``RankTimeline`` rows (one per pipeline rank, in ms) from one step's gathered snapshots of ``program``.

    Each rank's recorded actions are its steps of the program, in order; an overlapped pair
    shows as its two halves, as measured. Peak activations are in the schedule's unit
    (``Schedule.chunks_per_copy``).
    """
    from ppctl.pipeline.simulate import RankTimeline, TimedAction, peak_activations

    schedule = program.schedule
    by_rank = {snapshot["rank"]: snapshot for snapshot in snapshots}
    rows = []
    for pp_rank, global_rank in enumerate(pipeline_ranks):
        snapshot = by_rank[global_rank]
        actions = [TimedAction(kind, stage, mb, start * 1e3, end * 1e3)
                   for kind, stage, mb, start, end in snapshot["actions"]]
        steps = [step.action for step in program.steps[pp_rank]]
        waits = [(start * 1e3, end * 1e3) for start, end in snapshot["waits"]]
        rows.append(RankTimeline(pp_rank, actions, peak_activations(steps, schedule.chunks_per_copy), waits))
    return rows


def rows_from_chrome_trace(trace: dict) -> tuple[int, list]:
    """(step, one ``RankTimeline`` per traced rank, in ms from the step's first action) of the last step of a
    ``trace.json`` that ``write_trace_files`` wrote; ValueError when it holds no step."""
    from ppctl.pipeline.simulate import RankTimeline, TimedAction

    events = [event for event in trace.get("traceEvents", [])
              if event.get("ph") == "X" and "step" in event.get("args", {})
              and event.get("cat") not in (EXCHANGE_CATEGORY, PIECE_CATEGORY)]
    if not events:
        raise ValueError("it holds no traced step (was it written by a run with trainer.trace=true?)")
    step = max(event["args"]["step"] for event in events)
    events = [event for event in events if event["args"]["step"] == step]
    origin = min(event["ts"] for event in events)
    rows: dict[int, RankTimeline] = {}
    for event in sorted(events, key=lambda event: event["ts"]):
        row = rows.setdefault(event["tid"], RankTimeline(event["tid"], [], 0.0))
        start, end = (event["ts"] - origin) / 1e3, (event["ts"] + event["dur"] - origin) / 1e3
        if event["cat"] == "wait":
            row.waits.append((start, end))
        else:
            row.actions.append(TimedAction(event["cat"], event["args"]["stage"], event["args"]["microbatch"], start, end))
    return step, [rows[rank] for rank in sorted(rows)]


def measured_makespan_and_bubble(rows) -> tuple[float, float]:
    """(makespan, bubble ratio) of measured timelines, as the simulator defines them: the last action's end, and
    (makespan - the busiest rank's compute) / that compute."""
    makespan = max(action.end for row in rows for action in row.actions)
    busiest = max(sum(action.end - action.start for action in row.actions) for row in rows)
    return makespan, (makespan - busiest) / busiest if busiest > 0 else 0.0


def overhead_per_action(rows) -> float:
    """The runtime's own time per action: what each rank spent, up to its last action's end, neither computing an
    action nor waiting for a message (posting sends and receives, handing over, bookkeeping), over its actions;
    the mean over ranks."""
    shares = []
    for row in rows:
        if row.actions:
            end = max(action.end for action in row.actions)
            busy = sum(action.end - action.start for action in row.actions)
            waiting = sum(min(stop, end) - start for start, stop in row.waits if start < end)
            shares.append(max(0.0, end - busy - waiting) / len(row.actions))
    return sum(shares) / len(shares) if shares else 0.0


def on_core_shares(snapshot: dict) -> dict[str, float] | None:
    """The share of one rank's traced wall time its thread spent on a core (thread CPU time / wall time, at most
    1), from its first action's start to its last action's end: in its actions (``actions``), and in the
    runtime's time between them, less the waits for messages (``between``: posting, handing over, bookkeeping;
    a blocked wait uses no CPU, and its CPU counts here). None without CPU times. Meaningful on CPU devices
    only: a CUDA action's host thread waits for the GPU, so its share is low by design."""
    actions, spans = snapshot["actions"], snapshot.get("cpu_spans")
    if not spans or not actions:
        return None
    action_wall = sum(end - start for *_, start, end in actions)
    action_cpu = sum(end - start for start, end in spans)
    first, last = actions[0][3], actions[-1][4]
    waiting = sum(min(stop, last) - max(start, first) for start, stop in snapshot["waits"]
                  if start < last and stop > first)
    between_wall = last - first - action_wall - waiting
    between_cpu = spans[-1][1] - spans[0][0] - action_cpu
    return {"actions": min(action_cpu / action_wall, 1.0) if action_wall > 0 else 1.0,
            "between": min(between_cpu / between_wall, 1.0) if between_wall > 0 else 1.0}


def costs_from_measurement(rows, chunks_per_copy: int, include_overhead: bool = False):
    """A cost model (ms per microbatch through a rank's layers of one copy) from the measured mean action times;
    ``include_overhead`` adds the runtime's time between actions (``overhead_per_action``) to each action."""
    from ppctl.pipeline.simulate import Costs

    durations: dict[str, list[float]] = {}
    for row in rows:
        for action in row.actions:
            durations.setdefault(action.kind, []).append(action.end - action.start)
    extra = overhead_per_action(rows) if include_overhead else 0.0
    mean = {kind: (sum(values) / len(values) + extra) * chunks_per_copy for kind, values in durations.items()}
    # B: the measured input-gradient half where the schedule splits backwards (DualPipe splits only
    # some), else a whole backward's time (its W is then 0, so a simulated BW takes B + W = BW)
    backward = mean["B"] if "B" in mean else mean.get("BW", 0.0)
    return Costs(F=mean.get("F", 0.0), B=backward, W=mean.get("W", 0.0))


def write_trace_files(all_traces: list[tuple[int, list[dict]]], trainer, run_dir: Path) -> None:
    """``trace.json`` (every step, every rank) and the last step's measured and simulated timelines."""
    from ppctl.pipeline.render import write_timeline
    from ppctl.pipeline.simulate import simulate

    run_dir = Path(run_dir)
    events = {"traceEvents": [], "displayTimeUnit": "ms"}
    for step, snapshots in _laid_out_in_sequence(all_traces):
        events["traceEvents"] += chrome_trace(snapshots, step)["traceEvents"]
    temporary = run_dir / "trace.json.tmp"
    temporary.write_text(json.dumps(events))
    temporary.replace(run_dir / "trace.json")

    step, snapshots = all_traces[-1]
    program, context = trainer.last_program, trainer.context  # a stream's (2BW): its steps together
    schedule = program.schedule
    replica = context.layout.rank(**{**context.coords, "pp": 0})
    pipeline_ranks = context.layout.group_of("pp", replica)
    rows = measured_timelines(snapshots, pipeline_ranks, program)
    makespan, bubble = measured_makespan_and_bubble(rows)
    streamed = schedule.num_microbatches // trainer.data.num_microbatches  # steps in the program: 1, or a stream's
    steps = f"step {step}" if streamed == 1 else f"steps {step}-{step + streamed - 1}"
    title = f"{schedule.name}: measured {steps} (pp={schedule.pp}, {schedule.num_microbatches} microbatches)"
    lines = [f"makespan {makespan:.1f} ms; bubble ratio {bubble:.3f} "
             "(makespan - busiest rank's compute) / that compute; grey = waiting for a message"]
    write_timeline(rows, run_dir / "timeline.svg", title, lines, time_label="ms")

    predicted = simulate(program, costs_from_measurement(rows, schedule.chunks_per_copy))
    title = f"{schedule.name}: simulated with the measured mean action times"
    lines = [f"makespan {predicted.makespan:.1f} ms; bubble ratio {predicted.bubble_ratio:.3f}"]
    write_timeline(predicted.ranks, run_dir / "timeline_simulated.svg", title, lines, time_label="ms")


@dataclass(frozen=True)
class PostingCosts:
    """The runtime's time between actions, split (ms): a fixed part per action, and a part per point-to-point
    operation it posts after the action (each send, and each receive posted ahead)."""

    per_action: float
    per_operation: float


def posting_fit(rows, program) -> PostingCosts:
    """``PostingCosts`` fitted (least squares) to the measured gaps between each rank's consecutive actions, less
    the waits for messages inside them, against the operations the program posts after each action.

    Measured on gloo, the gap after an action that posts nothing is about 0.01 ms and after one that posts
    one or two operations 0.2-0.8 ms: the time is in the posts, not in the actions.
    """
    gaps, operations = [], []
    for row, steps in zip(rows, program.steps):
        for before, after, step in zip(row.actions, row.actions[1:], steps):
            waited = sum(max(0.0, min(stop, after.start) - max(start, before.end)) for start, stop in row.waits)
            gaps.append(max(after.start - before.end - waited, 0.0))
            operations.append(len(step.sends) + len(step.receives))
    per_action, per_operation = _least_squares_line(operations, gaps)
    return PostingCosts(max(per_action, 0.0), max(per_operation, 0.0))


def _least_squares_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points; slope 0 when the xs do not vary."""
    if not xs:
        return 0.0, 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def simulate_with_posting(program, costs, posting: PostingCosts) -> tuple[float, float]:
    """(makespan in ms, bubble ratio) of ``program`` simulated at ``costs`` with each action followed by its
    posting time (``posting.per_action`` plus ``posting.per_operation`` for each operation it posts; the initial
    receives before the first action). The bubble is measured as a traced run's is: against the busiest rank's
    action time, so the posting time counts in it."""
    from ppctl.pipeline.replay import run_timed

    timed = program.timed(costs, pairs_as_one=True)
    busiest = max(sum(step[1] for step in rank_steps) for rank_steps in timed.steps)
    for rank_steps, initial in zip(timed.steps, program.initial_receives):
        for index, (inputs, duration, local_output, sends, receives) in enumerate(rank_steps):
            posted = len(sends) + len(receives) + (len(initial) if index == 0 else 0)
            charged = duration + posting.per_action + posting.per_operation * posted
            rank_steps[index] = (inputs, charged, local_output, sends, receives)
    outcome = run_timed(timed, costs.comm)
    makespan = max((ends[-1] for ends in outcome.ends if ends), default=0.0)
    return makespan, (makespan - busiest) / busiest if busiest > 0 else 0.0
