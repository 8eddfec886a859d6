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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ppctl.config import configured_schedule, load_config_file
from ppctl.pipeline.simulate import Costs
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
        """The measured run's ``PpctlConfig``."""
        return load_config_file(Path(self.config_file))

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


def _from_bench(run_dir: Path, schedule_name: str) -> Calibration:
    """Costs of one schedule's entry of ``bench.json``, the runtime's time between actions charged to each."""
    entries = [entry for entry in _read_json(run_dir / "bench.json") if entry]
    configs = _read_json(run_dir / "bench_request.json")["configs"]
    if not entries:
        raise ValueError(f"--calibrate {run_dir}: bench.json holds no schedule")
    index = next((i for i, entry in enumerate(entries) if entry["schedule"] == schedule_name), 0)
    entry = entries[index]
    chunks = configured_schedule(load_config_file(run_dir / configs[index])).chunks_per_copy
    fitted, overhead = entry["fitted_costs_ms"], entry["overhead_per_action_ms"]
    costs = Costs(F=_charged(fitted["F"], overhead, chunks), B=_charged(fitted["B"], overhead, chunks),
                  W=_charged(fitted["W"], overhead, chunks) if fitted["W"] else 0.0, comm=fitted["comm"])
    calibration = Calibration(str(run_dir / "bench.json"), costs, overhead, entry["schedule"], entry["pp"],
                              entry["makespan_measured_s"] * 1e3, entry["bubble_measured"], comm_measured=True,
                              config_file=str(run_dir / configs[index]))
    return replace(calibration, **_beyond_pipeline(entry))


def _beyond_pipeline(entry: dict) -> dict:
    """The update and collective figures of a ``bench.json`` entry, and the cores its workers shared where they
    outnumbered them (none from one written before they were)."""
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
    """Costs of the last traced step of a training run."""
    try:
        step, rows = rows_from_chrome_trace(_read_json(run_dir / "trace.json"))
    except ValueError as error:
        raise ValueError(f"--calibrate {run_dir / 'trace.json'}: {error}") from None
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"--calibrate {run_dir}: no config.yaml, so not a ppctl run directory")
    schedule = configured_schedule(load_config_file(run_dir / "config.yaml"))
    costs = costs_from_measurement(rows, schedule.chunks_per_copy, include_overhead=True)
    makespan, bubble = measured_makespan_and_bubble(rows)
    return Calibration(f"{run_dir / 'trace.json'} (step {step})", costs, overhead_per_action(rows), schedule.name,
                       schedule.pp, makespan, bubble, comm_measured=False, config_file=str(run_dir / "config.yaml"))


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
