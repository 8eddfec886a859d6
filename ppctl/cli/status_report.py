"""``ppctl status RUN_DIR``: the run's Slurm job, its last logged step and loss, and its latest checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from ppctl.checkpoint.files import CheckpointError, latest_checkpoint, list_checkpoints


def last_logged(run_dir: Path) -> tuple[int, float] | None:
    """``(steps done, loss)`` of the last ``train/loss`` in the run's TensorBoard logs, or None."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = run_dir / "tensorboard"
    if not folder.is_dir():
        return None
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    if "train/loss" not in accumulator.Tags().get("scalars", []):
        return None
    last = accumulator.Scalars("train/loss")[-1]
    return last.step + 1, last.value  # logged at the 0-based step index, shown as steps done


def latest_complete(run_dir: Path) -> dict | None:
    """The latest complete checkpoint as ``{"path", "step"}``, or None."""
    try:
        latest = latest_checkpoint(run_dir)
    except CheckpointError:
        latest = None
    for info in reversed(list_checkpoints(run_dir)):
        if info.complete and (latest is None or info.path == latest):
            return {"path": str(info.path), "step": info.step}
    return None


def configured_max_steps(run_dir: Path) -> int | None:
    """``trainer.max_steps`` of the run's ``config.yaml``, or None when it has none; one ``JobRecordError`` line
    when the file cannot be read as a config."""
    from ppctl.resolve import load_config_file
    from ppctl.run.slurm import JobRecordError

    config_file = run_dir / "config.yaml"
    if not config_file.exists():
        return None
    try:
        return load_config_file(config_file).trainer.max_steps
    except Exception as error:  # YAML, schema or OS errors alike: the file is not the config a run wrote
        reason = " ".join(str(error).split())[:200]
        raise JobRecordError(f"{config_file}: not the config a run wrote ({reason})") from None


def run_status(run_dir: Path, job: dict | None, max_steps: int | None) -> dict:
    """Everything ``ppctl status`` shows, as one JSON-ready object."""
    logged = last_logged(run_dir)
    return {"run_dir": str(run_dir), "job": job, "max_steps": max_steps,
            "last_step": logged[0] if logged else None, "last_loss": logged[1] if logged else None,
            "latest_checkpoint": latest_complete(run_dir)}


def print_status(status: dict) -> None:
    """The status as a few lines."""
    job = status["job"]
    typer.echo(f"run directory: {status['run_dir']}")
    if job is None:
        typer.echo("job: none (a local run: ppctl train)")
    else:
        restarts = f", restarted {job['restarts']} time(s)" if job.get("restarts") else ""
        typer.echo(f"job: {job['job_id']} {job['state']}{restarts}")
    of = f"/{status['max_steps']}" if status["max_steps"] else ""
    if status["last_step"] is None:
        typer.echo("last logged step: none yet")
    else:
        typer.echo(f"last logged step: {status['last_step']}{of}, loss {status['last_loss']:.4f}")
    checkpoint = status["latest_checkpoint"]
    typer.echo(f"latest checkpoint: step {checkpoint['step']}, {checkpoint['path']}" if checkpoint
               else "latest checkpoint: none")
