"""Console lines, TensorBoard scalars and trace files, written by the rank that owns the loss."""

from __future__ import annotations

from pathlib import Path

from ppctl.config import PpctlConfig, to_yaml

SCALARS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "bubble_ratio_measured", "skipped_steps")


class TrainingLogger:
    """Writes ``train/*`` scalars under ``<run_dir>/tensorboard`` and prints a line every ``log_every`` steps."""

    def __init__(self, config: PpctlConfig, run_dir: Path, trainer):
        self.config = config
        self.run_dir = Path(run_dir)
        self.trainer = trainer
        self.writer = None
        self.last_trace: tuple[int, list[dict]] | None = None
        self.all_traces: list[tuple[int, list[dict]]] = []
        if config.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            self.writer.add_text("config", "```yaml\n" + to_yaml(config) + "\n```", 0)
        print(self._banner(), flush=True)
        print(self._numerics(), flush=True)

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
        return " | ".join(parts)

    def log(self, result) -> None:
        """Record one step; print it when it is the first, the last or every ``log_every``-th."""
        if self.writer is not None:
            for name in SCALARS:
                value = getattr(result, name)
                if value is not None:
                    self.writer.add_scalar(f"train/{name}", value, result.step)
        trainer = self.config.trainer
        step = result.step + 1
        if step == 1 or step == trainer.max_steps or step % trainer.log_every == 0:
            print(format_step(result, trainer.max_steps), flush=True)
        if result.skipped:
            print(f"step {step}: gradient norm {result.grad_norm}: step skipped, nothing updated "
                  f"({result.skipped_steps} skipped so far)", flush=True)

    def add_trace(self, step: int, snapshots: list[dict]) -> None:
        """Keep every step's gathered per-rank timeline for the trace files."""
        self.all_traces.append((step, snapshots))

    def close(self) -> None:
        """Flush TensorBoard and write the trace files when tracing was on."""
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.all_traces:
            from ppctl.pipeline.trace import write_trace_files

            write_trace_files(self.all_traces, self.trainer, self.run_dir)


def format_step(result, max_steps: int) -> str:
    """One console line: step, loss, lr, grad norm, tokens/s, step time (and measured bubble if traced)."""
    line = (f"step {result.step + 1:>5}/{max_steps} | loss {result.loss:.4f} | lr {result.lr:.2e} | "
            f"grad norm {result.grad_norm:.3f} | {result.tokens_per_s:,.0f} tok/s | {result.step_time_s * 1e3:.1f} ms")
    if result.bubble_ratio_measured is not None:
        line += f" | bubble {result.bubble_ratio_measured:.2f}"
    return line
