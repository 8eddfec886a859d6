"""Where a training run starts: the verified checkpoint it resumes from (none: step 0), and its run directory.

``trainer.auto_resume`` resumes from the run directory's latest complete checkpoint, when it holds one;
``trainer.resume_from`` names a run directory or one of its checkpoints. Either is verified before any
worker starts: the settings its ``ppctl.json`` records, then its model's every tensor by name and shape
(``ppctl.run.resume``). Resuming a run directory with ``trainer.out_dir`` unset continues that run there.
A refusal is ``ResumeRefused`` with one line (exit 2); a run that already reached ``trainer.max_steps``
is ``RunComplete`` (exit 0, nothing to do). Nothing here prints or exits: the command line says them.
"""

from __future__ import annotations

from pathlib import Path

from ppctl.checkpoint.files import (CheckpointError, is_run_dir_checkpoint, latest_checkpoint, read_index,
                                    resolve_checkpoint, resume_problem)
from ppctl.config import PpctlConfig
from ppctl.data.tokenizer import tokenizer_record
from ppctl.run.rundir import path_length_problem


class ResumeRefused(RuntimeError):
    """The checkpoint to resume from cannot be read, or does not fit this run; the message is one line."""


class RunComplete(Exception):
    """``trainer.auto_resume``: the run directory's run already reached ``trainer.max_steps``; the message is the
    one line that says so."""


def resume_point(config: PpctlConfig) -> tuple[str | None, str | None]:
    """The verified checkpoint a training run resumes from (None: step 0) and its run directory
    (``trainer.out_dir``; unset, the run directory ``trainer.resume_from`` names: resuming a run continues it)."""
    return resume_point_at(config, auto_resume_location(config) or config.trainer.resume_from)


def resume_point_at(config: PpctlConfig, location: str | None) -> tuple[str | None, str | None]:
    """``resume_point`` from ``location`` (a run directory or a checkpoint; None: step 0), with no automatic
    resume: the verified checkpoint and the run directory (None: a new ``runs/<timestamp>``)."""
    if not location:
        return None, config.trainer.out_dir
    checkpoint = verified_checkpoint(config, location)
    continued = is_run_dir_checkpoint(location) and not config.trainer.out_dir
    return checkpoint, str(location) if continued else config.trainer.out_dir


def auto_resume_location(config: PpctlConfig) -> str | None:
    """``trainer.auto_resume``: the run directory, when it holds a complete checkpoint to resume from; a run that
    already reached ``trainer.max_steps`` there has nothing left to do (``RunComplete``)."""
    if not config.trainer.auto_resume:
        return None
    problem = path_length_problem(Path(config.trainer.out_dir))  # before its checkpoints are looked for
    if problem is not None:
        raise ResumeRefused(problem)
    try:
        latest = latest_checkpoint(Path(config.trainer.out_dir))
        step = read_index(latest)["step"] if latest is not None else 0
    except CheckpointError as error:
        raise ResumeRefused(str(error)) from None
    if latest is None:
        return None
    if step >= config.trainer.max_steps:
        raise RunComplete(f"{config.trainer.out_dir}: the run is complete (its latest checkpoint, {latest}, is at "
                          f"step {step} of trainer.max_steps={config.trainer.max_steps}); nothing to do")
    return config.trainer.out_dir


def verified_checkpoint(config: PpctlConfig, location: str) -> str:
    """The one verified checkpoint ``location`` (``trainer.resume_from``: a run directory or a checkpoint) names,
    which fits this run (the settings it records, then its model's every tensor: ``ppctl.run.resume``); else
    ``ResumeRefused``."""
    try:
        checkpoint = resolve_checkpoint(location)
        index = read_index(checkpoint)
    except CheckpointError as error:
        raise ResumeRefused(str(error)) from None
    problem = resume_problem(index, vars(config.model), vars(config.trainer), config.trainer.precision,
                             config.trainer.max_steps, config.optimizer.gradient_delay, tokenizer_record(config.data))
    if problem is None:  # the settings it records agree: then every tensor, by name and shape
        from ppctl.run.resume import model_shape_problem  # torch: only where the settings agree

        problem = model_shape_problem(config, checkpoint)
    if problem is not None:
        raise ResumeRefused(f"trainer.resume_from={location}: cannot resume from {checkpoint}: {problem}")
    return str(checkpoint)
