"""The ``ppctl`` command line: parse, compose the config, validate, delegate.

Every command that reads config takes Hydra overrides as trailing arguments
(``ppctl inspect-layout parallel.tp=2 parallel.pp=4``) and ``--config-dir`` /
``--config-name`` for a user's own config tree. A bad config exits with status 2
and one line on stderr, before any process starts. Heavy imports (torch) happen
inside the commands that need them, so ``inspect-layout`` starts quickly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

import typer

from ppctl.config import ConfigError, PpctlConfig, compose_config, to_yaml

if TYPE_CHECKING:
    from ppctl.config.resolved import ResolvedConfig
    from ppctl.run.launch import LaunchRequest
    from ppctl.run.rundir import RunDirLock

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train GPT models with Megatron-style TP/PP/VPP/DP/CP parallelism and inspect layouts and schedules.",
    pretty_exceptions_enable=False,
)

OVERRIDES_HELP = "Hydra overrides: group=option or section.key=value, e.g. parallel.tp=2 schedule=gpipe"
CONFIG_DIR_OPTION = typer.Option(None, "--config-dir", help="Your own config tree (ppctl's groups stay available).")
CONFIG_NAME_OPTION = typer.Option("config", "--config-name",
                                  help="Primary config file name, without .yaml (ppctl's own when --config-dir has no "
                                       "config.yaml).")


def fail(message: str, code: int = 2) -> None:
    """Print one error line on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def parsed_or_fail(parse: Callable[[str], int], text: str) -> int:
    """``parse(text)`` for a Typer ``parser``; its ValueError ends in one line and exit 2 (Typer's own refusal of an
    option's value is a framed box of several lines)."""
    try:
        return parse(text)
    except ValueError as error:
        fail(str(error))
        raise AssertionError("unreachable")


def _gpus(text: str) -> int:
    """``plan --gpus``: a whole number of devices from 1 to ``MAX_DEVICES``."""
    from ppctl.plan.search import parse_devices

    return parsed_or_fail(parse_devices, text)


def _steps(text: str) -> int:
    """``inspect-schedule --steps``: a whole number of steps, at least 1."""
    from ppctl.cli.schedule_report import parse_steps

    return parsed_or_fail(parse_steps, text)


def os_reason(error: OSError, named: Optional[Path] = None) -> str:
    """Why an OS call failed, and on which file when that is not ``named`` (already in the message)."""
    reason = error.strerror or str(error)
    if error.filename and (named is None or Path(error.filename) != named):
        reason += f" ({error.filename})"
    return reason


def load_config(
    overrides: Optional[List[str]],
    config_dir: Optional[Path],
    config_name: str,
    check: Callable[[PpctlConfig], object] | None = None,
) -> PpctlConfig:
    """Compose and check a config, turning every refusal into exit status 2 with one line.

    ``model.init_from`` is made an absolute path while composing: the workers read it wherever they start."""
    try:
        config = compose_config(overrides or [], config_dir, config_name)
        if config.model.init_from:
            config.model.init_from = str(Path(config.model.init_from).expanduser().resolve())
        if check is not None:
            check(config)
        return config
    except ConfigError as error:
        fail(str(error))
        raise AssertionError("unreachable")


def load_resolved(overrides: Optional[List[str]], config_dir: Optional[Path], config_name: str,
                  **checks: bool) -> "ResolvedConfig":
    """Compose a config and resolve it once (``ppctl.config.resolved.resolve``, with ``checks``: its ``data``,
    ``prove_schedule`` and ``layer_split``); a refusal is exit status 2 with one line."""
    from ppctl.config.resolved import resolve

    return resolve_or_fail(load_config(overrides, config_dir, config_name), **checks)


def resolve_or_fail(config: PpctlConfig, **checks: bool) -> "ResolvedConfig":
    """``resolve(config, **checks)``, a refusal being exit status 2 with one line."""
    from ppctl.config.resolved import resolve

    try:
        return resolve(config, **checks)
    except ConfigError as error:
        fail(str(error))
        raise AssertionError("unreachable")


@app.command("inspect-layout")
def inspect_layout(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (docs/layout.md lists the keys)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Show the rank coordinates, every process group and the layer map of a layout."""
    from ppctl.cli.layout_report import layout_report, print_layout

    resolved = load_resolved(overrides, config_dir, config_name)
    report = layout_report(resolved)
    if as_json:
        sys.stdout.write(json.dumps(report, separators=(",", ":")) + "\n")
    else:
        print_layout(report, resolved)


@app.command("inspect-schedule")
def inspect_schedule(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    cost: Optional[str] = typer.Option(None, "--cost",
                                       help="Cost model (default F=1,B=1,W=1,comm=0): times of F, B, W for one "
                                            "microbatch through all of a rank's layers (of one model copy), FB for an "
                                            "overlapped forward-and-backward pair (DualPipe; unset: F+B+W), and the "
                                            "latency of one point-to-point message. With --calibrate: the costs "
                                            "given replace the measured ones."),
    calibrate: Optional[Path] = typer.Option(None, "--calibrate", metavar="RUN_DIR",
                                             help="Take the costs (ms) from a measured run: its bench.json (ppctl "
                                                  "bench) or trace.json (trainer.trace=true), with the runtime's "
                                                  "time between actions; shows measured against simulated."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (docs/schedules.md lists the keys)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the timeline picture (.svg or .html)."),
    steps: int = typer.Option(1, "--steps", parser=_steps, metavar="N",
                              help="Consecutive steps to simulate: one stream for pipedream_2bw (the fill shows "
                                   "once), else each step after the last; adds the time and bubble per step after "
                                   "the first."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Simulate the configured schedule: timeline per rank, bubble ratio and peak activations."""
    from ppctl.cli.schedule_report import print_schedule, simulate_config

    # The schedule does not depend on how the model's layers divide into its stages.
    resolved = load_resolved(overrides, config_dir, config_name, layer_split=False)
    try:
        result = simulate_config(resolved, cost, steps, calibrate)
    except ValueError as error:
        fail(str(error))
    if out is not None:
        _write_picture(result, out)
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    else:
        print_schedule(result, out)


def _write_picture(result, out: Path) -> None:
    """``inspect-schedule --out``: the timeline picture, or one line naming --out and why it cannot be written."""
    from ppctl.cli.schedule_report import write_schedule_picture

    try:
        write_schedule_picture(result, out)
    except ValueError as error:
        fail(str(error))
    except OSError as error:
        fail(f"--out {out}: cannot write the picture: {os_reason(error, out)}")


@app.command("plan")
def plan(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    gpus: int = typer.Option(..., "--gpus", parser=_gpus, metavar="N",
                             help="Devices to plan for (the product of tp, cp, pp and dp), at most 1,048,576."),
    memory_gb: Optional[float] = typer.Option(None, "--memory-gb", min=0.001,
                                              help="GiB per device every rank's predicted memory must fit (default: "
                                                   "the device's)."),
    device_name: str = typer.Option("h100", "--device",
                                    help="The device's throughput, memory and links: h100, h200 or a100."),
    top: int = typer.Option(10, "--top", min=1, help="How many candidates to print, fastest first."),
    calibrate: Optional[Path] = typer.Option(None, "--calibrate", metavar="RUN_DIR",
                                             help="Take the throughput, message time and the runtime's time "
                                                  "between actions from a measured run (ppctl bench or a traced "
                                                  "train run) instead of the device's figures."),
    explain: Optional[int] = typer.Option(None, "--explain", min=1, metavar="N",
                                          help="Show candidate N of the list: its memory per rank by part and its "
                                               "simulated timeline."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (docs/plan.md lists the keys)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Rank the layouts of the model on N devices that fit in memory by predicted step time."""
    from ppctl.cli.calibrate import calibration_of
    from ppctl.config import validate_data
    from ppctl.plan.search import DEVICES, calibrated_device, plan as search

    if device_name not in DEVICES:
        fail(f"--device {device_name!r}: choose one of {', '.join(DEVICES)}")
    config = load_config(overrides, config_dir, config_name, validate_data)
    device = DEVICES[device_name]
    if calibrate is not None:
        try:
            calibration = calibration_of(calibrate, config.schedule.name)
            device = calibrated_device(device, calibration, calibration.measured_config())
        except (ValueError, ConfigError) as error:
            fail(str(error))
    memory_bytes = (memory_gb or device.memory_gb) * 2 ** 30
    result = search(config, gpus, memory_bytes, top, device)
    if explain is not None and result.candidates:  # else the reasons nothing fits, below
        _explain(result, explain, config, device, list(overrides or []))
    elif as_json:
        sys.stdout.write(json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    else:
        from ppctl.cli.plan_report import print_plan

        print_plan(result, list(overrides or []), gpus, memory_bytes, device.describe())
    if not result.candidates:
        fail(f"no layout of --gpus {gpus} fits: each was left out for a reason counted "
             f"{'in refused' if as_json else 'above'}", code=1)


def _explain(result, number: int, config: PpctlConfig, device, user_overrides: list[str]) -> None:
    """``ppctl plan --explain N``: candidate N's memory and simulated timeline."""
    from ppctl.cli.plan_report import print_explanation
    from ppctl.plan.search import explain_candidate

    if number > len(result.candidates):
        fail(f"--explain {number}: the plan holds {len(result.candidates)} candidate(s)")
    prediction = result.candidates[number - 1]
    print_explanation(prediction, explain_candidate(config, prediction.candidate, device), user_overrides)


@app.command("train")
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command and run directory; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate, create the run directory, start the torchrun workers and train."""
    from ppctl.run.launch import LaunchRequest

    resolved = load_resolved(overrides, config_dir, config_name)
    config = resolved.config
    if config.launcher.kind == "slurm" and "SLURM_JOB_ID" not in os.environ:
        fail("launcher=slurm: submit the run with ppctl submit (ppctl train runs it here, outside Slurm; "
             "launcher=local to do that)")
    resume_from, run_dir = _resume_point(config)
    _launch(resolved, LaunchRequest("train", _run_dir(run_dir), resume_from), dry_run)


def _run_dir(configured: str | None) -> Path:
    """The run directory of a launch: ``configured`` (``trainer.out_dir``), else a new ``runs/<timestamp>``."""
    from ppctl.run.rundir import default_run_dir

    return Path(configured) if configured else default_run_dir()


def _resume_point(config: PpctlConfig) -> tuple[str | None, str | None]:
    """The verified checkpoint a training run resumes from (None: step 0) and its run directory
    (``trainer.out_dir``; unset, the run directory ``trainer.resume_from`` names: resuming a run continues it)."""
    from ppctl.checkpoint.files import is_run_dir_checkpoint

    location = _auto_resume_location(config) or config.trainer.resume_from
    if not location:
        return None, config.trainer.out_dir
    checkpoint = _verified_checkpoint(config, location)
    continued = is_run_dir_checkpoint(location) and not config.trainer.out_dir
    return checkpoint, str(location) if continued else config.trainer.out_dir


def _auto_resume_location(config: PpctlConfig) -> str | None:
    """``trainer.auto_resume``: the run directory, when it holds a complete checkpoint to resume from; a run that
    already reached ``trainer.max_steps`` there has nothing left to do (exit 0, say so)."""
    from ppctl.checkpoint.files import CheckpointError, latest_checkpoint, read_index
    from ppctl.run.rundir import path_length_problem

    if not config.trainer.auto_resume:
        return None
    problem = path_length_problem(Path(config.trainer.out_dir))  # before its checkpoints are looked for
    if problem is not None:
        fail(problem)
    try:
        latest = latest_checkpoint(Path(config.trainer.out_dir))
        step = read_index(latest)["step"] if latest is not None else 0
    except CheckpointError as error:
        fail(str(error))
    if latest is None:
        return None
    if step >= config.trainer.max_steps:
        typer.echo(f"{config.trainer.out_dir}: the run is complete (its latest checkpoint, {latest}, is at step "
                   f"{step} of trainer.max_steps={config.trainer.max_steps}); nothing to do", err=True)
        raise typer.Exit(0)
    return config.trainer.out_dir


def _verified_checkpoint(config: PpctlConfig, location: str) -> str:
    """The one verified checkpoint ``location`` (``trainer.resume_from``: a run directory or a checkpoint) names,
    which fits this run (the settings it records, then its model's every tensor: ``ppctl.run.resume``); else one
    line, exit 2."""
    from ppctl.checkpoint.files import CheckpointError, read_index, resolve_checkpoint, resume_problem
    from ppctl.data.tokenizer import tokenizer_record

    try:
        checkpoint = resolve_checkpoint(location)
        index = read_index(checkpoint)
    except CheckpointError as error:
        fail(str(error))
    problem = resume_problem(index, vars(config.model), vars(config.trainer), config.trainer.precision,
                             config.trainer.max_steps, config.optimizer.gradient_delay, tokenizer_record(config.data))
    if problem is None:  # the settings it records agree: then every tensor, by name and shape
        from ppctl.run.resume import model_shape_problem

        problem = model_shape_problem(config, checkpoint)
    if problem is not None:
        fail(f"trainer.resume_from={location}: cannot resume from {checkpoint}: {problem}")
    return str(checkpoint)


@app.command("submit")
def submit(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run directory and job.sbatch and print the "
                                                          "script; submit nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate, write the run directory and its Slurm job script (launcher=slurm), and submit it with sbatch."""
    from dataclasses import replace

    from ppctl.checkpoint.files import is_run_dir_checkpoint
    from ppctl.run.rundir import default_run_dir, run_dir_problem
    from ppctl.run.slurm import (JOB_SCRIPT, SlurmError, job_script, ppctl_command, record_job, script_problem,
                                 submit_job)

    resolved = load_resolved(overrides, config_dir, config_name)
    config = resolved.config
    if config.launcher.kind != "slurm":
        fail("ppctl submit hands the run to Slurm: add launcher=slurm (and launcher.slurm.* for the allocation); "
             "ppctl train runs it here")
    location = config.trainer.resume_from
    resume_from = _verified_checkpoint(config, location) if location else None
    continued = location and is_run_dir_checkpoint(location) and not config.trainer.out_dir
    run_dir = Path(location if continued else config.trainer.out_dir or default_run_dir()).resolve()  # the job may
    workdir = Path.cwd().resolve()                                                                     # start anywhere
    problem = script_problem(run_dir, workdir) or run_dir_problem(run_dir, "train", resume_from,
                                                                  config.trainer.overwrite)
    if problem is not None:
        fail(problem)
    lock = write_run_dir(resolved, run_dir, "train")
    try:
        if _clears_earlier_run(config, run_dir, "train"):
            _clear_earlier_run(run_dir)
        # The job's own config: its run directory and checkpoint pinned, and the earlier run cleared now, once, so
        # that the job's starts (a requeue too) continue the run instead of deleting it again.
        job = replace(config, trainer=replace(config.trainer, out_dir=str(run_dir), resume_from=resume_from,
                                              overwrite=False))
        _write_files(run_dir, {"config.yaml": to_yaml(job), JOB_SCRIPT: job_script(job, run_dir, workdir,
                                                                                    ppctl_command())})
    finally:
        lock.release()
    script = run_dir / JOB_SCRIPT
    if dry_run:
        typer.echo(script.read_text(), nl=False)
        typer.echo(f"wrote {script} (not submitted: sbatch {script} submits it)", err=True)
        return
    try:
        job_id = submit_job(script)
    except SlurmError as error:
        fail(str(error), code=1)
    record_job(run_dir, job_id)
    typer.echo(f"submitted job {job_id}: run directory {run_dir}")
    typer.echo(f"follow it with: ppctl status {run_dir}", err=True)


@app.command("verify")
def verify(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    steps: int = typer.Option(3, "--steps", min=1, help="Training steps of each run."),
    precision: str = typer.Option("fp64", "--precision", help="fp64 (elementwise, 1e-10) or fp32 (TF32 off, 1e-5)."),
    shrink: bool = typer.Option(False, "--shrink", help="Keep the layout, schedule and features; shrink the model's "
                                                       "widths, vocabulary and sequence to the smallest the layout "
                                                       "allows (and say what shrank)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where the two runs go (default runs/verify-<timestamp>)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (docs/verify.md lists the keys)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Train the configured layout and the same run as one process, compare them by the tolerance rule."""
    from ppctl.cli.verify_report import print_verdict, verdict_json
    from ppctl.verify.compare import VerifyError, judge
    from ppctl.verify.runs import PARALLEL, SINGLE, config_options, earlier_verify, launch, train_command, verify_plan
    from ppctl.verify.shrink import shrink_overrides, shrink_refusal

    if precision not in ("fp64", "fp32"):
        fail(f"--precision {precision}: choose fp64 or fp32 (half precision is compared by trajectory, not proven "
             f"equal)")
    user = list(overrides or [])
    given = load_resolved(user, config_dir, config_name, data=False).config
    if given.launcher.nnodes > 1 and out is None:
        fail(f"verify on launcher.nnodes={given.launcher.nnodes} needs --out DIR, the same on every node and on a "
             f"filesystem they share: each node's part of the parallel run writes there, and node 0 compares")
    used = None if out is None else earlier_verify(out.resolve(), given.launcher.nnodes == 1)
    if used is not None:
        fail(f"--out {out} holds an earlier verify ({used}), which this one would overwrite; give each verify a "
             f"folder of its own (a new --out DIR, or no --out for a new runs/verify-<timestamp>)")
    shrunk: list[str] = []
    if shrink:
        refusal = shrink_refusal(given)
        if refusal is not None:
            fail(refusal)
        extra, shrunk = shrink_overrides(given)
        user += extra
    plan = verify_plan(user, steps, precision, (out or _verify_dir()).resolve())
    runs = {name: load_resolved(plan.overrides[name], config_dir, config_name) for name in (PARALLEL, SINGLE)}
    problem = _single_fit_problem(runs[SINGLE], shrink)
    if problem is not None:
        fail(problem)
    options = config_options(config_dir, config_name)
    own_part_only = runs[PARALLEL].config.launcher.node_rank != 0  # another node's share of the parallel run
    for name in (PARALLEL,) if own_part_only else (PARALLEL, SINGLE):
        typer.echo(f"verify: the {name} run ({steps} steps) into {plan.run_dirs[name]}", err=True)
        outcome = launch(train_command(plan.overrides[name], options), plan.run_dirs[name].parent / f"{name}.log")
        if outcome.returncode != 0:
            fail(f"the {name} run failed (exit {outcome.returncode}): {outcome.last_line} (its output: {outcome.log})",
                 code=1)
    if own_part_only:
        typer.echo("verify: this node's part of the parallel run is done; node 0 compares", err=True)
        return
    try:
        verdict = judge(plan.run_dirs[PARALLEL], plan.run_dirs[SINGLE], runs[SINGLE].config, steps)
    except VerifyError as error:
        fail(str(error), code=1)
    if as_json:
        sys.stdout.write(json.dumps(verdict_json(verdict, plan.run_dirs, shrunk, plan.replaced)) + "\n")
    else:
        print_verdict(verdict, plan.run_dirs, shrunk, plan.replaced)
    if not verdict.equal:
        raise typer.Exit(1)


def _verify_dir() -> Path:
    """A new ``runs/verify-<timestamp>`` for the two runs of ``ppctl verify``."""
    from ppctl.run.rundir import default_run_dir

    default = default_run_dir()
    return default.with_name(f"verify-{default.name}")


def _single_fit_problem(single: "ResolvedConfig", shrunk: bool) -> str | None:
    """Why the single process of ``ppctl verify`` cannot run here: the memory model's prediction above what this
    machine has free (its GPU's memory under NCCL)."""
    from ppctl.plan.memory import config_memory
    from ppctl.run.launch import local_gpus, resolve_backend

    needed = config_memory(single)[0].total
    if resolve_backend(single.config.launcher.backend, 1) == "nccl" and local_gpus():
        import torch

        available, where = torch.cuda.get_device_properties(0).total_memory, "its GPU has"
    else:
        available, where = _free_memory_bytes(), "this machine has free"
    if needed <= available:
        return None
    hint = "" if shrunk else ": add --shrink to prove the layout on the smallest model it allows"
    return (f"verify: one process of this model needs {needed / 2**30:.3g} GiB by the memory model, {where} "
            f"{available / 2**30:.3g} GiB{hint}")


def _free_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (unbounded where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


@app.command("status")
def status(
    run_dir: Path = typer.Argument(..., help="A run directory (trainer.out_dir of a run)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (keys as the lines)."),
) -> None:
    """Show a run's Slurm job state, its last logged step and loss, and its latest checkpoint."""
    from ppctl.cli.status_report import configured_max_steps, print_status, run_status
    from ppctl.run.slurm import JobRecordError, SlurmError, job_state, recorded_job

    run_dir = _existing_run_dir(run_dir)
    try:
        job_id = recorded_job(run_dir)
        max_steps = configured_max_steps(run_dir)
    except JobRecordError as error:
        fail(str(error))
    job = None
    if job_id is not None:
        try:
            state = job_state(job_id)
        except SlurmError as error:
            fail(str(error), code=1)
        job = {"job_id": job_id, "state": state.state, "restarts": state.restarts}
    report = run_status(run_dir.resolve(), job, max_steps)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        print_status(report)


@app.command("checkpoints")
def checkpoints(run_dir: Path = typer.Argument(..., help="A run directory (trainer.out_dir of a run).")) -> None:
    """List a run's checkpoints: step, layout, size, and whether each is complete (the latest is marked)."""
    from ppctl.checkpoint.files import CheckpointError, latest_checkpoint, list_checkpoints, locate_run

    run_dir, only = locate_run(run_dir)
    run_dir = _existing_run_dir(run_dir)
    found = [info for info in list_checkpoints(run_dir) if only is None or info.path.name == only.name]
    if not found:
        typer.echo(f"{run_dir}: no checkpoints")
        return
    try:
        latest = latest_checkpoint(run_dir)
    except CheckpointError as error:
        fail(str(error))
    for info in found:
        typer.echo(describe_checkpoint(info, info.path == latest))


@app.command("export")
def export(
    run_dir: Path = typer.Argument(..., help="A run directory (trainer.out_dir of a run), or one of its checkpoints."),
    out_dir: Path = typer.Argument(..., help="The Hugging Face model folder to write: new, or an empty folder."),
    step: Optional[int] = typer.Option(None, "--step", help="Export the checkpoint of this step (default: latest)."),
    max_shard_bytes: int = typer.Option(2 * 2**30, "--max-shard-bytes",
                                        help="Split the weights into shards of at most this many bytes."),
) -> None:
    """Write a run's checkpoint as a Hugging Face model folder (config.json, safetensors weights, tokenizer)."""
    from ppctl.checkpoint.hf_export import ExportError, export_run

    if max_shard_bytes < 1:
        fail(f"--max-shard-bytes={max_shard_bytes} must be at least 1")
    try:  # a signal ends it in one line; the hidden folder it was writing is removed
        with interruption_says(f"while exporting to {out_dir} (written whole or not at all)"):
            exported = export_run(run_dir, out_dir, step, max_shard_bytes)
    except ExportError as error:
        fail(str(error))
    for note in exported.notes:
        typer.echo(note, err=True)
    typer.echo(f"wrote {out_dir} from {exported.checkpoint} (step {exported.step})")


@app.command("generate")
def generate(
    source: Path = typer.Argument(..., help="A run directory (its latest checkpoint), one of its checkpoints, or a "
                                            "Hugging Face model folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The text to continue."),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens",
                                       help="Generate at most this many tokens (fewer at the end-of-text token)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Divide the logits by this before sampling; 0: "
                                                                 "greedy (the most likely token)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the K most likely tokens only; 0: all."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the most likely tokens whose probabilities reach "
                                                     "P, in (0, 1]; 1: all."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling generator: the same seed, the same text."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end instead of the text as it "
                                                       "comes."),
) -> None:
    """Continue a prompt with a run's model or a Hugging Face model, in this process (KV cache, one token a step)."""
    from ppctl.generate.inputs import prompt_problem, seed_problem
    from ppctl.generate.sampling import Sampling

    sampling = Sampling(temperature, top_k, top_p)
    if prompt is None:
        fail("--prompt TEXT is required: the text to continue")
    if max_new_tokens < 1:
        fail(f"--max-new-tokens={max_new_tokens} must be at least 1")
    for problem in (sampling.problem(), prompt_problem(prompt), seed_problem(seed)):
        if problem is not None:
            fail(problem)
    from ppctl.cli.generate_report import generate_and_print  # torch and the model's readers: after the checks
    from ppctl.generate.source import GenerateError
    from ppctl.model.hf_format import HFError

    try:
        with interruption_says("while generating"):
            generate_and_print(source, prompt, max_new_tokens, sampling, seed, as_json)
    except (GenerateError, HFError) as error:  # a folder's readers say HFError: one line, whichever reads
        fail(str(error))


def _existing_run_dir(path: Path) -> Path:
    """``path`` when it is a run directory (it holds the ``config.yaml`` a run writes, or a checkpoints folder);
    else one line and exit 2."""
    from ppctl.checkpoint.files import checkpoints_dir

    if not path.is_dir():
        fail(f"{path}: no such run directory")
    if not (path / "config.yaml").is_file() and not checkpoints_dir(path).is_dir():
        fail(f"{path}: not a run directory (no config.yaml or checkpoints folder in it): give the trainer.out_dir "
             f"of a run")
    return path


def describe_checkpoint(info, is_latest: bool) -> str:
    """One line of ``ppctl checkpoints``."""
    size = f"{info.bytes / 2**20:.1f} MiB" if info.bytes >= 2**20 else f"{info.bytes / 2**10:.1f} KiB"
    if not info.complete:
        return f"step {info.step:>8}  {size:>10}  incomplete: {info.problem}  {info.path}"
    layout = info.index["layout"]
    placement = " ".join(f"{key}={layout[key]}" for key in ("tp", "pp", "vpp", "dp", "cp"))
    placement += f" ep={layout['ep']}" if layout.get("ep", 1) > 1 else ""
    optimizer = "distributed optimizer" if layout["distributed_optimizer"] else "plain optimizer"
    return (f"step {info.step:>8}  {size:>10}  complete  {placement} {layout['schedule']}, {optimizer}, "
            f"{info.index['precision']}  ({info.index['reason']}){'  latest' if is_latest else ''}  {info.path}")


@app.command("prepare-data")
def prepare_data(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Tokenise the configured data source into its cache and check its splits (``train`` does this itself)."""
    from ppctl.config import validate

    config = load_config(overrides, config_dir, config_name, validate)
    summary = _prepare(config)
    typer.echo(summary or f"data.source={config.data.source} needs no preparation")


def _prepare(config: PpctlConfig) -> str | None:
    """Prepare the token cache of a token-file source and check that each split the run reads holds a window.

    Returns a one-line summary, or None for synthetic data; a source that cannot be
    prepared exits with status 2 and one line. Progress bars go to stderr when it is a terminal.
    """
    if config.data.source == "synthetic":
        return None
    from ppctl.data.corpus import CorpusSpec, DataError
    from ppctl.data.prepare import prepare_corpus

    spec = CorpusSpec.of(config.data)
    try:
        with interruption_says(f"while tokenising {spec.label}; the cache was left as it was"):
            prepared = prepare_corpus(spec, progress=sys.stderr.isatty())
        prepared.check_split("train", config.trainer.seq_length)
        if config.trainer.eval_every > 0:
            prepared.check_split("validation", config.trainer.seq_length)
    except DataError as error:
        fail(str(error))
    except (OSError, ValueError) as error:
        fail(f"data.source={config.data.source} data.path={config.data.path}: {error}")
    return prepared.summary()


@app.command("check-cluster")
def check_cluster(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Start the workers as training would, prove every group, measure links, print one table."""
    from ppctl.run.launch import LaunchRequest

    resolved = load_resolved(overrides, config_dir, config_name)
    _launch(resolved, LaunchRequest("check-cluster", _run_dir(resolved.config.trainer.out_dir)), dry_run)


@app.command("bench")
def bench(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    against: str = typer.Option("auto", "--against",
                                help="torch: torch.distributed.pipelining's class of the same schedule; plain: a "
                                     "plain PyTorch loop (pp=1); none: ppctl alone; auto: plain at pp=1, else torch."),
    steps: int = typer.Option(10, "--steps", help="Training steps per timed block."),
    repeats: int = typer.Option(5, "--repeats", help="Timed blocks per side, taken in turns (after one warm-up block)."),
    schedules: Optional[str] = typer.Option(None, "--schedules",
                                            help="Comma-separated schedules to compare in one launch (default: the "
                                                 "configured one); each is the overrides plus schedule=NAME."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list, one object per schedule (docs/bench.md)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Time ppctl's training step against torch.distributed.pipelining or a plain loop on the same work."""
    from ppctl.bench.rules import BenchRequest, bench_problem, resolve_against
    from ppctl.run.launch import LaunchRequest

    names = [name.strip() for name in schedules.split(",") if name.strip()] if schedules else [None]
    runs = [load_resolved(list(overrides or []) + ([f"schedule={name}"] if name else []), config_dir, config_name)
            for name in names]
    configs = [run.config for run in runs]
    side = resolve_against(against, configs[0].parallel.pp)
    for config in configs:
        problem = bench_problem(config, side, steps, repeats)
        if problem is not None:
            fail(f"schedule={config.schedule.name}: {problem}")
    files = {f"bench/{index}_{config.schedule.name}.yaml": to_yaml(config) for index, config in enumerate(configs)}
    request = BenchRequest(side, steps, repeats, tuple(files))
    files["bench_request.json"] = json.dumps(request.to_json())
    run_dir = _launch(runs[0], LaunchRequest("bench", _run_dir(configs[0].trainer.out_dir)), False, files)
    _report_bench(run_dir, as_json)


def _report_bench(run_dir: Path, as_json: bool) -> None:
    """Print the workers' ``bench.json`` as a table or JSON; exit 1 when a side computed other losses."""
    from ppctl.cli.bench_report import different_work, print_bench

    results = json.loads((run_dir / "bench.json").read_text())
    if as_json:
        sys.stdout.write(json.dumps(results, separators=(",", ":")) + "\n")
    else:
        print_bench(results, run_dir)
    problem = different_work(results)
    if problem is not None:
        fail(problem, code=1)


def _launch(resolved: "ResolvedConfig", request: "LaunchRequest", dry_run: bool,
            files: dict[str, str] | None = None) -> Path:
    """Create and lock the run directory (writing ``files`` into it too), run the workers; return the run directory.

    A failure exits 1, an interruption 128 + the signal."""
    from ppctl.run.launch import (backend_problem, build_launch_plan, describe_interruption, describe_workers,
                                  local_gpus, resolve_backend, run_plan, saved_on_stop)
    from ppctl.run.rendezvous import rendezvous_problem
    from ppctl.run.rundir import run_dir_problem

    config, run_dir, task = resolved.config, request.run_dir, request.task
    # before anything starts or changes in the directory, the dry run included
    problem = run_dir_problem(run_dir, task, request.resume_from, config.trainer.overwrite)
    if problem is not None:
        fail(problem)
    backend = resolve_backend(config.launcher.backend, resolved.sizes.nproc_per_node)
    problem = backend_problem(backend, resolved.sizes.nproc_per_node, local_gpus())
    if problem is not None:
        fail(problem)
    plan = build_launch_plan(config, request, backend)
    banner = (f"run directory: {run_dir}  ({task}, {backend}, {config.launcher.nnodes} node(s), "
              f"{describe_workers(config)})")
    if dry_run:
        typer.echo(banner)
        if _clears_earlier_run(config, run_dir, task):
            typer.echo(f"trainer.overwrite=true: would delete the earlier run's checkpoints and TensorBoard logs in "
                       f"{run_dir}")
        typer.echo(plan.printable())
        return run_dir
    if task in ("train", "bench"):
        _prepare(config)  # once, here, before any worker starts
    problem = rendezvous_problem(config.launcher)
    if problem is not None:
        fail(problem)
    lock = write_run_dir(resolved, run_dir, task)  # one line and exit 2 when it cannot be made or written, or busy
    started = time.time()
    try:
        if _clears_earlier_run(config, run_dir, task):
            _clear_earlier_run(run_dir)  # only now, under the lock: never a live run's checkpoints
        _write_files(run_dir, files or {})
        typer.echo(banner, err=True)
        result = run_plan(plan)
    finally:
        lock.release()
    if result.interrupted is not None:
        resumable = task == "train" and config.trainer.checkpoints
        saved = resumable and saved_on_stop(run_dir, result.interrupted, started)
        typer.echo(describe_interruption(result, run_dir, resumable, saved), err=True)
        raise typer.Exit(result.exit_code)
    if result.failure:
        fail(result.failure, code=1)
    return run_dir


def _write_files(run_dir: Path, files: dict[str, str]) -> None:
    """Write each ``relative path -> text`` into the run directory (one line and exit 2 when one cannot be)."""
    for relative, text in files.items():
        path = run_dir / relative
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            fail(f"trainer.out_dir={run_dir}: cannot write {relative}: {os_reason(error, path)}")


def _clears_earlier_run(config: PpctlConfig, run_dir: Path, task: str) -> bool:
    """Whether this launch deletes an earlier run's checkpoints in ``run_dir`` (``trainer.overwrite=true``; node 0
    alone, as the nodes of a job share the run directory)."""
    from ppctl.run.rundir import committed_steps

    return (task == "train" and config.trainer.overwrite and config.launcher.node_rank == 0
            and bool(committed_steps(run_dir)))


def _clear_earlier_run(run_dir: Path) -> None:
    """Delete the earlier run's checkpoints and logs and say so; one line and exit 2 when they cannot be deleted."""
    from ppctl.run.rundir import clear_earlier_run

    try:
        said = clear_earlier_run(run_dir)
    except OSError as error:
        fail(f"trainer.overwrite=true: cannot delete the earlier run's files in {run_dir}: {os_reason(error)}")
    if said:
        typer.echo(said, err=True)


def write_run_dir(resolved: "ResolvedConfig", run_dir: Path, task: str) -> RunDirLock:
    """Create the run directory, check that it can be written, lock it, write which ``task`` runs there, the resolved
    ``config.yaml`` and ``layout.json``; return the lock.

    The check and the lock come before the files: a run refused because the directory cannot be written, or
    because another one holds it, changes nothing in it. Each refusal is one line and exit 2.
    """
    from ppctl.run.rundir import TASK_RECORD, RunDirBusy, RunDirLock, writable_problem
    from ppctl.cli.layout_report import layout_report

    config = resolved.config
    lock = RunDirLock(run_dir, config.launcher.node_rank)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        problem = writable_problem(run_dir, task == "train" and config.trainer.checkpoints)
        if problem is not None:
            fail(problem)
        lock.acquire()
        (run_dir / TASK_RECORD).write_text(f"{task}\n")
        (run_dir / "config.yaml").write_text(to_yaml(config))
        (run_dir / "layout.json").write_text(json.dumps(layout_report(resolved), indent=1))
    except RunDirBusy as error:
        fail(str(error))
    except OSError as error:
        lock.release()
        fail(f"trainer.out_dir={run_dir}: cannot create the run directory: {os_reason(error, run_dir)}")
    return lock


def main() -> None:
    """Console-script entry point."""
    install_before_start_handlers()  # the launch installs its own while workers run
    sys.stdout = GuardedStdout(sys.stdout)
    try:
        app()
    except StdoutError as error:
        os.dup2(os.open(os.devnull, os.O_WRONLY), STDOUT_FD)  # the interpreter's last flush must not fail again
        if error.errno != errno.EPIPE:  # a reader that went away (`| head`) wants no message
            typer.echo(f"error: cannot write the output to stdout: {error.strerror}", err=True)
        raise SystemExit(1) from None


STDOUT_FD = 1


class StdoutError(Exception):
    """Writing to stdout failed (a full disk, ``/dev/full``, a closed pipe): not an ``OSError``, so that neither
    Click nor a command's own file handling takes it for theirs."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror)
        self.errno, self.strerror = error.errno, error.strerror or str(error)


class GuardedStdout:
    """``sys.stdout`` whose failed writes raise ``StdoutError``; everything else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; ``StdoutError`` when the stream refuses it."""
        try:
            return self._stream.write(text)
        except OSError as error:
            raise StdoutError(error) from None

    def flush(self) -> None:
        """Flush; ``StdoutError`` when the stream refuses it."""
        try:
            self._stream.flush()
        except OSError as error:
            raise StdoutError(error) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


BEFORE_START_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers_pid: int | None = None  # the process that installed ``interrupted_before_start``
_fork_hook_registered = False  # ``os.register_at_fork`` cannot undo a hook: it is registered once per process
_interrupted_while: str | None = None  # what the line of ``interrupted_before_start`` says ppctl was doing
_parent_death = None  # the ``ParentDeathSignal`` a process forked before the launch arms, built in ppctl's own


def install_before_start_handlers() -> None:
    """Make SIGINT and SIGTERM end ``ppctl`` with one line until the launch installs its own handlers.

    A process forked meanwhile (the tokenising processes of ``datasets``, which their pool ends
    with SIGTERM) gets the default action back, in a process group of its own (``_detach_forked_child``).
    """
    from ppctl.run.interrupt import ParentDeathSignal, RaiseSwallowedAgain

    global _handlers_pid, _fork_hook_registered, _parent_death
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_detach_forked_child)
        _fork_hook_registered = True
    _handlers_pid, _parent_death = os.getpid(), ParentDeathSignal(signal.SIGTERM)
    if not isinstance(sys.unraisablehook, RaiseSwallowedAgain):  # a signal while a __del__ runs: see its docstring
        sys.unraisablehook = RaiseSwallowedAgain(sys.unraisablehook)
    for signum in BEFORE_START_SIGNALS:
        signal.signal(signum, interrupted_before_start)


def _detach_forked_child() -> None:
    """In a process forked before the launch: the default action for each signal that still runs
    ``interrupted_before_start``, a process group of its own, and SIGTERM when ppctl ends.

    A Python handler there would print a false "interrupted" line, and can miss the signal
    altogether (one that comes just before the child blocks on a lock runs no Python code). In
    ppctl's process group, a terminal's Ctrl-C (or ``kill -- -PGID``) would kill a pool process
    waiting for work while it holds the pool's lock, and ppctl, ending the pool, would wait for that
    lock for ever; outside it, the signal reaches ppctl alone, which ends the pool with SIGTERM. The
    parent-death signal keeps what the terminal's hang-up no longer reaches from outliving ppctl.
    """
    forked_before_start = False
    for signum in BEFORE_START_SIGNALS:
        if signal.getsignal(signum) is interrupted_before_start:
            signal.signal(signum, signal.SIG_DFL)
            forked_before_start = True
    if not forked_before_start:
        return
    os.setpgid(0, 0)
    if _parent_death is not None and not _parent_death.arm(_handlers_pid):
        os.kill(os.getpid(), signal.SIGTERM)  # ppctl ended before the signal was armed


def interrupted_before_start(signum: int, frame) -> None:
    """SIGINT/SIGTERM while composing, validating or preparing data: one line, exit 128 + the signal.

    Only in the process that installed it: in a child that still runs it (a signal that came
    between its fork and ``_detach_forked_child``), the signal takes its default action. Where
    Python swallows the exit (the signal came while a ``__del__`` ran), ``RaiseSwallowedAgain``,
    installed beside it, signals again: the line is said once.
    """
    from ppctl.run.interrupt import Interruption, RaiseSwallowedAgain

    if _handlers_pid is not None and os.getpid() != _handlers_pid:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    hook = sys.unraisablehook if isinstance(sys.unraisablehook, RaiseSwallowedAgain) else None
    said = hook is not None and hook.said(signum)
    if hook is not None and hook.running_in(frame):  # raised in the hook, the exit would be swallowed again
        hook.signal_later(signum, said)
        return
    if not said:
        doing = _interrupted_while or "before any worker started"
        typer.echo(f"error: interrupted by {signal.Signals(signum).name} {doing}", err=True)
    raise Interruption(signum)


@contextlib.contextmanager
def interruption_says(doing: str) -> Iterator[None]:
    """Within the block, the line of ``interrupted_before_start`` says ``doing`` (``while tokenising ...``) instead
    of ``before any worker started``; the block's own clean-up runs as its ``SystemExit`` unwinds it."""
    global _interrupted_while
    outer, _interrupted_while = _interrupted_while, doing
    try:
        yield
    finally:
        _interrupted_while = outer


if __name__ == "__main__":
    main()
