"""``ppctl plan``: the layouts that fit, ranked by predicted step time (pure: no torch, no process).

For a model and global batch on N devices the planner enumerates the layouts (tp, cp, pp,
vpp, dp, schedule, micro-batch size, and for a mixture of experts ep at etp=1), each with its
memory-saving variants in the order they are tried (the distributed optimizer, free in time;
then selective and full recomputation), and:

1. orders the layouts by a lower bound on their step time that needs no validation
   (``compute_bound_s``: every rank's mean compute and collectives after the fill, plus the reduction);
2. in that order, skips a layout whose makespan floor (``_floor_ms``, from the placement alone) or schedule
   bound (``schedule_bound_s``) cannot beat the K-th best, else predicts its variants' memory per rank
   (``ppctl.plan.memory``) and step time (the simulator on the costs of ``step_costs``, skipped where
   ``step_lower_bound_s`` already exceeds the K-th best), validated as ``train`` validates them but for the
   schedule checker, and keeps the first variant that fits and beats the K-th best;
3. stops once the next bound cannot beat the K-th best, counting what it left and why;
4. proves the schedules of the list with the checker, and searches again with any it refuses refused.

The cost model (``StepCosts``) follows Megatron-LM's FLOP count (``ppctl.model.flops``): a
backward is twice a forward (B and W one forward each), full recomputation adds a forward
to B, selective the attention core's share; TP and CP collectives, pipeline messages and
the data-parallel reduction come from the device's links. Expert parallelism trades memory (each
rank holds ``num_experts / ep`` experts) for the experts' all-to-alls: two in the forward and two
in the backward per MoE layer and microbatch, each moving the ``(ep - 1) / ep`` of the routed rows
that leave the rank; the experts' gradients reduce over their edp ranks. ``--calibrate RUN_DIR`` replaces
the device's figures with those a measured run achieved (``calibrated_device``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple

from ppctl.config import ConfigError, PpctlConfig, num_microbatches
from ppctl.resolve.resolved import ResolvedConfig, resolve
from ppctl.model.family import resolve_model
from ppctl.model.flops import forward_flops_per_token
from ppctl.parallel.layout import parse_order
from ppctl.pipeline.replay import gc_paused
from ppctl.pipeline.schedules import ScheduleError
from ppctl.plan.balance import model_part_costs
from ppctl.plan.memory import (DTYPE_BYTES, Chunk, MemoryParts, chunk_parameters, config_memory,
                               expert_layer_parameters, rank_chunks, schedule_states)

# (schedule, its vpp) tried for each pp; gpipe and 1f1b at vpp 1, the looped and V schedules at 2
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4, 8)
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Device:
    """What the planner assumes of one device and its links (``--device``)."""

    name: str
    flops: float  # FLOP/s a training step sustains (dense bf16 peak times a typical utilisation)
    memory_gb: float
    node_size: int  # devices per node: TP and CP stay within one
    intra_node_bandwidth: float  # bytes/s per direction (NVLink)
    inter_node_bandwidth: float  # bytes/s per device (InfiniBand)
    latency_s: float
    overhead_s: float = 0.0  # a runtime's time per action beyond its compute (measured: --calibrate)
    # Seconds of the step's update (clipping and AdamW) per parameter a rank steps: bound by memory traffic
    # (``ADAMW_BYTES_PER_PARAMETER``), or measured (--calibrate)
    update_s_per_parameter: float = 0.0
    collective_latency_s: float | None = None  # per step of a ring collective; None: latency_s
    # Per TP or CP collective: the wait for its slowest member after the ranks' own compute (measured:
    # --calibrate; 0 for the GPU classes, whose kernels drift apart by microseconds)
    collective_wait_s: float = 0.0
    # The cores all the planned devices' processes share (a CPU machine that ran more single-threaded workers than it
    # has cores: --calibrate from such a run); None: a device each, as on GPUs
    cores: int | None = None
    reserve_gb: float = 2.0  # what no tensor holds: ``ppctl.plan.budget.MemoryBudget``

    def describe(self) -> str:
        """One line: the name and the figures the plan assumes."""
        return (f"{self.name}: {self.flops / 1e12:.3g} TFLOP/s sustained, links {self.intra_node_bandwidth / 1e9:.3g} "
                f"GB/s in a node of {self.node_size} and {self.inter_node_bandwidth / 1e9:.3g} GB/s between, "
                f"{self.latency_s * 1e6:.3g} us per message, {self.overhead_s * 1e3:.3g} ms per action, "
                f"{self.update_s_per_parameter * 1e9:.3g} ms per million parameters updated, "
                f"{self.ring_step_s * 1e6:.3g} us per ring step and {self.collective_wait_s * 1e6:.3g} us waited per "
                "TP or CP collective" + (f", the devices sharing {self.cores} cores" if self.cores else ""))

    @property
    def ring_step_s(self) -> float:
        """The latency of one step of a ring collective (an all-reduce of n ranks takes 2(n - 1))."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s


# AdamW moves about this many bytes per fp32 parameter (parameter, gradient and two moments read, three written).
ADAMW_BYTES_PER_PARAMETER = 32
# Sustained FLOP/s: 45% of the dense bf16 peak, Megatron-LM's reported range for GPT models of this size; the
# update at the memory bandwidth (3.35, 4.8 and 2.0 TB/s).
DEVICES = {
    "h100": Device("h100", 0.45 * 989e12, 80, 8, 450e9, 50e9, 10e-6,
                   update_s_per_parameter=ADAMW_BYTES_PER_PARAMETER / 3.35e12),
    "h200": Device("h200", 0.45 * 989e12, 141, 8, 450e9, 50e9, 10e-6,
                   update_s_per_parameter=ADAMW_BYTES_PER_PARAMETER / 4.8e12),
    "a100": Device("a100", 0.45 * 312e12, 80, 8, 300e9, 25e9, 10e-6,
                   update_s_per_parameter=ADAMW_BYTES_PER_PARAMETER / 2.0e12),
}


@dataclass(frozen=True)
class Candidate:
    """One layout to try: the settings it adds to the user's config."""

    tp: int
    cp: int
    pp: int
    vpp: int
    dp: int
    schedule: str
    micro_batch_size: int
    recompute: str
    distributed_optimizer: bool
    balance: str = "even"  # auto where the layers do not divide evenly into the stages
    ep: int | None = None  # a mixture of experts' expert parallelism (etp is 1); None for a dense model

    def overrides(self) -> list[str]:
        """The overrides to paste into ``ppctl train``."""
        balance = ["parallel.balance=auto"] if self.balance == "auto" else []
        ep = [f"parallel.ep={self.ep}"] if self.ep is not None else []
        ep += ["parallel.sequence_parallel=true"] if self.experts_need_sequence_parallel else []
        return [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}",
                f"parallel.vpp={self.vpp}", f"parallel.dp={self.dp}", *ep, *balance, f"schedule={self.schedule}",
                f"trainer.micro_batch_size={self.micro_batch_size}", f"model.recompute={self.recompute}",
                f"optimizer.distributed={str(self.distributed_optimizer).lower()}"]

    @property
    def experts_need_sequence_parallel(self) -> bool:
        """A mixture at tp > 1 runs with sequence parallelism (validation asks for it: each TP rank routes its own
        tokens)."""
        return self.ep is not None and self.tp > 1

    @property
    def layout_key(self) -> tuple:
        """What the step time depends on beyond the memory savers (recomputation, the distributed optimizer)."""
        return self.tp, self.cp, self.pp, self.vpp, self.dp, self.schedule, self.micro_batch_size, self.ep

    def apply(self, base: PpctlConfig) -> PpctlConfig:
        """``base`` with this candidate's settings (the sections it changes copied, the rest shared)."""
        parallel = replace(base.parallel, tp=self.tp, cp=self.cp, pp=self.pp, vpp=self.vpp, dp=self.dp,
                           sequence_parallel=(base.parallel.sequence_parallel and self.tp > 1)
                           or self.experts_need_sequence_parallel)
        if self.ep is not None:
            parallel = replace(parallel, ep=self.ep, etp=1)
        if self.balance == "auto":
            parallel = replace(parallel, balance="auto", pipeline_layout=None, account_for_embedding_in_split=False,
                               account_for_loss_in_split=False)
        return replace(base, parallel=parallel, schedule=replace(base.schedule, name=self.schedule),
                       trainer=replace(base.trainer, micro_batch_size=self.micro_batch_size),
                       model=replace(base.model, recompute=self.recompute),
                       optimizer=replace(base.optimizer, distributed=self.distributed_optimizer))


@dataclass(frozen=True)
class Prediction:
    """A candidate the planner kept: its predicted step time, bubble and memory."""

    candidate: Candidate
    step_time_s: float
    bubble_ratio: float
    memory: tuple[MemoryParts, ...]

    @property
    def peak_memory_bytes(self) -> int:
        """The largest rank's predicted total."""
        return max(parts.total for parts in self.memory)

    def to_json(self) -> dict:
        """One entry of ``candidates`` in ``ppctl plan --json``."""
        return {"overrides": self.candidate.overrides(), "step_time_s": self.step_time_s,
                "bubble_ratio": self.bubble_ratio, "peak_memory_bytes": self.peak_memory_bytes,
                "memory": [parts.to_json() for parts in self.memory]}


@dataclass
class Plan:
    """The best candidates, and how many others were refused, by reason."""

    candidates: list[Prediction]
    refused: Counter = field(default_factory=Counter)

    def to_json(self) -> dict:
        """``ppctl plan --json``: ``candidates`` (best first) and ``refused`` (reason -> count)."""
        return {"candidates": [prediction.to_json() for prediction in self.candidates],
                "refused": dict(self.refused.most_common())}


# --- the search space -------------------------------------------------------------------------

# The most devices ``ppctl plan`` searches for: a stated bound, at which the search takes about a second
MAX_DEVICES = 2 ** 20


def parse_devices(text: str) -> int:
    """``--gpus``'s value as a count of devices from 1 to ``MAX_DEVICES``; ValueError (one line) naming the rule."""
    right = f"give --gpus a whole number from 1 to {MAX_DEVICES:,} (2**20)"
    try:
        devices = int(text)
    except ValueError:
        raise ValueError(f"--gpus {text}: not a whole number of devices; {right}") from None
    if devices < 1:
        raise ValueError(f"--gpus {text}: a plan needs at least 1 device; {right}")
    if devices > MAX_DEVICES:
        raise ValueError(f"--gpus {text}: more devices than ppctl plan searches; {right}")
    return devices


def candidates(config: PpctlConfig, devices: int) -> list[list[Candidate]]:
    """Every layout whose sizes multiply to ``devices``, each as its variants in the order the search tries them:
    the memory savers that cost no time first (the distributed optimizer where there are replicas), then
    selective and full recomputation."""
    return search_space(config, devices)[0]


def search_space(config: PpctlConfig, devices: int) -> tuple[list[list[Candidate]], Counter]:
    """``candidates``, and the variants of the layouts of ``devices`` left out before validation (a tp that does
    not divide the heads, a dp that does not divide the batch, stages that outnumber the layers), counted by
    reason: so a search that finds nothing says why of every layout. A mixture of experts' layouts each come at
    every ``expert_parallel_sizes``."""
    found, left_out = [], Counter()
    for tp, cp in itertools.product(POWERS_OF_TWO, repeat=2):
        if devices % (tp * cp):
            continue
        for pp, (schedule, vpp), micro in itertools.product(_divisors(devices // (tp * cp)), SCHEDULES,
                                                            MICRO_BATCH_SIZES):
            dp = devices // (tp * cp * pp)
            vpp = vpp if pp > 1 else 1
            if pp == 1 and schedule != "1f1b":  # at pp=1 every schedule is 1f1b's
                continue
            sharded = (True, False) if dp * cp > 1 else (False,)
            ep_sizes = expert_parallel_sizes(config, tp * cp * dp)
            reason = _left_out_because(config, tp, pp * vpp, micro * dp)
            if reason is not None:
                left_out[reason] += len(RECOMPUTE) * len(sharded) * len(ep_sizes)
                continue
            balance = "even" if config.model.num_layers % (pp * vpp) == 0 else "auto"
            found += [[Candidate(tp, cp, pp, vpp, dp, schedule, micro, recompute, distributed, balance, ep)
                       for recompute, distributed in itertools.product(RECOMPUTE, sharded)] for ep in ep_sizes]
    return found, left_out


def expert_parallel_sizes(config: PpctlConfig, stage_ranks: int) -> list[int | None]:
    """The ep sizes a layout of ``stage_ranks`` ranks per pipeline stage is tried at: for a mixture of experts the
    divisors of ``stage_ranks`` that divide its experts (at etp=1), where ``parallel.order`` ends in pp (the fold of
    each stage's ranks needs them consecutive; else ep=1 alone); ``[None]`` for a dense model (no ep to set)."""
    moe = resolve_model(config).moe
    if moe is None:
        return [None]
    if parse_order(config.parallel.order)[-1] != "pp":
        return [1]
    return [ep for ep in _divisors(stage_ranks) if moe.num_experts % ep == 0]


def _left_out_because(config: PpctlConfig, tp: int, stages: int, replica_sequences: int) -> str | None:
    """Why a layout is left out before validation (its tp, its pp * vpp stages, and the sequences one microbatch
    takes over its dp replicas), or None."""
    model, trainer = config.model, config.trainer
    if model.num_heads % tp:
        return f"tp does not divide model.num_heads={model.num_heads}"
    if trainer.global_batch_size % replica_sequences:
        return f"dp x the micro-batch size does not divide trainer.global_batch_size={trainer.global_batch_size}"
    if stages > model.num_layers:  # a stage without a layer only adds a hop
        return f"pp x vpp outnumbers model.num_layers={model.num_layers} (a stage would hold no layer)"
    return None


def _divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending, found up to its square root."""
    small = [divisor for divisor in range(1, math.isqrt(number) + 1) if number % divisor == 0]
    return small + [number // divisor for divisor in reversed(small) if divisor * divisor != number]


# --- the cost model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepCosts:
    """One candidate's costs in seconds: F, B, W of one microbatch through the busiest rank's layers (of one model
    copy), a pipeline message, and the data-parallel gradient reduction after the pipeline drains."""

    F: float
    B: float
    W: float
    comm: float
    reduction: float
    microbatches: int
    # The parts of F, B and W that wait on no core (the TP and CP collectives, the runtime's time between actions),
    # and where the world's processes outnumber the device's cores, (cores, processes per pipeline rank): then the
    # rest is compute that the computing processes share the cores for (``ppctl.pipeline.shared_cores``)
    waits: tuple[float, float, float] = (0.0, 0.0, 0.0)
    sharing: tuple[int, int] | None = None


def step_costs(resolved: ResolvedConfig, device: Device) -> StepCosts:
    """The cost model of a resolved config on ``device`` (see the module docstring)."""
    config = resolved.config
    model, parallel, trainer = config.model, config.parallel, config.trainer
    tokens = _microbatch_tokens(config)
    attention_core = 4 * trainer.seq_length * model.hidden_size  # scores and weighted values, per token
    layers = max(_rank_layers(resolved)) / resolved.layout.placement.copies  # the busiest rank's, of one copy
    forward = forward_flops_per_microbatch(resolved) / device.flops
    element = DTYPE_BYTES[trainer.precision]
    collective = _tp_cp_seconds(config, device, tokens, element) * layers
    if parallel.ep > 1:  # the experts' exchanges, on the rank with the most MoE layers
        moe_layers = max(_rank_layers(resolved, moe_only=True)) / resolved.layout.placement.copies
        collective += _all_to_all_seconds(resolved, device, tokens, element) * moe_layers
    # full recomputation runs the layers' forward again, their TP and CP collectives included
    recompute = {"none": 0.0, "full": forward + collective,
                 "selective": tokens * layers * attention_core / parallel.tp / device.flops}
    # the runtime's time per action, charged to each of the rank's actions of a microbatch (one per chunk)
    overhead = device.overhead_s * _chunks_per_copy(resolved)
    backward_collectives = collective * (2 if model.recompute == "full" else 1)  # full: the forward's again
    return StepCosts(F=forward + collective + overhead, B=forward + collective + recompute[model.recompute] + overhead,
                     W=forward + overhead, comm=message_s(config, device),
                     reduction=after_pipeline_s(resolved, device), microbatches=resolved.sizes.num_microbatches,
                     waits=(collective + overhead, backward_collectives + overhead, overhead),
                     sharing=_sharing(config, device))


def _sharing(config: PpctlConfig, device: Device) -> tuple[int, int] | None:
    """(cores, processes per pipeline rank) where the config's processes outnumber the cores they share, else
    None. A pipeline rank's TP, CP and DP replicas compute alike, so each stands for tp * cp * dp processes."""
    parallel = config.parallel
    replicas = parallel.tp * parallel.cp * parallel.dp
    if device.cores is None or replicas * parallel.pp <= device.cores:
        return None
    return device.cores, replicas


def message_s(config: PpctlConfig, device: Device) -> float:
    """One pipeline message (an activation or its gradient) between neighbours: in the node or between nodes."""
    parallel = config.parallel
    message = DTYPE_BYTES[config.trainer.precision] * _microbatch_tokens(config) * config.model.hidden_size
    message /= parallel.tp if parallel.sequence_parallel else 1
    pipeline_apart = parallel.tp * parallel.cp * parallel.dp  # order tp-cp-dp-pp: pipeline neighbours this far apart
    bandwidth = device.intra_node_bandwidth if pipeline_apart < device.node_size else device.inter_node_bandwidth
    return message / bandwidth + device.latency_s


def forward_flops_per_microbatch(resolved: ResolvedConfig) -> float:
    """FLOPs of one microbatch's forward through the busiest rank's layers (of one model copy) on one device."""
    config = resolved.config
    model, parallel = config.model, config.parallel
    layer = model_part_costs(resolved.model, config.trainer.seq_length).layer  # with experts, the mean layer's
    layers = max(_rank_layers(resolved)) / resolved.layout.placement.copies
    output = 2 * model.hidden_size * resolved.model.padded_vocab_size
    return _microbatch_tokens(config) * (layers * layer + output) / parallel.tp


def _chunks_per_copy(resolved: ResolvedConfig) -> int:
    """A rank's chunks of one model copy: its actions per microbatch (from the placement, without building the
    schedule)."""
    return max(resolved.layout.placement.stages_per_copy // resolved.layout.pp, 1)


def _microbatch_tokens(config: PpctlConfig) -> int:
    """One rank's tokens of one microbatch (its share of the sequence under CP)."""
    return config.trainer.micro_batch_size * config.trainer.seq_length // config.parallel.cp


def reduction_s(resolved: ResolvedConfig, device: Device) -> float:
    """The data-parallel gradient reduction after the pipeline drains: a ring all-reduce (or reduce-scatter and
    all-gather, the same bytes) of a rank's fp32 gradients over its dp * cp replicas."""
    config = resolved.config
    parallel = config.parallel
    replicas = parallel.dp * parallel.cp
    if replicas == 1:
        return 0.0
    shape = resolved.model.memory_shape
    moe_layers = len(shape.moe.layer_ids(config.model.num_layers)) if shape.moe is not None else 0
    whole = chunk_parameters(shape, Chunk(0, config.model.num_layers, True, True, moe_layers), parallel.tp,
                             parallel.ep)
    within_node = parallel.tp * replicas <= device.node_size
    bandwidth = device.intra_node_bandwidth if within_node else device.inter_node_bandwidth
    if parallel.ep == 1:
        return 2 * (replicas - 1) * (4 * whole / parallel.pp / replicas / bandwidth + device.ring_step_s)
    # expert parallelism: a rank's experts reduce over their edp ranks, the rest over the replicas
    experts, edp = moe_layers * expert_layer_parameters(shape, parallel.ep), replicas * parallel.tp // parallel.ep
    return sum(2 * (ranks - 1) * (4 * count / parallel.pp / ranks / bandwidth + device.ring_step_s)
               for count, ranks in ((whole - experts, replicas), (experts, edp)) if ranks > 1)


def update_s(resolved: ResolvedConfig, device: Device) -> float:
    """The step's update after the reduction (clipping and AdamW) on the rank with the most parameters: each rank
    steps its own (the distributed optimizer: its 1 / (dp * cp) shard of them)."""
    config, layout = resolved.config, resolved.layout
    shape, parallel = resolved.model.memory_shape, config.parallel
    if not config.optimizer.distributed or layout.ep == 1:
        stepped = max(sum(chunk_parameters(shape, chunk, parallel.tp, layout.ep) for chunk in chunks)
                      for chunks in rank_chunks(resolved))
        if config.optimizer.distributed:  # sharded over the replicas (with DualPipe's two copies, over both)
            stepped /= parallel.dp * parallel.cp * layout.placement.copies
        return stepped * device.update_s_per_parameter
    # expert parallelism, sharded: the experts over their edp ranks, the rest over the replicas (times the copies)
    stepped = 0.0
    for chunks in rank_chunks(resolved):
        experts = sum(chunk.moe_layers for chunk in chunks) * expert_layer_parameters(shape, layout.ep)
        dense = sum(chunk_parameters(shape, chunk, parallel.tp, layout.ep) for chunk in chunks) - experts
        stepped = max(stepped, (dense / (parallel.dp * parallel.cp) + experts / layout.edp) / layout.placement.copies)
    return stepped * device.update_s_per_parameter


def after_pipeline_s(resolved: ResolvedConfig, device: Device) -> float:
    """What a step does once the pipeline has drained: the gradient reduction, then the update."""
    return reduction_s(resolved, device) + update_s(resolved, device)


def compute_bound_s(resolved: ResolvedConfig, device: Device) -> float:
    """A step time that neither the schedule nor the split of a config (resolved, not yet validated) can beat: every rank's
    mean compute for the step (all microbatches through the whole model, shared by tp * pp devices) and the TP and
    CP collectives of its mean share of the layers in the forward and the backward, after its wait for the first
    microbatch to reach it (the fill), then the data-parallel reduction."""
    config = resolved.config
    forward_s, microbatches = _mean_forward_s(resolved, device), resolved.sizes.num_microbatches
    tokens, element = _microbatch_tokens(config), DTYPE_BYTES[config.trainer.precision]
    collectives = _tp_cp_seconds(config, device, tokens, element) * config.model.num_layers / config.parallel.pp
    if config.parallel.ep > 1:  # the experts' exchanges of the mean rank's MoE layers
        moe_layers = len(resolved.model.moe.layer_ids(config.model.num_layers)) / config.parallel.pp
        collectives += _all_to_all_seconds(resolved, device, tokens, element) * moe_layers
    return (3 * microbatches * forward_s + 2 * microbatches * collectives
            + _fill_stages(resolved) * forward_s + after_pipeline_s(resolved, device))


def _mean_forward_s(resolved: ResolvedConfig, device: Device) -> float:
    """One microbatch's forward through the whole model, shared by tp * pp devices: the least a rank's can take."""
    config = resolved.config
    model, parallel = config.model, config.parallel
    shape = resolved.model.memory_shape
    moe_layers = len(shape.moe.layer_ids(model.num_layers)) if shape.moe is not None else 0
    forward = forward_flops_per_token(model.num_layers, model.hidden_size, model.ffn_hidden_size,
                                      config.trainer.seq_length, shape.padded_vocab, shape.attention_width,
                                      shape.kv_width, shape.gated_mlp, shape.moe, moe_layers)
    return _microbatch_tokens(config) * forward / (parallel.tp * parallel.pp) / device.flops


def _schedule_key(config: PpctlConfig) -> tuple:
    """What the schedule checker's verdict depends on: the schedule, pp, vpp and the microbatches."""
    parallel = config.parallel
    return config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config)


COMM_RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # message time / forward time, simulated once each


def schedule_bound_s(resolved: ResolvedConfig, device: Device) -> float:
    """A tighter bound than ``compute_bound_s``, at the price of a few simulations per schedule and size (kept):
    the schedule's makespan with every F, B and W at the mean compute of a rank's forward, and messages at the
    largest of ``COMM_RATIOS`` of that below the candidate's message time (the simulated makespan only grows with
    each cost, and scales with all of them together)."""
    config = resolved.config
    forward_s = _mean_forward_s(resolved, device)
    ratio = max(r for r in COMM_RATIOS if r * forward_s <= message_s(config, device))
    unit_makespan, _ = _simulated(_schedule_key(config), 1.0, 1.0, 1.0, ratio)
    return unit_makespan * forward_s + after_pipeline_s(resolved, device)


def _fill_stages(resolved: ResolvedConfig) -> float:
    """The most rank-forwards any rank must wait before its first action: the stages in front of its earliest
    stage, each a ``1 / chunks_per_copy`` share of a rank's forward."""
    placement = resolved.layout.placement
    per_copy = placement.stages_per_copy
    return max(min(stage % per_copy for stage in placement.stages_of(pp_rank))
               for pp_rank in range(resolved.layout.pp)) / _chunks_per_copy(resolved)


def _rank_layers(resolved: ResolvedConfig, moe_only: bool = False) -> list[int]:
    """Transformer layers per pp rank (``moe_only``: its MoE layers)."""
    moe = resolved.model.moe
    counts = [0] * resolved.layout.pp
    for (pp_rank, _), stage in resolved.layer_map.items():
        counts[pp_rank] += sum(map(moe.is_moe_layer, stage.layers)) if moe_only else len(stage.layers)
    return counts


def _all_to_all_seconds(resolved: ResolvedConfig, device: Device, tokens: int, element: int) -> float:
    """Per MoE layer and microbatch, one way (forward, or backward): the exchange's two all-to-alls over the ep
    ranks (dispatch, combine), each sending the ``(ep - 1) / ep`` of a rank's routed rows that leave it (dropless:
    tokens x topk; with a capacity, at most the experts' capacity), a latency per peer; in a node where the ep
    group's consecutive ranks fit one, and each waits ``collective_wait_s`` for its slowest member."""
    config, moe = resolved.config, resolved.model.moe
    ep = config.parallel.ep
    tokens //= config.parallel.tp  # with experts, TP runs sequence-parallel: each TP rank routes seq / tp tokens
    capacity = moe.capacity(tokens)
    rows = tokens * moe.topk if capacity is None else min(tokens * moe.topk, moe.num_experts * capacity)
    bandwidth = device.intra_node_bandwidth if device.node_size % ep == 0 else device.inter_node_bandwidth
    sent = rows * config.model.hidden_size * element * (ep - 1) / ep
    return 2 * (sent / bandwidth + (ep - 1) * device.ring_step_s + device.collective_wait_s)


def _tp_cp_seconds(config: PpctlConfig, device: Device, tokens: int, element: int) -> float:
    """Per layer and microbatch: TP's two ring all-reduces (or SP's all-gathers and reduce-scatters: the same
    bytes) of the activations, and all-gather CP's keys and values, within a node; each collective also waits
    ``collective_wait_s`` for its slowest member."""
    parallel, hidden = config.parallel, config.model.hidden_size
    tp, cp = parallel.tp, parallel.cp
    seconds = 0.0
    if tp > 1:  # each all-reduce: 2(tp - 1) ring steps
        seconds += 2 * (2 * (tp - 1) / tp * element * tokens * hidden / device.intra_node_bandwidth
                        + 2 * (tp - 1) * device.ring_step_s + device.collective_wait_s)
    if cp > 1:
        seconds += (cp - 1) * (2 * element * tokens * hidden / tp / device.intra_node_bandwidth + device.ring_step_s)
        seconds += device.collective_wait_s
    return seconds


class _Built(NamedTuple):
    """A built schedule and what the memory model reads of it: each rank's ``RankStates`` (``schedule_states``)."""

    schedule: object  # a Schedule
    states: list


@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, vpp: int, microbatches: int) -> _Built:
    """A built schedule (``kept_schedule``, which validation's checker shares) and what the search reads of it,
    kept: thousands of candidates share a few."""
    from ppctl.pipeline.kept import kept_schedule

    schedule = kept_schedule(name, pp, vpp, microbatches)
    return _Built(schedule, schedule_states(schedule))


def _schedule_of(config: PpctlConfig) -> _Built:
    """``_schedule`` of a validated config."""
    return _schedule(*_schedule_key(config))


def simulated_step(resolved: ResolvedConfig, costs: StepCosts) -> tuple[float, float]:
    """(step time in seconds, bubble ratio) from the simulator, with the reduction added."""
    config = resolved.config
    if costs.sharing is None:
        makespan_ms, bubble = _simulated(_schedule_key(config), costs.F * 1e3, costs.B * 1e3, costs.W * 1e3,
                                         costs.comm * 1e3)
    else:
        makespan_ms, bubble = _shared_simulated(_schedule_key(config), (costs.F * 1e3, costs.B * 1e3, costs.W * 1e3),
                                                tuple(wait * 1e3 for wait in costs.waits), costs.comm * 1e3,
                                                costs.sharing)
    return makespan_ms / 1e3 + costs.reduction, bubble


@lru_cache(maxsize=4096)
def _simulated(key: tuple, forward: float, backward: float, weight: float, comm: float) -> tuple[float, float]:
    """The simulator's makespan (ms) and bubble ratio of a schedule at these costs (kept: candidates that differ
    only in what the costs do not see, such as the optimizer's sharding, share one run)."""
    from ppctl.pipeline.kept import kept_sends
    from ppctl.pipeline.simulate import Costs, simulate_makespan

    return simulate_makespan(kept_sends(*key), Costs(F=forward, B=backward, W=weight, comm=comm))


@lru_cache(maxsize=1024)
def _shared_simulated(key: tuple, costs: tuple[float, float, float], waits: tuple[float, float, float], comm: float,
                      sharing: tuple[int, int]) -> tuple[float, float]:
    """``_simulated`` where the processes share ``sharing``'s cores (``simulate_shared_makespan``): each F, B and
    W (ms) less its wait is compute, shared. Never below ``_simulated`` at the same costs, so the bounds hold."""
    from ppctl.pipeline.kept import kept_sends
    from ppctl.pipeline.simulate import Costs, simulate_shared_makespan

    return simulate_shared_makespan(kept_sends(*key), Costs(*costs, comm=comm), Costs(*waits), *sharing)


# A prediction is skipped when a lower bound on it exceeds the time to beat by more than this share: far more than
# the rounding that separates the bound's sum from the simulator's, so the skipped one would not have beaten it.
ROUNDING_MARGIN = 1e-9


def step_lower_bound_s(resolved: ResolvedConfig, costs: StepCosts) -> float:
    """A step time the simulator's prediction at ``costs`` cannot be below, from runs kept per schedule and size:
    the makespan floor (``_floor_ms``), and the schedule's makespan with every F, B and W at the least of them and
    messages at the largest of ``COMM_RATIOS`` of that below ``costs.comm`` (the makespan only grows with each cost
    and scales with all of them together); plus the reduction."""
    least = min(costs.F, costs.B, costs.W)
    scaled = 0.0
    if least > 0:
        ratio = max(r for r in COMM_RATIOS if r * least <= costs.comm)
        unit_makespan_ms = _simulated(_schedule_key(resolved.config), 1.0, 1.0, 1.0, ratio)[0]
        scaled = unit_makespan_ms * least * 1e3  # costs in s, the simulations' in ms
    return max(_floor_ms(resolved, costs), scaled) / 1e3 + costs.reduction


def _floor_ms(resolved: ResolvedConfig, costs: StepCosts) -> float:
    """The simulator's makespan at ``costs`` (ms) cannot be below this, whatever the schedule: its busiest rank's
    compute after the fill in front of it, and with one copy before the drain behind it (``makespan_floor``,
    from the placement alone: no schedule is built)."""
    from ppctl.pipeline.simulate import Costs, makespan_floor

    return makespan_floor(resolved.layout.placement, costs.microbatches,
                          Costs(F=costs.F * 1e3, B=costs.B * 1e3, W=costs.W * 1e3, comm=costs.comm * 1e3))


# --- the search ----------------------------------------------------------------------------------

NOT_EXAMINED = "slower than the last one shown (by a lower bound on its time, or by its prediction)"
TOO_LARGE = "needs more memory than the device has"
DOMINATED = "not needed: a variant of the same layout that is as fast or faster fits"


@gc_paused
def plan(config: PpctlConfig, devices: int, memory_bytes: float, top: int, device: Device) -> Plan:
    """The ``top`` fastest candidates whose every rank fits in ``memory_bytes``, fastest first (equal times: the
    smaller peak memory first); see the module docstring. ``config`` is the user's, already validated.

    Of a layout's variants the first that fits is kept: the later ones save memory it does not need, at a cost
    in time (recomputation) or none (the optimizer's sharding, tried first).

    The schedule checker, the costliest of ``train``'s rules, proves only the schedules of the list found: a
    schedule it refuses is searched again as refused (``_search``'s ``disproved``) until every schedule in the
    list is proved. So a candidate is counted under the checker's rule where it would have entered the list, and
    one slower than the list's last is counted as slower without its schedule proved.

    The cyclic garbage collector is paused meanwhile: the schedules the search keeps hold millions of tuples, which
    each collection walked again (about a third of the time of building them), and the search makes no cycle.
    """
    disproved: dict[tuple, str] = {}
    while True:
        found = _search(config, devices, memory_bytes, top, device, disproved)
        refusals = _checker_refusals(config, found.candidates)
        if not refusals:
            return found
        disproved.update(refusals)


def _search(config: PpctlConfig, devices: int, memory_bytes: float, top: int, device: Device,
            disproved: dict[tuple, str]) -> Plan:
    """The pruned search, with the schedules in ``disproved`` (``_schedule_key`` -> the checker's refusal)
    refused where their candidate would enter the list, and no other schedule proved."""
    layouts, refused = search_space(config, devices)
    bounded = sorted(((_compute_bound_or_zero(config, variants[0], device), index, variants)
                      for index, variants in enumerate(layouts)), key=lambda entry: entry[:2])
    best: list[Prediction] = []
    for position, (bound, _, variants) in enumerate(bounded):
        if len(best) >= top and bound >= best[-1].step_time_s:
            refused[NOT_EXAMINED] += sum(len(rest) for _, _, rest in bounded[position:])
            break
        to_beat = best[-1] if len(best) >= top else None
        if to_beat is not None and (_outpaced(config, variants[0], device, to_beat) or
                                    _schedule_bound_or_zero(config, variants[0], device) >= to_beat.step_time_s):
            refused[NOT_EXAMINED] += len(variants)
            continue
        kept = _first_fitting(config, variants, memory_bytes, device, refused, to_beat, disproved)
        if kept is not None:
            best = sorted(best + [kept], key=_order)[:top]
    return Plan(best, refused)


def _checker_refusals(config: PpctlConfig, found: list[Prediction]) -> dict[tuple, str]:
    """The schedules of ``found`` that ``train``'s validation refuses, each with its one-line refusal (the checker's
    verdict, kept per schedule and size by validation)."""
    refusals = {}
    for prediction in found:
        built = prediction.candidate.apply(config)
        try:
            resolve(built, data=False)
        except (ConfigError, ScheduleError) as error:
            refusals[_schedule_key(built)] = str(error)
    return refusals


def _order(prediction: Prediction) -> tuple[float, int]:
    """Fastest first; of equal times, the smaller peak memory."""
    return prediction.step_time_s, prediction.peak_memory_bytes


def _outpaced(config: PpctlConfig, first: Candidate, device: Device, to_beat: Prediction) -> bool:
    """Whether a layout's ``first`` variant is valid and its makespan floor (``_floor_ms``, which builds no
    schedule) is slower than ``to_beat``: then so are its later variants (more recomputation, or the update
    unsharded), and the layout is counted as slower before its schedule is built or its memory weighed."""
    try:
        built = resolve(first.apply(config), data=False, prove_schedule=False)
        costs = step_costs(built, device)
        return _floor_ms(built, costs) / 1e3 + costs.reduction > to_beat.step_time_s * (1 + ROUNDING_MARGIN)
    except (ConfigError, ScheduleError):
        return False


def _compute_bound_or_zero(config: PpctlConfig, candidate: Candidate, device: Device) -> float:
    """``compute_bound_s`` of ``candidate`` on the user's ``config``, or 0 where its layout or split does not
    resolve (validation will say why when it is examined)."""
    try:
        return compute_bound_s(resolve(candidate.apply(config), check=False), device)
    except ConfigError:
        return 0.0


def _schedule_bound_or_zero(config: PpctlConfig, candidate: Candidate, device: Device) -> float:
    """``schedule_bound_s`` of ``candidate`` on the user's ``config``, or 0 where it does not resolve or its schedule
    cannot be built at these sizes (validation will say why)."""
    try:
        return schedule_bound_s(resolve(candidate.apply(config), check=False), device)
    except (ScheduleError, ConfigError):
        return 0.0


def _first_fitting(config: PpctlConfig, variants: list[Candidate], memory_bytes: float, device: Device,
                   refused: Counter, to_beat: Prediction | None, disproved: dict[tuple, str]) -> Prediction | None:
    """The first variant ``train`` accepts that fits in ``memory_bytes``, if it beats ``to_beat`` (the last one
    kept, None while the list is not full); the others counted in ``refused``. A variant whose lower bound on its
    time (``step_lower_bound_s``) is above ``to_beat``'s is not simulated. Its schedule counts as proved unless
    it is in ``disproved`` (``plan`` proves the list's at the end)."""
    for index, candidate in enumerate(variants):
        try:
            built = resolve(candidate.apply(config), data=False, prove_schedule=False)
            costs = step_costs(built, device)
            memory = _memory(built)
            if max(parts.total for parts in memory) > memory_bytes:
                refused[TOO_LARGE] += 1
                continue
            if to_beat is not None and \
                    step_lower_bound_s(built, costs) > to_beat.step_time_s * (1 + ROUNDING_MARGIN):
                refused[NOT_EXAMINED] += len(variants) - index  # the later variants are no faster
                return None
            prediction = Prediction(candidate, *simulated_step(built, costs), memory)
            if to_beat is not None and _order(prediction) >= _order(to_beat):
                refused[NOT_EXAMINED] += len(variants) - index
                return None
            refusal = disproved.get(_schedule_key(built.config))
            if refusal is not None:
                raise ConfigError(refusal)
        except (ConfigError, ScheduleError) as error:
            refused[refusal_reason(str(error))] += 1
            continue
        refused[DOMINATED] += len(variants) - index - 1
        return prediction
    return None


def predict(config: PpctlConfig, candidate: Candidate, device: Device, prove_schedule: bool = True) -> Prediction:
    """One candidate's predicted step time, bubble and memory per rank; ``ConfigError`` if ``train`` would
    refuse it (without the schedule checker's verdict when ``prove_schedule`` is False)."""
    built = resolve(candidate.apply(config), data=False, prove_schedule=prove_schedule)  # the data: checked once
    step_time, bubble = simulated_step(built, step_costs(built, device))
    return Prediction(candidate, step_time, bubble, _memory(built))


def _memory(resolved: ResolvedConfig) -> tuple[MemoryParts, ...]:
    """The predicted memory per pp rank of a resolved config, with its kept schedule's in-flight states."""
    built = _schedule_of(resolved.config)
    return tuple(config_memory(resolved, built.states))


def refusal_reason(message: str) -> str:
    """A validation refusal as a reason to count: its rule, without the numbers that differ per candidate."""
    setting = message.split("=", 1)[0].split(":", 1)[0].strip()
    return f"refused by validation: {setting}" if setting else "refused by validation"


def calibrated_device(device: Device, calibration, measured: ResolvedConfig) -> Device:
    """``device`` with the figures a measured run achieved (``--calibrate RUN_DIR``: a ``Calibration`` from
    ``ppctl bench`` or a traced ``train``, and that run's config): the FLOP/s of its fitted F + B + W (the
    runtime's time between actions taken out), that time between actions per action, its message time as the
    latency of every message, and where ``ppctl bench`` measured them the update's time per parameter, the
    ring collectives' latency and bandwidth and a collective's wait after compute (else a free update and free
    links). Where the measured run's workers outnumbered its machine's cores, the devices share those cores
    (``Device.cores``) and the FLOP/s are those of the actions' time on a core. ValueError (one line) when the
    figures make no throughput."""
    chunks = _chunks_per_copy(measured)
    costs, overhead_ms = calibration.costs, calibration.overhead_ms
    actions = 3 if costs.W else 2  # F, B and W each charged; an unsplit backward is B, with W at 0
    compute_ms = costs.F + costs.B + costs.W - actions * overhead_ms * chunks
    if compute_ms <= 0:
        raise ValueError(f"--calibrate: {calibration.source} holds no compute time once the runtime's time between "
                         "actions is taken out")
    bandwidth = calibration.bus_bandwidth or float("inf")  # not measured: free links
    if calibration.cores:  # the measured actions waited for a core part of their time: the compute is the rest
        compute_ms *= calibration.on_core_share
    return replace(device, name=f"calibrated by {calibration.source}",
                   flops=3 * forward_flops_per_microbatch(measured) / (compute_ms / 1e3),
                   intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                   latency_s=costs.comm / 1e3, overhead_s=overhead_ms / 1e3,
                   update_s_per_parameter=calibration.update_s_per_parameter or 0.0,
                   collective_latency_s=calibration.ring_step_s,
                   collective_wait_s=calibration.collective_wait_s or 0.0, cores=calibration.cores)


def explain_candidate(config: PpctlConfig, candidate: Candidate, device: Device):
    """The simulator's ``SimResult`` (ms) of a candidate's step at its predicted costs (``ppctl plan --explain``)."""
    from ppctl.pipeline.simulate import Costs, simulate

    built = resolve(candidate.apply(config), check=False)
    costs = step_costs(built, device)
    return simulate(built.schedule, Costs(F=costs.F * 1e3, B=costs.B * 1e3, W=costs.W * 1e3,
                                                        comm=costs.comm * 1e3))


__all__ = ["DEVICES", "MAX_DEVICES", "Candidate", "Device", "Plan", "Prediction", "StepCosts", "candidates",
           "compute_bound_s", "calibrated_device", "explain_candidate", "forward_flops_per_microbatch",
           "parse_devices", "plan", "predict", "schedule_bound_s", "search_space", "simulated_step", "step_costs",
           "step_lower_bound_s"]
