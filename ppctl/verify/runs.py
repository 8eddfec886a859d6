"""The two launches of ``ppctl verify``: the user's layout, and the same run as one process.

Both are ``ppctl train`` with the user's overrides (and config tree), started as the user starts it: the
parallel one with every setting as given, its launcher's included (torchrun, backend, nodes); the single one
without what only splits the run (``parallel.*``, ``schedule``, the launcher's node and rendezvous keys) and
with ``parallel=single``, so the global batch is the same and one process accumulates it. Verify sets what
the comparison needs on both: the steps, the precision, a checkpoint and a validation loss at the end, TF32
off, a fresh run directory of its own; the user's values of those keys are left out (and said).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# How a run is split over processes, nodes and pipeline ranks, not what it computes: one process runs no schedule
# (a V schedule would refuse its single chunk), on this node alone.
LAYOUT_PREFIXES = ("parallel", "schedule")
NODE_KEYS = ("launcher.nnodes", "launcher.nproc_per_node", "launcher.node_rank", "launcher.rdzv_endpoint",
             "launcher.rdzv_id", "launcher.inject_fault", "launcher.kind")
# What the comparison needs, set by verify on both runs.
SET_BY_VERIFY = ("trainer.max_steps", "trainer.precision", "trainer.out_dir", "trainer.resume_from",
                 "trainer.auto_resume", "trainer.overwrite", "trainer.checkpoints", "trainer.save_every",
                 "trainer.keep_last", "trainer.eval_every", "trainer.eval_iters", "trainer.allow_tf32")
PARALLEL, SINGLE = "parallel", "single"


def key_of(override: str) -> str:
    """The key (or config group) an override sets: ``+trainer.seed=3`` -> ``trainer.seed``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def splits_the_run(override: str) -> bool:
    """Whether an override only says how the run is split (left out of the single process)."""
    key = key_of(override)
    return key.startswith(LAYOUT_PREFIXES) or key in NODE_KEYS


@dataclass(frozen=True)
class VerifyPlan:
    """The two runs' overrides and directories, and the user's overrides verify replaced."""

    overrides: dict[str, list[str]]  # PARALLEL / SINGLE -> the overrides of ``ppctl train``
    run_dirs: dict[str, Path]
    replaced: tuple[str, ...]


def verify_plan(user: list[str], steps: int, precision: str, out_dir: Path) -> VerifyPlan:
    """The plan of ``ppctl verify``: the user's overrides, less those verify sets, with verify's settings."""
    kept = [item for item in user if key_of(item) not in SET_BY_VERIFY]
    replaced = tuple(item for item in user if key_of(item) in SET_BY_VERIFY)
    run_dirs = {PARALLEL: out_dir / PARALLEL, SINGLE: out_dir / SINGLE}
    common = [f"trainer.max_steps={steps}", f"trainer.precision={precision}", "trainer.checkpoints=true",
              f"trainer.save_every={steps}", "trainer.keep_last=1", f"trainer.eval_every={steps}",
              "trainer.eval_iters=1", "trainer.allow_tf32=false", "trainer.auto_resume=false"]
    overrides = {PARALLEL: [*kept, *common, f"trainer.out_dir={run_dirs[PARALLEL]}"],
                 SINGLE: [*(item for item in kept if not splits_the_run(item)), "parallel=single", *common,
                          f"trainer.out_dir={run_dirs[SINGLE]}"]}
    return VerifyPlan(overrides, run_dirs, replaced)


def earlier_verify(out_dir: Path, one_node: bool) -> Path | None:
    """What ``out_dir`` holds of an earlier verify (a run's folder or log), else None.

    On several nodes the parallel run's folder and log are this verify's own, written by the other nodes as
    they start: only the single run, which node 0 runs last, marks an earlier verify there.
    """
    names = (PARALLEL, SINGLE) if one_node else (SINGLE,)
    for name in names:
        for path in (out_dir / name, out_dir / f"{name}.log"):
            if path.exists() or path.is_symlink():
                return path
    return None


def config_options(config_dir: Path | None, config_name: str) -> list[str]:
    """The ``--config-dir`` / ``--config-name`` options that pass the user's config tree on."""
    options = ["--config-dir", str(config_dir)] if config_dir is not None else []
    return options + ["--config-name", config_name]


def train_command(overrides: list[str], options: list[str]) -> list[str]:
    """``ppctl train`` of ``overrides`` by this interpreter (the ``ppctl`` the user runs)."""
    return [sys.executable, "-m", "ppctl.cli.app", "train", *options, *overrides]


@dataclass(frozen=True)
class RunOutcome:
    """How one launch ended: its exit status and the last line it wrote to stderr (its one-line reason)."""

    returncode: int
    last_line: str
    log: Path


def launch(command: list[str], log: Path) -> RunOutcome:
    """Run ``command`` with its output into ``log``; how it ended."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        returncode = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT).returncode
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return RunOutcome(returncode, lines[-1] if lines else "", log)
