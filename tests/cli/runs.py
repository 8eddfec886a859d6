"""Shared by the end-to-end tests: read a run's TensorBoard scalars, compare runs with one process.

The reference run is the single-process run as a user would launch it: the same
overrides with every ``parallel.*`` and ``launcher.*`` setting dropped and
``parallel=single`` added (so the default vocabulary padding of tp=1). Nothing of the
parallel run's internal settings reaches it.
"""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import pytest

from tests.distributed.equivalence import single_process_overrides

from tests.harness.tolerances import tolerance_of

RTOL = tolerance_of("fp32").relative  # a parallel run's logged float32 losses and norms against one process's


def scalars(run_dir: Path):
    """The run's TensorBoard event accumulator, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    accumulator.Reload()
    return accumulator


def series(run_dir: Path, tag: str) -> dict[int, float]:
    """Step -> value of one scalar tag (e.g. ``train/loss``)."""
    return {event.step: event.value for event in scalars(run_dir).Scalars(tag)}


def assert_same_series(actual_dir: Path, expected_dir: Path, tags=("train/loss", "train/grad_norm"),
                       rtol: float = RTOL) -> None:
    """Every step of every tag agrees within ``rtol`` (relative), and both runs logged the same steps."""
    for tag in tags:
        actual, expected = series(actual_dir, tag), series(expected_dir, tag)
        assert expected and sorted(actual) == sorted(expected), (tag, sorted(actual), sorted(expected))
        for step, value in expected.items():
            assert math.isfinite(value)
            assert actual[step] == pytest.approx(value, rel=rtol), (tag, step, actual[step], value)


class SingleRuns:
    """``single_runs(overrides)``: the run directory of ``ppctl train`` as one process, launched once per override
    list; ``single_runs.start(overrides)`` launches it in the background, so that it trains while a test waits
    on something else (a Slurm job's requeue, say), and the later call only waits for it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.launches: dict[tuple[str, ...], concurrent.futures.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # threads that wait on subprocesses

    def start(self, overrides: list[str]) -> None:
        """Launch the single-process run of ``overrides`` now, unless it was launched before."""
        key = tuple(single_process_overrides(overrides))
        if key not in self.launches:
            self.launches[key] = self.pool.submit(self._train, key, self.tmp_path_factory.mktemp("single"))

    def __call__(self, overrides: list[str]) -> Path:
        self.start(overrides)
        return self.launches[tuple(single_process_overrides(overrides))].result()

    @staticmethod
    def _train(key: tuple[str, ...], run_dir: Path) -> Path:
        from tests.cli.conftest import run_ppctl

        # One intra-op thread: a reference that trains beside other processes (a Slurm job, a background launch)
        # would otherwise wait at every op for its second thread, which the busy machine has given to someone else
        # (50 ms steps became 1-4 s). It changes no number beyond the tolerance each comparison already allows.
        result = run_ppctl("train", *key, "launcher.threads_per_worker=1", f"trainer.out_dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        return run_dir


@pytest.fixture(scope="session")
def single_run(tmp_path_factory):
    """``single_run(overrides)``: run dir of ``ppctl train`` as one process (launched once per override list;
    ``single_run.start(overrides)`` launches it in the background)."""
    runs = SingleRuns(tmp_path_factory)
    yield runs
    runs.pool.shutdown(wait=True)
