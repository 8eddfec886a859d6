"""Costs measured, not guessed: the simulator's F, B, W and message time taken from a run directory.

``inspect-schedule --calibrate RUN_DIR`` and ``ppctl plan --calibrate RUN_DIR`` read one of two
files a run leaves:

- ``bench.json`` (``ppctl bench``): F, B and W fitted to its traced step, the message
  time of its ping-pong, and the runtime's time between actions;
- ``trace.json`` (``trainer.trace=true``): the last traced step's mean action times and
  the runtime's time between actions; a training trace does not time a message on its
  own, so ``comm`` is 0 unless ``--cost comm=X`` gives it.

The runtime's time between actions (posting sends and receives, bookkeeping) is charged
to every action, so the simulated makespan is the one the runtime can reach. The costs
are per microbatch through one rank's layers of one model copy (the simulator's unit),
so a run of one schedule calibrates another on the same model and layout.

Files that are not what such a run writes (another shape, a key missing, a measured figure that
is not a finite number from 0 to ``MAX_COST``, a config gone) are refused with one line naming
``--calibrate`` and the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from ppctl.resolve import load_config_file
from ppctl.resolve.resolved import resolve
from ppctl.pipeline.simulate import MAX_COST, Costs
from ppctl.pipeline.trace import (costs_from_measurement, measured_makespan_and_bubble, overhead_per_action,
                                  rows_from_chrome_trace)


@dataclass(frozen=True)
class Calibration:
    """Costs from a measured run (ms), where they came from, and what that run measured."""

    source: str  # the file read
    costs: Costs
    overhead_ms: float  # the runtime's time between actions, per action (included in F, B and W)
    schedule: str  # the measured run's schedule
    pp: int
    measured_makespan_ms: float
    measured_bubble: float
    comm_measured: bool
    given: tuple[str, ...] = ()  # costs the user gave in place of measured ones
    config_file: str = ""  # the measured run's resolved config
    # Beyond the pipeline (``ppctl bench`` only; None where not measured): the update's seconds per parameter a
    # rank steps, the ring collectives' latency per step and bus bandwidth (bytes/s) from two all-reduces, and
    # what a small one waits beyond its lockstep time when it follows each worker's compute.
    update_s_per_parameter: float | None = None
    ring_step_s: float | None = None
    bus_bandwidth: float | None = None
    collective_wait_s: float | None = None  # a collective's wait for its slowest member after compute
    # Where the measured run's workers outnumbered the machine's cores: those cores, and the share of the pipeline
    # ranks' action time spent on a core (the rest waited for one), for the planner's processor sharing
    cores: int | None = None
    on_core_share: float | None = None

    def measured_config(self):
        """The measured run's config, resolved (``ResolvedConfig``)."""
        return resolve(load_config_file(Path(self.config_file)), check=False)

    def with_overrides(self, values: dict[str, float]) -> "Calibration":
        """The calibration with the costs a user gave explicitly (``--cost comm=0.1``) in place of measured ones."""
        return replace(self, costs=replace(self.costs, **values), given=tuple(values))

    def bubble_at_measured_compute(self, makespan_ms: float) -> float:
        """The bubble ratio of a makespan against the measured run's busiest compute (the runtime's time between
        actions counts as bubble, as in the measured ratio, though the costs carry it)."""
        compute = self.measured_makespan_ms / (1 + self.measured_bubble)
        return makespan_ms / compute - 1 if compute > 0 else 0.0

    def to_json(self) -> dict:
        """The ``calibration`` object of ``inspect-schedule --json``."""
        return {"source": self.source, "costs": self.costs.to_json(), "overhead_per_action_ms": self.overhead_ms,
                "schedule": self.schedule, "pp": self.pp, "measured_makespan_ms": self.measured_makespan_ms,
                "measured_bubble_ratio": self.measured_bubble, "comm_measured": self.comm_measured,
                "given": list(self.given)}


def calibration_of(run_dir: Path, schedule_name: str) -> Calibration:
    """The costs measured in ``run_dir``: its ``bench.json`` (the entry of ``schedule_name`` if it has one, else
    the first), else its ``trace.json``. ValueError with one line when it has neither or they cannot be read."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"--calibrate {run_dir}: no such run directory")
    if (run_dir / "bench.json").is_file():
        return _from_bench(run_dir, schedule_name)
    if (run_dir / "trace.json").is_file():
        return _from_trace(run_dir)
    raise ValueError(f"--calibrate {run_dir}: neither bench.json (ppctl bench) nor trace.json "
                     "(ppctl train trainer.trace=true) is there")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--calibrate: cannot read {path}: {error}") from None


# What a ``bench.json`` entry must hold (``ppctl.bench.run``), said when one lacks it
BENCH_ENTRY = ("ppctl bench writes schedule, pp, fitted_costs_ms {F, B, W, comm}, overhead_per_action_ms, "
               "makespan_measured_s and bubble_measured")
_ABSENT = object()


def _from_bench(run_dir: Path, schedule_name: str) -> Calibration:
    """Costs of one schedule's entry of ``bench.json``, the runtime's time between actions charged to each;
    ValueError (one line naming the file) where the file is not ``ppctl bench``'s or a figure is not measured."""
    path = run_dir / "bench.json"
    entries = _bench_entries(path)
    index, entry = next(((i, entry) for i, entry in entries if entry.get("schedule") == schedule_name), entries[0])
    where = f"--calibrate {path}: entry {index}"
    config_file = _bench_config_file(run_dir, index)
    chunks = _measured_schedule(config_file).chunks_per_copy
    fitted = _bench_field(entry, "fitted_costs_ms", dict, where)
    F, B, W, comm = (_measured(fitted, key, where, "fitted_costs_ms.") for key in ("F", "B", "W", "comm"))
    overhead = _measured(entry, "overhead_per_action_ms", where)
    costs = Costs(F=_charged(F, overhead, chunks), B=_charged(B, overhead, chunks),
                  W=_charged(W, overhead, chunks) if W else 0.0, comm=comm)
    pp = _bench_field(entry, "pp", int, where)
    calibration = Calibration(str(path), costs, overhead, _bench_field(entry, "schedule", str, where), pp,
                              _measured(entry, "makespan_measured_s", where) * 1e3,
                              _measured(entry, "bubble_measured", where), comm_measured=True,
                              config_file=str(config_file))
    return replace(calibration, **_beyond_pipeline(entry, where))


def _bench_entries(path: Path) -> list[tuple[int, dict]]:
    """(index, entry) of each schedule's entry of ``bench.json``: a list of objects, not empty."""
    entries = _read_json(path)
    if not isinstance(entries, list):
        raise ValueError(f"--calibrate {path}: holds a JSON {type(entries).__name__}, not ppctl bench's list of one "
                         "entry per schedule")
    for index, entry in enumerate(entries):
        if entry and not isinstance(entry, dict):
            raise ValueError(f"--calibrate {path}: entry {index} is a JSON {type(entry).__name__}, not an object; "
                             f"{BENCH_ENTRY}")
    kept = [(index, entry) for index, entry in enumerate(entries) if entry]
    if not kept:
        raise ValueError(f"--calibrate {path}: holds no schedule")
    return kept


def _bench_config_file(run_dir: Path, index: int) -> Path:
    """The resolved config of ``bench.json``'s entry ``index`` (``bench_request.json`` lists them, in ``bench/``)."""
    request_path = run_dir / "bench_request.json"
    request = _read_json(request_path)
    configs = request.get("configs") if isinstance(request, dict) else None
    if not isinstance(configs, list) or index >= len(configs) or not isinstance(configs[index], str):
        raise ValueError(f"--calibrate {request_path}: its configs list no config file for bench.json's entry "
                         f"{index} (ppctl bench lists one per schedule, bench/<index>_<schedule>.yaml)")
    config_file = run_dir / configs[index]
    if not config_file.is_file():
        raise ValueError(f"--calibrate {config_file}: missing; ppctl bench writes each schedule's resolved config "
                         f"there, and the measured costs are read against it (was {config_file.parent} moved or "
                         "deleted?)")
    return config_file


def _measured_config(path: Path):
    """The resolved config of a measured run at ``path``; ValueError (one line) when it cannot be read as one."""
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    try:
        return load_config_file(path)
    except (OSError, ValueError, YAMLError, OmegaConfBaseException) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--calibrate {path}: not a resolved ppctl config: {reason}") from None


def _measured_schedule(path: Path):
    """The schedule the measured run of the config at ``path`` ran; ValueError (one line) naming the file."""
    config = _measured_config(path)
    try:
        return resolve(config, check=False).schedule
    except ValueError as error:
        raise ValueError(f"--calibrate {path}: its schedule cannot be built: {error}") from None


def _bench_field(entry: dict, key: str, kind: type, where: str):
    """``entry[key]``, which must be a ``kind`` (a positive one for an int); else ValueError naming it."""
    value = entry.get(key, _ABSENT)
    if value is _ABSENT:
        raise ValueError(f"{where}: no {key}; {BENCH_ENTRY}")
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
        raise ValueError(f"{where}: {key} is {value!r}, not what ppctl bench writes there; {BENCH_ENTRY}")
    return value


def _measured(values: dict, key: str, where: str, prefix: str = "") -> float:
    """``values[key]`` as a measured figure: a finite number from 0 to ``MAX_COST``; else ValueError naming it."""
    value = values.get(key, _ABSENT)
    if value is _ABSENT:
        raise ValueError(f"{where}: no {prefix}{key}; {BENCH_ENTRY}")
    if not _is_measured(value):
        raise ValueError(f"{where}: {prefix}{key} is {value!r}, where a measured figure is a finite number from 0 to "
                         f"{MAX_COST:.0e}; bench the run again")
    return float(value)


def _is_measured(value) -> bool:
    """Whether ``value`` can be a measured figure: a number (not a bool), finite, from 0 to ``MAX_COST``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_COST


def _beyond_pipeline(entry: dict, where: str) -> dict:
    """The update and collective figures of a ``bench.json`` entry, and the cores its workers shared where they
    outnumbered them (none from one written before they were); ValueError naming the entry where they are not
    ``ppctl bench``'s numbers."""
    try:
        figures = _pipeline_extras(entry)
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as error:
        raise ValueError(f"{where}: its update and collective figures (update_s, update_parameters, all_reduce_s, "
                         f"world_size, collective_wait_s, cores, on_core_share) are not ppctl bench's: "
                         f"{type(error).__name__}: {error}") from None
    for name, value in figures.items():
        # an infinite bus bandwidth is measured: the larger all-reduce was not slower
        if value is not None and not (_is_measured(value) or (name == "bus_bandwidth" and value == math.inf)):
            raise ValueError(f"{where}: its figures give {name} = {value!r}, where a measured figure is a finite "
                             "number, at least 0; bench the run again")
    return figures


def _pipeline_extras(entry: dict) -> dict:
    """``_beyond_pipeline``'s figures, unchecked."""
    figures = {}
    if entry.get("update_parameters"):
        figures["update_s_per_parameter"] = entry["update_s"] / entry["update_parameters"]
    if entry.get("world_size", 1) > 1 and entry.get("all_reduce_s"):
        sizes = sorted((int(numel), seconds) for numel, seconds in entry["all_reduce_s"].items())
        figures["ring_step_s"], figures["bus_bandwidth"] = ring_fit(sizes[0], sizes[-1], entry["world_size"])
        figures["collective_wait_s"] = entry.get("collective_wait_s")
    shares = (entry.get("on_core_share") or {}).get("actions")
    if entry.get("cores") and entry.get("world_size", 1) > entry["cores"] and shares:
        figures["cores"], figures["on_core_share"] = entry["cores"], sum(shares) / len(shares)
    return figures


def ring_fit(small: tuple[int, float], large: tuple[int, float], ranks: int) -> tuple[float, float]:
    """(latency per ring step, bus bandwidth in bytes/s) of ring all-reduces over ``ranks`` that took ``seconds``
    for ``numel`` float32 elements, from two such (numel, seconds): a ring all-reduce of b bytes takes
    2(n - 1) steps and moves 2(n - 1)/n * b bytes per rank. Bandwidth infinite when the larger was not slower."""
    steps, share = 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    (small_numel, small_s), (large_numel, large_s) = small, large
    bandwidth = share * 4 * (large_numel - small_numel) / (large_s - small_s) if large_s > small_s else float("inf")
    return max(small_s - share * 4 * small_numel / bandwidth, 0.0) / steps, bandwidth


def _charged(cost: float, overhead_ms: float, chunks: int) -> float:
    """A fitted cost (per microbatch through a rank's layers: ``chunks`` actions) with each action's overhead."""
    return cost + overhead_ms * chunks


def _from_trace(run_dir: Path) -> Calibration:
    """Costs of the last traced step of a training run; ValueError (one line naming the file) where ``trace.json``
    is not a trace of ppctl's or its times make no costs."""
    path = run_dir / "trace.json"
    trace = _read_json(path)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"--calibrate {run_dir}: no config.yaml, so not a ppctl run directory")
    schedule = _measured_schedule(run_dir / "config.yaml")
    try:
        step, rows = rows_from_chrome_trace(trace)
        costs = costs_from_measurement(rows, schedule.chunks_per_copy, include_overhead=True)
        makespan, bubble = measured_makespan_and_bubble(rows)
        overhead = overhead_per_action(rows)
    except ValueError as error:
        raise ValueError(f"--calibrate {path}: {error}") from None
    except (AttributeError, KeyError, TypeError, IndexError) as error:
        raise ValueError(f"--calibrate {path}: not a trace of ppctl's (trainer.trace=true writes Chrome trace events "
                         f"with ts, dur, cat, tid and args step, stage, microbatch): {type(error).__name__}: "
                         f"{error}") from None
    figures = {"F": costs.F, "B": costs.B, "W": costs.W, "makespan": makespan, "bubble ratio": bubble,
               "time between actions": overhead}
    for name, value in figures.items():
        if not _is_measured(value):
            raise ValueError(f"--calibrate {path}: step {step} gives {name} = {value!r}, where a measured figure is "
                             f"a finite number from 0 to {MAX_COST:.0e} (an edited trace?)")
    return Calibration(f"{path} (step {step})", costs, overhead, schedule.name, schedule.pp, makespan, bubble,
                       comm_measured=False, config_file=str(run_dir / "config.yaml"))


def calibration_lines(calibration: Calibration, simulated_makespan: float, schedule: str, pp: int) -> list[str]:
    """What ``inspect-schedule`` prints under the timeline: where the costs came from, and simulated against
    measured when the measured run ran this schedule at this pp."""
    given = f"; {', '.join(calibration.given)} given by --cost" if calibration.given else ""
    unmeasured = "" if calibration.comm_measured or "comm" in calibration.given else \
        "; comm not measured by a training trace (--cost comm=X sets it)"
    lines = [f"costs (ms) from {calibration.source}, the runtime's {calibration.overhead_ms:.2f} ms between actions "
             f"charged to each action{given}{unmeasured}"]
    if (calibration.schedule, calibration.pp) != (schedule, pp):
        lines.append(f"measured on {calibration.schedule} at pp={calibration.pp}: no measured timeline of this one")
        return lines
    measured = calibration.measured_makespan_ms
    gap = simulated_makespan / measured - 1 if measured else 0.0
    lines.append(f"measured: makespan {measured:.1f} ms, bubble ratio {calibration.measured_bubble:.1%}; simulated: "
                 f"{simulated_makespan:.1f} ms ({gap:+.1%}), "
                 f"{calibration.bubble_at_measured_compute(simulated_makespan):.1%} at the measured compute")
    return lines
