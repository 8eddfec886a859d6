"""The ``ppctl`` command line: parse, compose the config, validate, delegate.

Every command that reads config takes Hydra overrides as trailing arguments
(``ppctl inspect-layout parallel.tp=2 parallel.pp=4``) and ``--config-dir`` /
``--config-name`` for a user's own config tree. A bad config exits with status 2
and one line on stderr, before any process starts. Heavy imports (torch) happen
inside the commands that need them, so ``inspect-layout`` starts quickly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from ppctl.config import ConfigError, PpctlConfig, compose_config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train GPT models with Megatron-style TP/PP/VPP/DP/CP parallelism and inspect layouts and schedules.",
    pretty_exceptions_enable=False,
)

OVERRIDES_HELP = "Hydra overrides: group=option or section.key=value, e.g. parallel.tp=2 schedule=gpipe"
CONFIG_DIR_OPTION = typer.Option(None, "--config-dir", help="Your own config tree (ppctl's groups stay available).")
CONFIG_NAME_OPTION = typer.Option("config", "--config-name", help="Primary config file name, without .yaml.")


def fail(message: str, code: int = 2) -> None:
    """Print one error line on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def load_config(
    overrides: Optional[List[str]],
    config_dir: Optional[Path],
    config_name: str,
    check: Callable[[PpctlConfig], object] | None = None,
) -> PpctlConfig:
    """Compose and check a config, turning every refusal into exit status 2 with one line."""
    try:
        config = compose_config(overrides or [], config_dir, config_name)
        if check is not None:
            check(config)
        return config
    except ConfigError as error:
        fail(str(error))
        raise AssertionError("unreachable")


@app.command("inspect-layout")
def inspect_layout(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (see README for the keys)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Show the rank coordinates, every process group and the layer map of a layout."""
    from ppctl.config import validate
    from ppctl.layout_report import layout_report, print_layout

    config = load_config(overrides, config_dir, config_name, validate)
    report = layout_report(config)
    if as_json:
        sys.stdout.write(json.dumps(report, separators=(",", ":")) + "\n")
    else:
        print_layout(report, config)


@app.command("inspect-schedule")
def inspect_schedule(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    cost: str = typer.Option("F=1,B=1,W=1,comm=0", "--cost",
                             help="Cost model: times of F, B, W for one microbatch through all of a rank's layers "
                                  "(of one model copy), FB for an overlapped forward-and-backward pair (DualPipe; "
                                  "unset: F+B+W), and the latency of one point-to-point message."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (see README for the keys)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the timeline picture (.svg or .html)."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Simulate the configured schedule: timeline per rank, bubble ratio and peak activations."""
    from ppctl.config import validate
    from ppctl.schedule_report import print_schedule, simulate_config

    # The schedule does not depend on how the model's layers divide into its stages.
    config = load_config(overrides, config_dir, config_name, lambda loaded: validate(loaded, layer_split=False))
    try:
        result = simulate_config(config, cost)
        if out is not None:
            from ppctl.schedule_report import write_schedule_picture

            write_schedule_picture(result, out)
    except ValueError as error:
        fail(str(error))
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    else:
        print_schedule(result, out)


@app.command("train")
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command and run directory; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Validate, create the run directory, start the torchrun workers and train."""
    from ppctl.config import check_runnable, validate

    config = load_config(overrides, config_dir, config_name, lambda c: (validate(c), check_runnable(c)))
    _launch(config, "train", dry_run)


@app.command("prepare-data")
def prepare_data(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Tokenise the configured data source into its cache (``train`` does this itself when needed)."""
    from ppctl.config import validate

    config = load_config(overrides, config_dir, config_name, validate)
    summary = _prepare(config)
    typer.echo(summary or f"data.source={config.data.source} needs no preparation")


def _prepare(config: PpctlConfig) -> str | None:
    """Prepare the token cache of a file-backed source; one line summary, or None for synthetic data."""
    if config.data.source == "synthetic":
        return None
    from ppctl.data.prepare import prepare_tokens, read_sidecar

    try:
        token_file = prepare_tokens(config.data.source, config.data.path, Path(config.data.cache_dir),
                                    config.data.tokenizer)
    except (OSError, ValueError) as error:
        fail(f"data.source={config.data.source}: {error}")
    sidecar = read_sidecar(token_file)
    return f"{token_file}: {sidecar['num_tokens']:,} tokens from {sidecar['num_files']} file(s)"


@app.command("check-cluster")
def check_cluster(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun command; start nothing."),
    config_dir: Optional[Path] = CONFIG_DIR_OPTION,
    config_name: str = CONFIG_NAME_OPTION,
) -> None:
    """Start the workers as training would, prove every group, measure links, print one table."""
    from ppctl.config import validate

    config = load_config(overrides, config_dir, config_name, validate)
    _launch(config, "check-cluster", dry_run)


def _launch(config: PpctlConfig, task: str, dry_run: bool) -> None:
    from ppctl.config import nproc_per_node
    from ppctl.launch import build_launch_plan, default_run_dir, resolve_backend, run_plan

    run_dir = Path(config.trainer.out_dir) if config.trainer.out_dir else default_run_dir()
    config.trainer.out_dir = str(run_dir)
    backend = resolve_backend(config.launcher.backend, nproc_per_node(config))
    plan = build_launch_plan(config, run_dir, task, backend)
    if dry_run:
        typer.echo(f"run directory: {run_dir}")
        typer.echo(plan.printable())
        return
    if task == "train":
        _prepare(config)  # once, here, before any worker starts
    write_run_dir(config, run_dir)
    typer.echo(f"run directory: {run_dir}  ({task}, {backend}, {config.launcher.nnodes} node(s))", err=True)
    result = run_plan(plan)
    if result.failure:
        fail(result.failure, code=1)


def write_run_dir(config: PpctlConfig, run_dir: Path) -> None:
    """Create the run directory with the resolved ``config.yaml`` and ``layout.json``."""
    from ppctl.config import to_yaml
    from ppctl.layout_report import layout_report

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    (run_dir / "layout.json").write_text(json.dumps(layout_report(config), indent=1))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
