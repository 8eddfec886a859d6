"""The training loop: one ``Trainer`` per worker, built once from the config and the parallel context.

A step is: this rank's schedule actions (the runtime walks its communication plan) ->
``finalize_gradients`` (DP/CP reduction, tied embeddings) -> global grad norm and
clipping -> ``torch.optim.AdamW`` -> the loss reduced to the rank that logs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ppctl.config import PpctlConfig, num_microbatches, padded_vocab_size
from ppctl.data.dataset import build_dataset
from ppctl.data.iterator import PipelineDataIterator
from ppctl.layout_report import config_layer_map
from ppctl.model.gpt import GPTChunk, GPTConfig
from ppctl.optim.grads import build_optimizer, clip_gradients, finalize_gradients, global_grad_norm
from ppctl.parallel.groups import ParallelContext
from ppctl.parallel.tensor_parallel import TPGroup
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.comm import initial_receives, plan_communication
from ppctl.pipeline.p2p import PipelineTransport
from ppctl.pipeline.runtime import PipelineRuntime
from ppctl.pipeline.schedules import Schedule, build_schedule
from ppctl.pipeline.trace import Tracer

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class StepResult:
    """What one step measured. ``loss`` is the global batch's mean token loss (None off the loss ranks)."""

    step: int
    loss: float | None
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    bubble_ratio_measured: float | None = None


def to_device(microbatch, device: str):
    """The microbatch with its tensors on ``device`` (unchanged on CPU)."""
    if device == "cpu":
        return microbatch
    moved = {name: (value.to(device) if isinstance(value, torch.Tensor) else value)
             for name, value in vars(microbatch).items()}
    return type(microbatch)(**moved)


def gpt_config(config: PpctlConfig) -> GPTConfig:
    """The model shape with the vocabulary padded for TP."""
    model = config.model
    return GPTConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, config.parallel.tp),
        max_seq_length=model.max_seq_length, position_embedding=model.position_embedding,
        tie_embeddings=model.tie_embeddings, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
    )


def tp_group_of(context: ParallelContext) -> TPGroup:
    """The TP group object the model layers use."""
    if context.size("tp") == 1:
        return TPGroup.single()
    return TPGroup(context.groups["tp"], context.size("tp"), context.index("tp"))


def build_chunks(config: PpctlConfig, context: ParallelContext, schedule: Schedule) -> dict[int, GPTChunk]:
    """This rank's model chunks, keyed by global stage."""
    dtype = DTYPES[config.trainer.precision]
    chunks = {}
    for (pp_rank, _chunk), stage in config_layer_map(config).items():
        if pp_rank != context.pp_rank:
            continue
        chunk = GPTChunk(gpt_config(config), stage.layers, stage.pre_process, stage.post_process,
                         tp_group_of(context), config.trainer.seed, dtype)
        chunks[stage.stage] = chunk.to(context.device)
    if sorted(chunks) != list(schedule.stages_of(context.pp_rank)):
        raise RuntimeError(f"layer map gives stages {sorted(chunks)} but the schedule places "
                           f"{schedule.stages_of(context.pp_rank)} on pp rank {context.pp_rank}")
    return chunks


def build_data(config: PpctlConfig, context: ParallelContext, schedule: Schedule) -> PipelineDataIterator:
    """The microbatch iterator: TP rank 0 reads and broadcasts; stages get what they need."""
    trainer, data = config.trainer, config.data
    dataset = build_dataset(data.source, data.path, Path(data.cache_dir), trainer.seq_length,
                            config.model.vocab_size, trainer.seed, data.tokenizer)
    stages = schedule.stages_of(context.pp_rank)
    tp_ranks = context.group_ranks["tp"]
    return PipelineDataIterator(
        dataset, trainer.seed, trainer.global_batch_size, trainer.micro_batch_size, trainer.seq_length,
        dp_rank=context.coords["dp"], dp_size=context.layout.dp,
        tp_group=context.groups["tp"] if len(tp_ranks) > 1 else None,
        tp_src_rank=tp_ranks[0], is_tp_src=context.rank == tp_ranks[0],
        needs_inputs=0 in stages, needs_labels=schedule.num_stages - 1 in stages, device=context.device,
    )


class Trainer:
    """Everything one worker needs to train: chunks, schedule plan, runtime, data, optimizer."""

    def __init__(self, config: PpctlConfig, context: ParallelContext, check: bool = True,
                 release_outputs: bool = True, track_memory: bool = False):
        self.config, self.context = config, context
        self.release_outputs, self.track_memory = release_outputs, track_memory
        parallel = config.parallel
        self.schedule = build_schedule(config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config))
        if check:
            check_schedule(self.schedule)
        self.chunks = build_chunks(config, context, self.schedule)
        self.padded_vocab_size = gpt_config(config).vocab_size
        self.data = build_data(config, context, self.schedule)
        self.optimizer = build_optimizer(self.chunks.values(), config.optimizer)
        self.tracer = Tracer(context.rank) if config.trainer.trace else None
        self.runtime = self._build_runtime()
        self.holds_loss = self.schedule.num_stages - 1 in self.schedule.stages_of(context.pp_rank)
        self.logging_rank = context.layout.rank(pp=self.schedule.rank_of(self.schedule.num_stages - 1))

    def _build_runtime(self) -> PipelineRuntime:
        trainer = self.config.trainer
        plan = plan_communication(self.schedule)
        shape = (trainer.micro_batch_size, trainer.seq_length, self.config.model.hidden_size)
        transport = PipelineTransport(self.context.pp_peer, shape, DTYPES[trainer.precision], self.context.device)
        positions = torch.arange(trainer.seq_length, device=self.context.device).expand(trainer.micro_batch_size, -1)
        return PipelineRuntime(
            plan[self.context.pp_rank], initial_receives(plan, self.context.pp_rank), self.chunks,
            self.schedule.num_stages, transport, tracer=self.tracer, default_position_ids=positions,
            release_outputs=self.release_outputs, track_memory=self.track_memory,
        )

    def parameters(self):
        """Every parameter of this rank's chunks."""
        return [param for chunk in self.chunks.values() for param in chunk.parameters()]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Global parameter name -> this rank's shard (names are layout independent)."""
        return {name: param for chunk in self.chunks.values() for name, param in chunk.named_parameters()}

    def train_step(self, step: int) -> StepResult:
        """Run one global batch through the schedule and update the parameters."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        microbatches = [to_device(mb, self.context.device) for mb in self.data.microbatches(step)]
        normalizer = self.data.global_loss_tokens(step) if self.holds_loss else 1.0
        if self.tracer is not None:
            self.tracer.start_step()
        state = self.runtime.run_step(microbatches, normalizer)
        self.last_step_state = state
        finalize_gradients(self.chunks, self.context)
        grad_norm = global_grad_norm(self.chunks, self.context)
        clip_gradients(self.chunks, grad_norm, self.config.optimizer.clip_grad)
        self.optimizer.step()
        loss = self._reduce_loss(state.loss_sum / normalizer) if self.holds_loss else None
        elapsed = time.perf_counter() - started
        tokens = self.config.trainer.global_batch_size * self.config.trainer.seq_length
        return StepResult(step, loss, grad_norm, self.optimizer.param_groups[0]["lr"], elapsed, tokens / elapsed,
                          self._measured_bubble())

    def _reduce_loss(self, local_loss: float) -> float:
        """Sum the per-DP-rank shares (each already divided by the global token count)."""
        total = torch.tensor([local_loss], dtype=torch.float64, device=self.context.device)
        if self.context.size("dp_cp") > 1:
            dist.all_reduce(total, group=self.context.groups["dp_cp"])
        return float(total.item())

    def _measured_bubble(self) -> float | None:
        """Idle time waiting for messages over compute time, averaged over the ranks (tracing only)."""
        if self.tracer is None:
            return None
        compute = self.tracer.compute_seconds()
        ratio = torch.tensor([self.tracer.wait_seconds() / compute if compute else 0.0], dtype=torch.float64,
                             device=self.context.device)
        dist.all_reduce(ratio)
        return float(ratio.item()) / dist.get_world_size()


def train(config: PpctlConfig, context: ParallelContext, run_dir: Path) -> list[StepResult]:
    """The worker's training job: build the trainer, run every step, log from the loss-owning rank."""
    from ppctl.logging import TrainingLogger

    trainer = Trainer(config, context)
    logger = TrainingLogger(config, run_dir, trainer) if context.rank == trainer.logging_rank else None
    results = []
    for step in range(config.trainer.max_steps):
        result = trainer.train_step(step)
        if trainer.tracer is not None:
            gather_trace(trainer, run_dir, step, logger)
        if logger is not None:
            logger.log(result)
        results.append(result)
    if logger is not None:
        logger.close()
    return results


def gather_trace(trainer: Trainer, run_dir: Path, step: int, logger) -> None:
    """Collect every rank's timeline of this step on the logging rank (which writes the files)."""
    gathered = [None] * dist.get_world_size() if trainer.context.rank == trainer.logging_rank else None
    dist.gather_object(trainer.tracer.snapshot(), gathered, dst=trainer.logging_rank)
    if logger is not None:
        logger.add_trace(step, gathered)
