"""The ``ppctl`` command line: parse, compose the config, validate, delegate.

Every command that reads config takes Hydra overrides as trailing arguments
(``ppctl inspect-layout parallel.tp=2 parallel.pp=4``) and ``--config-dir`` /
``--config-name`` for a user's own config tree. A bad config exits with status 2
and one line on stderr, before any process starts. Heavy imports (torch) happen
inside the commands that need them, so ``inspect-layout`` starts quickly.

Here are the commands' faces only: their options, their one-line refusals and exit statuses, what they
print. The work is below: a launch's (its run directory, resume point, lock) in ``ppctl.run.start``,
``ppctl.run.rundir`` and ``ppctl.run.resume_point``, whose exceptions carry the line said here; the
signal handlers before any worker starts (``ppctl.run.interrupt.BeforeStartSignals``), which ``main``
builds and hands to the commands, and the stdout guard (``ppctl.run.stdout_guard``). No function here
is longer than 40 lines (``tests/unit/test_cli_faces.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

import typer

from ppctl.cli.default_group import SubmitGroup
from ppctl.cli.memory_check_report import TOLERANCE
from ppctl.plan.budget import FRAGMENTATION, MemoryBudget
from ppctl.config import ConfigError, PpctlConfig
from ppctl.resolve import compose_config, to_yaml
from ppctl.fileio import os_reason

if TYPE_CHECKING:
    from ppctl.resolve.resolved import ResolvedConfig
    from ppctl.data.cache import PreparedCorpus
    from ppctl.data.corpus import CorpusSpec
    from ppctl.data.shards import ShardTask
    from ppctl.run.interrupt import BeforeStartSignals
    from ppctl.run.launch import LaunchRequest

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
    """Print one error line on stderr and exit with ``code``; a signal whose exit Python swallowed meanwhile (its line
    said) ends the command instead, what went wrong after it being its consequence."""
    from ppctl.run.interrupt import raise_swallowed_interruption

    raise_swallowed_interruption()
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


def _tasks(text: str) -> int:
    """``submit prepare-data --tasks``: a whole number of array tasks, at least 1."""
    from ppctl.run.slurm_prepare import parse_tasks

    return parsed_or_fail(parse_tasks, text)


def _steps(text: str) -> int:
    """``inspect-schedule --steps``: a whole number of steps, at least 1."""
    from ppctl.cli.schedule_report import parse_steps

    return parsed_or_fail(parse_steps, text)


@contextlib.contextmanager
def refused_in_one_line(*errors: type[Exception]) -> Iterator[None]:
    """Within the block, one of ``errors`` (whose message is one line) ends the command: that line, and its
    ``exit_code`` (default 2)."""
    try:
        yield
    except errors as error:
        fail(str(error), getattr(error, "exit_code", 2))


def before_start_signals(ctx: typer.Context) -> "BeforeStartSignals":
    """The handlers of SIGINT and SIGTERM that ``main`` installed and handed to the command (``app(obj=...)``); a
    bare one, installed nowhere, where the app runs without ``main`` (a test's ``CliRunner``)."""
    from ppctl.run.interrupt import BeforeStartSignals

    return ctx.obj if isinstance(ctx.obj, BeforeStartSignals) else BeforeStartSignals()


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
    """Compose a config and resolve it once (``ppctl.resolve.resolved.resolve``, with ``checks``: its ``data``,
    ``prove_schedule`` and ``layer_split``); a refusal is exit status 2 with one line."""
    from ppctl.resolve.resolved import resolve

    return resolve_or_fail(load_config(overrides, config_dir, config_name), **checks)


def resolve_or_fail(config: PpctlConfig, **checks: bool) -> "ResolvedConfig":
    """``resolve(config, **checks)``, a refusal being exit status 2 with one line."""
    from ppctl.resolve.resolved import resolve

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
    memory_gb: Optional[float] = typer.Option(None, "--memory-gb", min=0.001, help="GiB per device (default: the "
                                              "device's); ranks fit what reserve and fragmentation leave of it."),
    reserve_gb: Optional[float] = typer.Option(None, "--reserve-gb", min=0, help="GiB per device no tensor holds "
                                               "(CUDA context, NCCL, kernel workspaces; default: the device's, 2)."),
    fragmentation: float = typer.Option(FRAGMENTATION, "--fragmentation", min=0, max=1,
                                        help="The allocator's fragmentation, a share of what a rank allocates."),
    device_name: str = typer.Option("h100", "--device",
                                    help="The device's throughput, memory and links: h100, h200 or a100."),
    top: int = typer.Option(10, "--top", min=1, help="How many candidates to print, fastest first."),
    calibrate: Optional[Path] = typer.Option(None, "--calibrate", metavar="RUN_DIR", help="Take the throughput, "
                                             "message time and the runtime's time between actions from a measured "
                                             "run (ppctl bench, a traced train run), not the device's figures."),
    explain: Optional[int] = typer.Option(None, "--explain", min=1, metavar="N", help="Show candidate N of the "
                                          "list: its memory per rank by part and its simulated timeline."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (docs/plan.md lists the keys)."),
    check: int = typer.Option(0, "--check", min=0, metavar="N", help="Check the first N candidates' memory at "
                              "full size in fake tensors (ppctl check-memory's sample of ranks) and mark them."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Rank the layouts of the model on N devices that fit in memory by predicted step time."""
    from ppctl.resolve import validate_data
    from ppctl.plan.search import plan as search

    config = load_config(overrides, config_dir, config_name, validate_data)
    device = _plan_device(device_name, calibrate, config)
    budget = _memory_budget(device, memory_gb, reserve_gb, fragmentation)
    result = search(config, gpus, budget.usable_bytes, top, device)
    if explain is not None and result.candidates:  # else the reasons nothing fits, below
        _explain(result, explain, config, device, list(overrides or []))
    else:
        _show_plan(result, _checked(result, config, check), as_json, list(overrides or []), gpus, budget, device)
    if not result.candidates:
        fail(f"no layout of --gpus {gpus} fits: each was left out for a reason counted "
             f"{'in refused' if as_json else 'above'}", code=1)


def _memory_budget(device, memory_gb: Optional[float], reserve_gb: Optional[float],
                   fragmentation: float) -> MemoryBudget:
    """``ppctl plan``'s ``MemoryBudget``: ``--memory-gb`` and ``--reserve-gb`` or the device's; one line and exit 2
    when the reserve leaves nothing."""
    budget = MemoryBudget((memory_gb or device.memory_gb) * 2 ** 30,
                          (device.reserve_gb if reserve_gb is None else reserve_gb) * 2 ** 30, fragmentation)
    if budget.usable_bytes <= 0:
        fail(f"--reserve-gb {budget.reserve_bytes / 2 ** 30:g} leaves nothing of "
             f"{budget.device_bytes / 2 ** 30:g} GiB per device: give a smaller --reserve-gb or a larger --memory-gb")
    return budget


def _show_plan(result, checked: list[dict], as_json: bool, user_overrides: list[str], gpus: int,
               budget: MemoryBudget, device) -> None:
    """``ppctl plan``'s table, or its JSON object (``checked``: ``--check``'s marks, under ``checked``)."""
    from ppctl.cli.plan_report import print_plan

    if as_json:
        sys.stdout.write(json.dumps({**result.to_json(), "memory_budget": budget.to_json(), "checked": checked},
                                    separators=(",", ":")) + "\n")
    else:
        print_plan(result, user_overrides, gpus, budget, device.describe(), checked)


def _checked(result, config: PpctlConfig, count: int) -> list[dict]:
    """``ppctl plan --check N``: the first ``count`` candidates' sampled ranks run in fake tensors (``candidate`` its
    place, counted from 1; its ranks' checks; the lines of the parts off by more than 5%)."""
    from ppctl.cli.memory_check_report import misses
    from ppctl.resolve.resolved import resolve
    from ppctl.run.fake_rank import check_ranks, distinct_ranks

    checked = []
    for number, prediction in enumerate(result.candidates[:count], start=1):
        resolved = resolve(prediction.candidate.apply(config), data=False)
        checks = check_ranks(resolved, distinct_ranks(resolved, "sample"))
        checked.append({"candidate": number, "checks": [check.to_json() for check in checks],
                        "misses": misses(checks, TOLERANCE)})
    return checked


def _plan_device(name: str, calibrate: Optional[Path], config: PpctlConfig):
    """``ppctl plan``'s device: the figures of ``--device`` ``name``, or those measured in the ``--calibrate`` run
    directory; one line and exit 2 for a device it does not know or a run that cannot calibrate this config."""
    from ppctl.cli.calibrate import calibration_of
    from ppctl.plan.search import DEVICES, calibrated_device

    if name not in DEVICES:
        fail(f"--device {name!r}: choose one of {', '.join(DEVICES)}")
    device = DEVICES[name]
    if calibrate is None:
        return device
    try:
        calibration = calibration_of(calibrate, config.schedule.name)
        return calibrated_device(device, calibration, calibration.measured_config())
    except (ValueError, ConfigError) as error:
        fail(str(error))


def _explain(result, number: int, config: PpctlConfig, device, user_overrides: list[str]) -> None:
    """``ppctl plan --explain N``: candidate N's memory and simulated timeline."""
    from ppctl.cli.plan_report import print_explanation
    from ppctl.plan.search import explain_candidate

    if number > len(result.candidates):
        fail(f"--explain {number}: the plan holds {len(result.candidates)} candidate(s)")
    prediction = result.candidates[number - 1]
    print_explanation(prediction, explain_candidate(config, prediction.candidate, device), user_overrides)


@app.command("check-memory")
def check_memory(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    ranks: str = typer.Option("sample", "--ranks", help="all (every pp rank), sample (the first, a middle and the "
                              "last pp rank), each with ep > 1 also at the last EP rank (sample: the middle one), "
                              "or global ranks apart by commas."),
    tolerance: float = typer.Option(TOLERANCE, "--tolerance", min=0.0, help="The largest difference of a judged "
                                    "part (parameters, gradients, optimizer, activations, total) as a fraction."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the checked ranks and the misses."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Run one step of chosen ranks at full size in fake tensors (no memory, no devices) and set each rank's
    measured memory by part beside the memory model's prediction; exit 1 when a judged part is off."""
    from ppctl.cli.memory_check_report import misses, print_checks
    from ppctl.run.fake_rank import check_ranks, chosen_ranks

    resolved = load_resolved(overrides, config_dir, config_name, data=False)  # synthetic microbatches: no data
    with refused_in_one_line(ValueError):
        chosen = chosen_ranks(resolved, ranks)
    checks = check_ranks(resolved, chosen)
    missed = misses(checks, tolerance)
    if as_json:
        sys.stdout.write(json.dumps({"checks": [check.to_json() for check in checks], "misses": missed},
                                    separators=(",", ":")) + "\n")
    else:
        print_checks(checks, f"ppctl check-memory: {len(checks)} rank(s) of {resolved.layout.world_size}, measured "
                             f"in fake tensors against the memory model")
        for line in missed:
            print(line)
    if missed:
        raise typer.Exit(1)


@app.command("train")
def train(
    ctx: typer.Context,
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command and run directory; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate, create the run directory, start the torchrun workers and train."""
    from ppctl.run.launch import LaunchRequest
    from ppctl.run.rundir import run_dir_of

    resolved = load_resolved(overrides, config_dir, config_name)
    config = resolved.config
    if config.launcher.kind == "slurm" and "SLURM_JOB_ID" not in os.environ:
        fail("launcher=slurm: submit the run with ppctl submit (ppctl train runs it here, outside Slurm; "
             "launcher=local to do that)")
    resume_from, run_dir = _resume_point(config)
    _launch(resolved, LaunchRequest("train", run_dir_of(run_dir), resume_from), dry_run, before_start_signals(ctx))


def _resume_point(config: PpctlConfig) -> tuple[str | None, str | None]:
    """``ppctl.run.resume_point.resume_point``: the verified checkpoint a training run resumes from and its run
    directory; a refusal is one line and exit 2, a run already complete says so and exits 0."""
    from ppctl.run.resume_point import ResumeRefused, RunComplete, resume_point

    try:
        with refused_in_one_line(ResumeRefused):
            return resume_point(config)
    except RunComplete as complete:
        typer.echo(str(complete), err=True)
        raise typer.Exit(0)


submit_app = typer.Typer(
    cls=SubmitGroup,
    help="Hand a run (ppctl submit OVERRIDES, the same as ppctl submit train OVERRIDES) or a corpus' preparation "
         "(ppctl submit prepare-data OVERRIDES, a job array) to Slurm (launcher=slurm).",
    subcommand_metavar="[train|prepare-data] [OVERRIDES]...",
)
app.add_typer(submit_app, name="submit")


@submit_app.command("train")
def submit(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run directory and job.sbatch and print the "
                                                          "script; submit nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate, write the run directory and its Slurm job script (launcher=slurm), and submit it with sbatch."""
    from ppctl.run.slurm import JOB_SCRIPT, record_job

    resolved = load_resolved(overrides, config_dir, config_name)
    if resolved.config.launcher.kind != "slurm":
        fail("ppctl submit hands the run to Slurm: add launcher=slurm (and launcher.slurm.* for the allocation); "
             "ppctl train runs it here")
    run_dir = _write_job_dir(resolved)
    script = run_dir / JOB_SCRIPT
    if dry_run:
        _print_unsubmitted(script)
        return
    job_id = _sbatch(script)
    record_job(run_dir, job_id)
    typer.echo(f"submitted job {job_id}: run directory {run_dir}")
    typer.echo(f"follow it with: ppctl status {run_dir}", err=True)


def _print_unsubmitted(script: Path) -> None:
    """``--dry-run``: the job script written, printed, and how to submit it later."""
    typer.echo(script.read_text(), nl=False)
    typer.echo(f"wrote {script} (not submitted: sbatch {script} submits it)", err=True)


def _sbatch(script: Path) -> str:
    """``sbatch`` the job script; its job id. A missing sbatch or its refusal is one line and exit 1."""
    from ppctl.run.slurm import SlurmError, submit_job

    try:
        return submit_job(script)
    except SlurmError as error:
        fail(str(error), code=1)
        raise AssertionError("unreachable")


@submit_app.command("prepare-data")
def submit_prepare_data(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    tasks: Optional[int] = typer.Option(None, "--tasks", parser=_tasks, metavar="T",
                                        help="Array tasks, each preparing one of T contiguous groups of the corpus' "
                                             "shards on a node of its own (default: launcher.nnodes)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The job's folder (its config, prepare.sbatch and the "
                                                           "tasks' logs): new or empty; default "
                                                           "runs/prepare-<timestamp>."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the job's folder and print its prepare.sbatch; "
                                                          "submit nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate as prepare-data does, write the job's folder and submit prepare-data as a Slurm job array."""
    from ppctl.resolve import validate
    from ppctl.run.slurm_prepare import PREPARE_SCRIPT, submit_problem

    config = load_config(overrides, config_dir, config_name, validate)
    problem = submit_problem(config)
    if problem is not None:
        fail(problem)
    tasks = config.launcher.nnodes if tasks is None else tasks
    job_dir = _write_prepare_job(config, out, tasks)
    script = job_dir / PREPARE_SCRIPT
    if dry_run:
        _print_unsubmitted(script)
        return
    job_id = _sbatch(script)
    typer.echo(f"submitted job array {job_id} ({tasks} tasks): job folder {job_dir}")
    typer.echo(f"follow it with: squeue --jobs {job_id} (task I logs to {job_dir}/prepare-{job_id}_I.out; the "
               f"corpus is ready when every task is COMPLETED: sacct --jobs {job_id})", err=True)


def _write_prepare_job(config: PpctlConfig, out: Optional[Path], tasks: int) -> Path:
    """``ppctl submit prepare-data``'s job folder (``--out``, else a new ``runs/prepare-<timestamp>``), written
    (``ppctl.run.start.write_prepare_job``); return it. A refusal is one line and exit 2."""
    from ppctl.run.rundir import RunDirError, default_run_dir
    from ppctl.run.start import write_prepare_job

    if out is None:
        default = default_run_dir()
        out = default.with_name(f"prepare-{default.name}")
    job_dir = out.resolve()  # the tasks may start anywhere
    with refused_in_one_line(RunDirError):
        write_prepare_job(config, job_dir, Path.cwd().resolve(), tasks)
    return job_dir


def _write_job_dir(resolved: "ResolvedConfig") -> Path:
    """``ppctl submit``'s run directory, the checkpoint it resumes from verified, written with the job's config and
    script (``ppctl.run.start.write_job_dir``); return it. A refusal is one line and exit 2."""
    from ppctl.run.resume_point import ResumeRefused, resume_point_at
    from ppctl.run.rundir import RunDirError, default_run_dir
    from ppctl.run.start import write_job_dir

    config = resolved.config
    with refused_in_one_line(ResumeRefused, RunDirError):
        resume_from, run_dir = resume_point_at(config, config.trainer.resume_from)
        run_dir = Path(run_dir or default_run_dir()).resolve()  # the job may start anywhere
        write_job_dir(config, run_dir, Path.cwd().resolve(), resume_from, _layout_json(resolved))
    return run_dir


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
    from ppctl.verify.runs import PARALLEL, SINGLE, verify_plan

    if precision not in ("fp64", "fp32"):
        fail(f"--precision {precision}: choose fp64 or fp32 (half precision is compared by trajectory, not proven "
             f"equal)")
    user, shrunk = _verify_overrides(list(overrides or []), out, shrink, config_dir, config_name)
    plan = verify_plan(user, steps, precision, (out or _verify_dir()).resolve())
    runs = {name: load_resolved(plan.overrides[name], config_dir, config_name) for name in (PARALLEL, SINGLE)}
    problem = _single_fit_problem(runs[SINGLE], shrink)
    if problem is not None:
        fail(problem)
    if _verify_runs(plan, runs, steps, config_dir, config_name):
        _judge_verify(plan, runs[SINGLE].config, steps, shrunk, as_json)


def _verify_overrides(user: list[str], out: Optional[Path], shrink: bool, config_dir: Optional[Path],
                      config_name: str) -> tuple[list[str], list[str]]:
    """``ppctl verify``'s overrides (the user's, and ``--shrink``'s) and what shrank; one line and exit 2 for a
    multi-node verify without ``--out``, an ``--out`` that holds an earlier verify, or a model that cannot shrink."""
    from ppctl.verify.runs import earlier_verify
    from ppctl.verify.shrink import shrink_overrides, shrink_refusal

    given = load_resolved(user, config_dir, config_name, data=False).config
    if given.launcher.nnodes > 1 and out is None:
        fail(f"verify on launcher.nnodes={given.launcher.nnodes} needs --out DIR, the same on every node and on a "
             f"filesystem they share: each node's part of the parallel run writes there, and node 0 compares")
    used = None if out is None else earlier_verify(out.resolve(), given.launcher.nnodes == 1)
    if used is not None:
        fail(f"--out {out} holds an earlier verify ({used}), which this one would overwrite; give each verify a "
             f"folder of its own (a new --out DIR, or no --out for a new runs/verify-<timestamp>)")
    if not shrink:
        return user, []
    refusal = shrink_refusal(given)
    if refusal is not None:
        fail(refusal)
    extra, shrunk = shrink_overrides(given)
    return user + extra, shrunk


def _verify_runs(plan, runs: dict[str, "ResolvedConfig"], steps: int, config_dir: Optional[Path],
                 config_name: str) -> bool:
    """Run ``ppctl verify``'s two runs (off node 0, its part of the parallel one only); a failed one is one line and
    exit 1. Returns whether this node compares them."""
    from ppctl.verify.runs import PARALLEL, SINGLE, config_options, launch, train_command

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
    return not own_part_only


def _judge_verify(plan, single: PpctlConfig, steps: int, shrunk: list[str], as_json: bool) -> None:
    """Compare ``ppctl verify``'s two runs and print the verdict; exit 1 when they differ (or cannot be read)."""
    from ppctl.cli.verify_report import print_verdict, verdict_json
    from ppctl.verify.compare import VerifyError, judge
    from ppctl.verify.runs import PARALLEL, SINGLE

    try:
        verdict = judge(plan.run_dirs[PARALLEL], plan.run_dirs[SINGLE], single, steps)
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
    ctx: typer.Context,
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
        with before_start_signals(ctx).saying(f"while exporting to {out_dir} (written whole or not at all)"):
            exported = export_run(run_dir, out_dir, step, max_shard_bytes)
    except ExportError as error:
        fail(str(error))
    for note in exported.notes:
        typer.echo(note, err=True)
    typer.echo(f"wrote {out_dir} from {exported.checkpoint} (step {exported.step})")


@app.command("generate")
def generate(
    ctx: typer.Context,
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
        with before_start_signals(ctx).saying("while generating"):
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
    ctx: typer.Context,
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    task: Optional[int] = typer.Option(None, "--task", min=0, help="Prepare only this task's shards (0 to "
                                                                    "--tasks - 1): one task of a Slurm array."),
    tasks: Optional[int] = typer.Option(None, "--tasks", min=1, help="How many tasks share the shards."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Tokenise the configured data source into its cache and check its splits (``train`` does this itself)."""
    from ppctl.data.shards import ShardTask
    from ppctl.resolve import validate

    if (task is None) != (tasks is None):
        fail("--task and --tasks go together: --task I --tasks T prepares task I's share of the shards")
    if task is not None and task >= tasks:
        fail(f"--task {task} --tasks {tasks}: the task must be 0 to {tasks - 1}")
    config = load_config(overrides, config_dir, config_name, validate)
    if task is not None and (config.data.blend or config.data.source not in ("text", "python_stdlib")):
        fail("--task/--tasks share a text corpus's shards (data=text or python_stdlib); prepare "
             f"{'each source of data.blend' if config.data.blend else f'data.source={config.data.source}'} "
             f"without them")
    summary = _prepare(config, before_start_signals(ctx), None if task is None else ShardTask(task, tasks))
    typer.echo(summary or f"data.source={config.data.source} needs no preparation")


def _prepare(config: PpctlConfig, signals: "BeforeStartSignals", task: "ShardTask | None" = None) -> str | None:
    """Prepare the token cache of a token-file source and check that each split the run reads holds a window.

    Returns a one-line summary, or None for synthetic data; a blend (``data.blend``) prepares each of its
    sources and returns one line for each: its tokens, its weight, its epochs in ``trainer.max_steps``. A
    source that cannot be prepared exits with status 2 and one line. Progress bars go to stderr when it is a
    terminal; a signal meanwhile is said by ``signals`` as one line naming what was tokenised.
    """
    if config.data.source == "synthetic" and not config.data.blend:
        return None
    from ppctl.data.corpus import BlendSpec, DataError, data_spec_of

    spec = data_spec_of(config.data)
    try:
        if not isinstance(spec, BlendSpec):
            return _prepare_source(spec, config, signals, task=task).summary(config.trainer.seq_length)
        from ppctl.data.blend import blend_lines

        prepared = [_prepare_source(one, config, signals, index) for index, one in enumerate(spec.specs)]
        trainer = config.trainer
        return "\n".join(blend_lines(spec, prepared, trainer.seq_length, trainer.max_steps, trainer.global_batch_size))
    except DataError as error:
        fail(str(error))
    except (OSError, ValueError) as error:
        where = "data.blend" if config.data.blend else f"data.source={config.data.source} data.path={config.data.path}"
        fail(f"{where}: {error}")


def _prepare_source(spec: "CorpusSpec", config: PpctlConfig, signals: "BeforeStartSignals",
                    blend_index: int | None = None, task: "ShardTask | None" = None) -> "PreparedCorpus":
    """The prepared token file of one source, its splits checked; a blend's source (``blend_index``) is named
    ``data.blend[i]`` in what it says. With ``task``, that task's shards (a ``PartialCorpus`` until all are)."""
    from ppctl.data.corpus import DataError
    from ppctl.data.entry import PartialCorpus
    from ppctl.data.prepare import prepare_corpus

    where = "" if blend_index is None else f"data.blend[{blend_index}]"
    what = f"{where} ({spec.label})" if where else spec.label
    try:
        with signals.saying(f"while tokenising {what}; the shards already complete are kept, and a new "
                            f"preparation resumes from them"):
            prepared = prepare_corpus(spec, progress="bar" if sys.stderr.isatty() else "lines", task=task)
        if isinstance(prepared, PartialCorpus):
            return prepared
        prepared.check_split("train", config.trainer.seq_length)
        prepared.check_lengths(config.trainer.seq_length)  # instruction data: rows longer than a window
        if config.trainer.eval_every > 0:
            prepared.check_split("validation", config.trainer.seq_length)
    except DataError as error:
        raise DataError(f"{where}: {error}" if where else str(error)) from None
    return prepared


@app.command("check-cluster")
def check_cluster(
    ctx: typer.Context,
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Start the workers as training would, prove every group, measure links, print one table."""
    from ppctl.run.launch import LaunchRequest
    from ppctl.run.rundir import run_dir_of

    resolved = load_resolved(overrides, config_dir, config_name)
    _launch(resolved, LaunchRequest("check-cluster", run_dir_of(resolved.config.trainer.out_dir)), dry_run,
            before_start_signals(ctx))


@app.command("bench")
def bench(
    ctx: typer.Context,
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    against: str = typer.Option("auto", "--against",
                                help="torch: torch.distributed.pipelining's class of the same schedule; plain: a "
                                     "plain PyTorch loop (pp=1); eager: ppctl with trainer.compile=false (the run "
                                     "sets it true); none: ppctl alone; auto: plain at pp=1, else torch."),
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
    from ppctl.run.rundir import run_dir_of

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
    run_dir = _launch(runs[0], LaunchRequest("bench", run_dir_of(configs[0].trainer.out_dir)), False,
                      before_start_signals(ctx), files)
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


def _launch(resolved: "ResolvedConfig", request: "LaunchRequest", dry_run: bool, signals: "BeforeStartSignals",
            files: dict[str, str] | None = None) -> Path:
    """Create and lock the run directory (writing ``files`` into it too), run the workers; return the run directory.
    ``signals`` say what the command does while it prepares the data.

    A refusal exits 2, a failure 1, an interruption 128 + the signal, each with one line (``ppctl.run.start``)."""
    from ppctl.run.rundir import RunDirError
    from ppctl.run.start import LaunchError, LaunchInterrupted, dry_run_lines, plan_launch, start_launch

    try:
        with refused_in_one_line(LaunchError, RunDirError):
            launch = plan_launch(resolved, request)  # before anything starts or changes in the directory
            if dry_run:
                for line in dry_run_lines(launch):
                    typer.echo(line)
                return request.run_dir
            if request.task in ("train", "bench"):
                _prepare(resolved.config, signals)  # once, here, before any worker starts
            start_launch(launch, _layout_json(resolved), files or {})
    except LaunchInterrupted as interrupted:
        typer.echo(str(interrupted), err=True)
        raise typer.Exit(interrupted.exit_code)
    return request.run_dir


def _layout_json(resolved: "ResolvedConfig") -> str:
    """The run directory's ``layout.json``: ``ppctl inspect-layout --json``'s report, indented."""
    from ppctl.cli.layout_report import layout_report

    return json.dumps(layout_report(resolved), indent=1)


def main() -> None:
    """Console-script entry point: SIGINT and SIGTERM said in one line until the launch installs its own handlers
    (``BeforeStartSignals``, handed to the commands), and a stdout that cannot be written said in one line."""
    from ppctl.run.interrupt import BeforeStartSignals
    from ppctl.run.stdout_guard import run_guarding_stdout

    signals = BeforeStartSignals().install()
    run_guarding_stdout(lambda: app(obj=signals))


if __name__ == "__main__":
    main()
