"""Console lines, TensorBoard scalars, ``metrics.jsonl`` and trace files, written by the rank that owns the loss.

Two token counts, each named for what it counts: ``tok/s`` (``train/tokens_per_s``) counts every input token of the
global batch, what the hardware computed (a token whose label weighs zero is computed all the same); ``trained``
(``train/trained_tokens``, ``train/trained_tokens_per_s``, ``val/trained_tokens``) counts the tokens the loss
averages over (the loss weights summed: every label without a loss mask), the loss's denominator.

``metrics.jsonl`` keeps each step's loss, grad norm and learning rate, and each validation loss, as exact
floats (TensorBoard keeps float32): one JSON object a line, flushed as written (``ppctl verify`` compares two
runs by it). A run resumed in its own directory drops the lines of steps from its start on, as TensorBoard's
``purge_step`` does, so no step is there twice.

With experts, each step's routing statistics (summed over every rank by the trainer, so the logging rank has those
of the layers other pp ranks hold) go to TensorBoard as ``moe/balancing_loss`` and ``moe/z_loss`` (each layer's mean
over the global batch's microbatches, unweighted by its coefficient, summed over the MoE layers),
``moe/load_imbalance`` (the worst layer's busiest expert's tokens over the mean), and per layer
``moe/balancing_loss/layer_<id>``, ``moe/z_loss/layer_<id>`` and ``moe/load_imbalance/layer_<id>``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ppctl.config import PpctlConfig
from ppctl.resolve import to_yaml

SCALARS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "trained_tokens", "trained_tokens_per_s",
           "bubble_ratio_measured", "skipped_steps")
METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    """``<run_dir>/metrics.jsonl``: one exact record a line, the lines of steps from ``start_step`` on dropped."""

    def __init__(self, path: Path, start_step: int) -> None:
        kept = [line for line in read_metrics(path) if line["step"] < start_step] if start_step else []
        self.file = path.open("w", buffering=1)  # a line at a time: a run that dies keeps what it logged
        for record in kept:
            self.write(record)

    def write(self, record: dict) -> None:
        """Append ``record`` (floats as ``repr`` writes them, which reads back the same)."""
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Close the file."""
        self.file.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none when there is no such file)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TrainingLogger:
    """Writes ``train/*`` scalars under ``<run_dir>/tensorboard`` and prints a line every ``log_every`` steps."""

    def __init__(self, config: PpctlConfig, run_dir: Path, trainer, start_step: int = 0,
                 resumed_from: str | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.trainer = trainer
        self.writer = None
        self.last_trace: tuple[int, list[dict]] | None = None
        self.all_traces: list[tuple[int, list[dict]]] = []
        self.eta = EtaClock(start_step, config.trainer.max_steps)
        self.metrics = MetricsFile(self.run_dir / METRICS_FILE, start_step)
        if config.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Resumed in the same run directory: events of steps >= start_step (written after the
            # checkpoint, before the interruption) are dropped, so no step is logged twice.
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step or None)
            self.writer.add_text("config", "```yaml\n" + to_yaml(config) + "\n```", start_step)
        print(self._banner(), flush=True)
        print(self._numerics(), flush=True)
        if start_step:
            print(f"resumed from {resumed_from} at step {start_step}", flush=True)

    def _banner(self) -> str:
        parallel, trainer = self.config.parallel, self.config.trainer
        schedule = self.trainer.schedule
        return (f"training {self.config.model.name} with {schedule.name}: tp={parallel.tp} pp={parallel.pp} "
                f"vpp={parallel.vpp} dp={parallel.dp} cp={parallel.cp}, {schedule.num_microbatches} microbatches "
                f"of {trainer.micro_batch_size} x {trainer.seq_length} tokens per DP rank, {trainer.max_steps} steps; "
                f"vocab {self.config.model.vocab_size} padded to {self.trainer.padded_vocab_size}")

    def _numerics(self) -> str:
        """How the run computes: precision, the optimizer's layout, CP attention, sequence parallelism."""
        parallel, trainer, optimizer = self.config.parallel, self.config.trainer, self.config.optimizer
        parts = [f"precision {trainer.precision}" + (f" (loss scale {optimizer.loss_scale:g})"
                                                     if trainer.precision == "fp16" else "")]
        parts.append(self.trainer.optimizer.describe())
        if parallel.cp > 1:
            parts.append(f"context parallel attention: {parallel.cp_comm}")
        if parallel.sequence_parallel:
            parts.append("sequence parallel")
        if trainer.compile:
            cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default")
            parts.append(f"compiled blocks (torch.compile, inductor; its cache {cache})")
        return " | ".join(parts)

    def log(self, result) -> None:
        """Record one step; print it when it is the first, the last or every ``log_every``-th."""
        self.metrics.write({"step": result.step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                            "skipped": result.skipped, "trained_tokens": result.trained_tokens})
        if self.writer is not None:
            for name in SCALARS:
                value = getattr(result, name)
                if value is not None:
                    self.writer.add_scalar(f"train/{name}", value, result.step)
            if result.routing is not None:
                for name, value in routing_scalars(result.routing).items():
                    self.writer.add_scalar(name, value, result.step)
        trainer = self.config.trainer
        step = result.step + 1
        self.eta.record(step, result.step_time_s)
        if step == 1 or step == trainer.max_steps or step % trainer.log_every == 0:
            print(format_step(result, trainer.max_steps, self.eta.remaining_s(), self._input_tokens()), flush=True)
        if trainer.compile and len(self.eta.durations) == 1:
            print(f"step {step}: compilation of the blocks ended with this step ({result.step_time_s:.1f} s, its "
                  f"tokens/s included; the ETA leaves it out)", flush=True)
        if result.skipped:
            print(f"step {step}: gradient norm {result.grad_norm}: step skipped, nothing updated "
                  f"({result.skipped_steps} skipped so far)", flush=True)

    def _input_tokens(self) -> int:
        """The input tokens of one global batch (every token computed, trained or not)."""
        return self.config.trainer.global_batch_size * self.config.trainer.seq_length

    def log_validation(self, step: int, loss: float, trained_tokens: float | None = None) -> None:
        """Record the validation loss taken after step ``step`` (0-based, as ``train/*``), the mean over
        ``trained_tokens`` trained tokens of ``trainer.eval_iters`` batches, and print it."""
        perplexity = math.exp(min(loss, 700.0))  # exp overflows a float beyond ~709
        self.metrics.write({"step": step, "val_loss": loss, "val_trained_tokens": trained_tokens})
        if self.writer is not None:
            self.writer.add_scalar("val/loss", loss, step)
            self.writer.add_scalar("val/perplexity", perplexity, step)
            if trained_tokens is not None:
                self.writer.add_scalar("val/trained_tokens", trained_tokens, step)
        input_tokens = self._input_tokens() * self.config.trainer.eval_iters
        print(format_validation(step, self.config.trainer.max_steps, loss, perplexity, trained_tokens, input_tokens),
              flush=True)

    def saved(self, path: Path, step: int, reason: str) -> None:
        """Say where the checkpoint taken after ``step`` steps went."""
        print(f"step {step:>5}/{self.config.trainer.max_steps} | checkpoint saved ({reason}): {path}", flush=True)
        if self.writer is not None:
            self.writer.flush()  # every step up to a checkpoint is logged on disk: a run that dies later loses none

    def stopped(self, step: int, signal_name: str, checkpoint: Path | None) -> None:
        """Say that the run stopped early on a signal, and how to go on (when a checkpoint was saved)."""
        how = (f"resume with trainer.resume_from={self.run_dir}" if checkpoint is not None
               else "no checkpoint saved (trainer.checkpoints=false)")
        print(f"stopped by {signal_name} after step {step}; {how}", flush=True)

    def add_trace(self, step: int, snapshots: list[dict]) -> None:
        """Keep every step's gathered per-rank timeline for the trace files."""
        self.all_traces.append((step, snapshots))

    def close(self) -> None:
        """Close ``metrics.jsonl``, flush TensorBoard and write the trace files when tracing was on."""
        self.metrics.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.all_traces:
            from ppctl.pipeline.trace import write_trace_files

            write_trace_files(self.all_traces, self.trainer, self.run_dir)


def routing_scalars(routing) -> dict[str, float]:
    """The TensorBoard scalars of a step's ``RoutingStatistics`` by tag (the module docstring)."""
    scalars = {"moe/balancing_loss": routing.balancing, "moe/z_loss": routing.z,
               "moe/load_imbalance": routing.imbalance}
    for layer in routing.layers:
        scalars.update({f"moe/balancing_loss/layer_{layer.layer}": layer.balancing,
                        f"moe/z_loss/layer_{layer.layer}": layer.z,
                        f"moe/load_imbalance/layer_{layer.layer}": layer.imbalance})
    return scalars


def format_step(result, max_steps: int, eta_s: float | None = None, input_tokens: int | None = None) -> str:
    """One console line: step, loss, lr, grad norm, input tokens/s, trained tokens of the ``input_tokens`` (when both
    are known), step time (measured bubble if traced, ETA if known)."""
    line = (f"step {result.step + 1:>5}/{max_steps} | loss {result.loss:.4f} | lr {result.lr:.2e} | "
            f"grad norm {result.grad_norm:.3f} | {result.tokens_per_s:,.0f} tok/s")
    if result.trained_tokens is not None and input_tokens is not None:
        line += f" | trained {format_count(result.trained_tokens)}/{input_tokens:,} tok"
    line += f" | {result.step_time_s * 1e3:.1f} ms"
    if result.bubble_ratio_measured is not None:
        line += f" | bubble {result.bubble_ratio_measured:.2f}"
    if eta_s is not None:
        line += f" | eta {format_duration(eta_s)}"
    return line


def format_validation(step: int, max_steps: int, loss: float, perplexity: float, trained_tokens: float | None,
                      input_tokens: int) -> str:
    """The console line of a validation loss taken after step ``step`` (0-based), with its trained tokens of the
    ``input_tokens`` (when known)."""
    line = f"step {step + 1:>5}/{max_steps} | validation loss {loss:.4f} | perplexity {perplexity:.2f}"
    if trained_tokens is not None:
        line += f" | trained {format_count(trained_tokens)}/{input_tokens:,} tok"
    return line


def format_count(count: float) -> str:
    """A token count with thousands separators: whole when it is (loss weights of 0 and 1), else to 0.01."""
    return f"{count:,.0f}" if float(count).is_integer() else f"{count:,.2f}"


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class EtaClock:
    """Time left from the mean duration of the steps so far (the first step of a run, which warms up, excluded
    once others are known)."""

    def __init__(self, start_step: int, max_steps: int):
        self.max_steps = max_steps
        self.durations: list[float] = []
        self.done = start_step

    def record(self, done: int, step_time_s: float) -> None:
        """Note that step ``done`` (counted from 1) took ``step_time_s``."""
        self.done = done
        self.durations.append(step_time_s)

    def remaining_s(self) -> float | None:
        """Seconds until ``max_steps`` at the mean pace (None before any step)."""
        if not self.durations:
            return None
        steady = self.durations[1:] or self.durations
        return (self.max_steps - self.done) * sum(steady) / len(steady)
