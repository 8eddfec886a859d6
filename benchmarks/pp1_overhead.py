"""Overhead of ppctl's runtime at pp=1 against a plain PyTorch loop on the same work.

Both sides train the same GPT on the same synthetic global batches, cut into the same
microbatches (gradient accumulation), with the same AdamW and clipping. They run
alternately in one process (ppctl joins a one-rank gloo group), several repeats each;
the table shows the median tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ppctl.config import compose_config, layout_of, validate  # noqa: E402
from ppctl.data.dataset import build_dataset, step_microbatches  # noqa: E402
from ppctl.data.prepare import CorpusSpec  # noqa: E402
from ppctl.optim.grads import build_optimizer  # noqa: E402
from ppctl.parallel.groups import build_parallel_context  # noqa: E402
from ppctl.run.reference import reference_model  # noqa: E402
from ppctl.run.train import Trainer  # noqa: E402
from tests.spawn import free_port  # noqa: E402


def plain_loop_seconds(config, steps: int, warmup: int) -> float:
    """Seconds per step of a plain loop: microbatch forward/backward, clip, AdamW."""
    trainer = config.trainer
    model = reference_model(config)
    optimizer = build_optimizer([model], config.optimizer)
    dataset = build_dataset(CorpusSpec("synthetic"), trainer.seq_length, config.model.vocab_size, trainer.seed)
    tokens = trainer.global_batch_size * trainer.seq_length
    durations = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        for microbatch in step_microbatches(dataset, trainer.seed, step, trainer.global_batch_size,
                                            trainer.micro_batch_size, 0, 1):
            losses = model(microbatch.tokens, position_ids=microbatch.position_ids, labels=microbatch.labels)
            ((losses * microbatch.loss_mask).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        optimizer.step()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations[warmup:])


def ppctl_seconds(config, context, steps: int, warmup: int) -> float:
    """Seconds per step of ppctl's ``Trainer.train_step`` (schedule runtime + gradient path)."""
    trainer = Trainer(config, context)
    durations = [trainer.train_step(step).step_time_s for step in range(warmup + steps)]
    return statistics.median(durations[warmup:])


def main() -> None:
    """Parse options, run both sides alternately, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", default=[
        "model.num_layers=4", "model.hidden_size=256", "model.num_heads=8", "model.ffn_hidden_size=1024",
        "trainer.seq_length=128", "trainer.global_batch_size=16", "trainer.micro_batch_size=4"])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    config = compose_config(["parallel=single", "data=synthetic", "trainer.tensorboard=false", *args.overrides])
    validate(config)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    context = build_parallel_context(layout_of(config), 60)
    tokens = config.trainer.global_batch_size * config.trainer.seq_length
    plain, ours = [], []
    for _ in range(args.repeats):
        plain.append(tokens / plain_loop_seconds(config, args.steps, args.warmup))
        ours.append(tokens / ppctl_seconds(config, context, args.steps, args.warmup))
    dist.destroy_process_group()
    print_table(config, args, plain, ours)


def print_table(config, args, plain: list[float], ours: list[float]) -> None:
    """Medians, spreads and the ratio."""
    from rich.console import Console
    from rich.table import Table

    model, trainer = config.model, config.trainer
    table = Table(title=f"pp=1 overhead: {model.num_layers} layers x {model.hidden_size}, "
                        f"batch {trainer.global_batch_size} x {trainer.seq_length} tokens in microbatches of "
                        f"{trainer.micro_batch_size}; {args.repeats} repeats x {args.steps} steps, "
                        f"{torch.get_num_threads()} threads")
    for column in ("loop", "median tokens/s", "min", "max"):
        table.add_column(column)
    for name, values in (("plain PyTorch", plain), ("ppctl runtime", ours)):
        table.add_row(name, f"{statistics.median(values):,.0f}", f"{min(values):,.0f}", f"{max(values):,.0f}")
    Console().print(table)
    print(f"ratio ppctl / plain (median tokens/s): {statistics.median(ours) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
