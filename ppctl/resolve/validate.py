"""Validation: the rules that span several settings, each refused in one line.

``validate`` checks world size, divisibility, the schedule's rules (the schedule is built and
proved by the schedule checker), the data source and the learning-rate schedule, and returns
``DerivedSizes``. Every failure is a ``ConfigError`` naming the setting and the rule. Pure: no
process is started and no process group is touched.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, fields, is_dataclass

from ppctl.config.derived import (configured_schedule, interleaves_experts, layout_of, nproc_per_node,
                                  num_microbatches, parse_endpoint, pipeline_layout_of, schedule_spec,
                                  tokenizer_vocab_size)
from ppctl.resolve.init_from import starts_from_a_checkpoint
from ppctl.config.schema import (BACKENDS, BAD_ROWS, BALANCE_MODES, DATA_SOURCES, DOCUMENTS_MODES, DROP_POLICIES,
                                 LAUNCHERS, PACKINGS, POSITION_EMBEDDINGS, PRECISIONS, RECOMPUTE_METHODS,
                                 RECOMPUTE_MODES, ROUTER_SCORES, TOO_LONG, ConfigError, MoEConfig, PpctlConfig, require)
from ppctl.data.corpus import INSTRUCTION_SOURCES
from ppctl.model.family import ResolvedModel, hf_experts_formats, resolve_model
from ppctl.model.hf_format import init_from_problem
from ppctl.optim.lr import DECAY_STYLES
from ppctl.parallel.layout import CP_COMM_MODES, LayoutError, ParallelLayout, split_layers


@dataclass(frozen=True)
class DerivedSizes:
    """Numbers that follow from a valid config, and its model as its family resolved it while validating (its padded
    vocabulary: ``model.padded_vocab_size``)."""

    world_size: int
    num_microbatches: int
    nproc_per_node: int
    model: ResolvedModel


def validate(config: PpctlConfig, layer_split: bool = True, data: bool = True,
             prove_schedule: bool = True) -> DerivedSizes:
    """Check every cross-setting rule; return derived sizes or raise ``ConfigError`` (one line).

    Every command runs this before anything starts. The schedule is also
    built and proved by the schedule checker (complete, and it runs under NCCL-like sends).
    ``layer_split=False`` leaves out whether the model's layers divide into the stages
    (``inspect-schedule`` draws a schedule, whatever the model); ``data=False`` leaves out the data
    source (``ppctl plan`` checks it once, not for each of its thousands of layouts); ``prove_schedule=False``
    leaves out the schedule checker (``ppctl plan`` proves only the schedules of the candidates it keeps).
    """
    _check_positive(config)
    _check_expert_tensor_parallel(config)
    _check_schedule_chunks(config)
    _check_schedule_file(config)
    _check_balance(config)
    layout = layout_of(config)
    if layer_split:
        _check_layer_split(config, layout)
    model = _check_model(config)
    _check_batch(config, layout)
    _check_schedule(config)
    _check_misc(config, model, data)
    _check_lr_schedule(config)
    if prove_schedule:
        _check_schedule_plan(config)
    return DerivedSizes(
        world_size=layout.world_size,
        num_microbatches=num_microbatches(config),
        nproc_per_node=nproc_per_node(config),
        model=model,
    )


def validate_data(config: PpctlConfig) -> None:
    """The checks of ``validate`` that no layout changes: positive sizes and the data source (``ppctl plan``
    makes them once for the user's config, then validates each layout with ``data=False``)."""
    _check_positive(config)
    _check_data(config)


def _check_layer_split(config: PpctlConfig, layout: ParallelLayout) -> None:
    parallel = config.parallel
    require(not (parallel.pipeline_layout and (parallel.account_for_embedding_in_split
                                               or parallel.account_for_loss_in_split)),
            "parallel.pipeline_layout places every layer itself: leave parallel.account_for_embedding_in_split "
            "and parallel.account_for_loss_in_split false with it")
    if parallel.balance == "auto":
        return  # the balancer's split is chosen, and checked, when the config is resolved (ppctl.resolve.resolved)
    try:
        split_layers(config.model.num_layers, layout.placement.stages_per_copy, pipeline_layout_of(config))
    except LayoutError as error:
        raise ConfigError(str(error)) from None


def _check_balance(config: PpctlConfig) -> None:
    """``parallel.balance`` is a known mode; ``auto`` chooses the split alone; its memory limit is positive and only
    with ``auto``."""
    parallel = config.parallel
    require(parallel.balance in BALANCE_MODES,
            f"parallel.balance={parallel.balance!r} must be one of {', '.join(BALANCE_MODES)}")
    limit = parallel.balance_memory_gb
    require(limit is None or limit > 0, f"parallel.balance_memory_gb={limit} must be positive (GiB per rank), or unset")
    require(limit is None or parallel.balance == "auto",
            f"parallel.balance_memory_gb={limit} is the limit the split of parallel.balance=auto must fit; set "
            f"parallel.balance=auto with it (parallel.balance={parallel.balance}), or leave it unset")
    if parallel.balance != "auto":
        return
    require(not parallel.pipeline_layout,
            "parallel.balance=auto chooses the split itself: leave parallel.pipeline_layout unset with it "
            "(or set parallel.balance=even)")
    for flag in ("account_for_embedding_in_split", "account_for_loss_in_split"):
        require(not getattr(parallel, flag),
                f"parallel.balance=auto counts the embedding and the loss by their FLOPs itself: leave "
                f"parallel.{flag} false with it")


def _check_schedule_plan(config: PpctlConfig) -> None:
    """Build the schedule and run the checker on it (the same proof the workers rely on)."""
    from ppctl.pipeline.check import check_schedule, check_weight_fills
    from ppctl.pipeline.schedules import CUSTOM, ScheduleError

    parallel = config.parallel
    fills = interleaves_experts(config)
    if config.schedule.name != CUSTOM:
        problem = _built_schedule_problem(config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config),
                                          fills)
    else:
        try:
            schedule = configured_schedule(config)
            check_schedule(schedule)
            if fills:
                check_weight_fills(schedule.with_weight_fills())
            problem = _nothing_to_interleave(schedule) if fills else None
        except ScheduleError as error:
            problem = str(error)
    if problem is not None:
        message = problem.removeprefix(f"{config.schedule.name}: ")  # named once, below
        where = f" ({config.schedule.file})" if config.schedule.name == CUSTOM else ""
        raise ConfigError(f"schedule {config.schedule.name}{where}: {message}") from None


@functools.lru_cache(maxsize=1024)
def _built_schedule_problem(name: str, pp: int, vpp: int, microbatches: int, fills: bool = False) -> str | None:
    """The checker's verdict on a built schedule (None: proved), with its weight fills when ``fills``, kept: these
    sizes decide it, and a planner validates thousands of configs that share a few schedules (and has usually built
    and timed this one: the checker starts from its kept schedule and sends, ``ppctl.pipeline.kept``)."""
    from ppctl.pipeline.check import check_schedule, check_weight_fills
    from ppctl.pipeline.kept import kept_schedule, kept_sends
    from ppctl.pipeline.schedules import ScheduleError

    try:
        try:
            sent = kept_sends(name, pp, vpp, microbatches)
        except ScheduleError:  # not built, or a message lacking: the checker finds the first problem in its order
            sent = None
        schedule = kept_schedule(name, pp, vpp, microbatches) if sent is None else sent.schedule
        check_schedule(schedule, sent)
        if fills:
            check_weight_fills(schedule.with_weight_fills())
    except ScheduleError as error:
        return str(error)
    return _nothing_to_interleave(schedule) if fills else None


def _nothing_to_interleave(schedule) -> str | None:
    """Why ``parallel.overlap_ep_comm`` would do nothing under ``schedule`` (neither overlapped pairs nor a split
    backward), or None."""
    if any(schedule.overlapped) or schedule.splits_backward:
        return None
    return ("parallel.overlap_ep_comm=true, but it has neither overlapped pairs (dualpipe, dualpipev) nor a split "
            "backward (the zero-bubble and V schedules) for the expert all-to-alls to hide behind; choose one of "
            "those, or leave it false")


def _check_schedule_file(config: PpctlConfig) -> None:
    """``schedule=custom``: the file reads, and its ranks, chunks and microbatches are the config's."""
    from ppctl.pipeline.schedules import CUSTOM, ScheduleError

    if config.schedule.name != CUSTOM:
        require(config.schedule.file is None, f"schedule.file={config.schedule.file} is read only with "
                                              f"schedule=custom; schedule={config.schedule.name} is built by ppctl")
        return
    try:
        schedule = configured_schedule(config)
    except ScheduleError as error:
        raise ConfigError(str(error)) from None
    parallel, file = config.parallel, config.schedule.file
    problem = schedule.placement.problem(schedule.pp, schedule.chunks_per_rank)
    require(problem is None, f"schedule.file {file}: its stages do not make a pipeline: {problem}")
    require(schedule.pp == parallel.pp, f"schedule.file {file} has {schedule.pp} ranks; set parallel.pp={schedule.pp}")
    require(schedule.chunks_per_rank == parallel.vpp,
            f"schedule.file {file} places {schedule.chunks_per_rank} chunks on each rank; set "
            f"parallel.vpp={schedule.chunks_per_rank} (or leave it unset)")
    require(schedule.num_microbatches == num_microbatches(config),
            f"schedule.file {file} runs {schedule.num_microbatches} microbatches, the config "
            f"{num_microbatches(config)} (trainer.global_batch_size / (micro_batch_size x dp)); make them equal")


POSITIVE_FIELDS = {
    "model": ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_length",
              "make_vocab_size_divisible_by"),
    "parallel": ("tp", "pp", "vpp", "dp", "cp", "ep", "etp"),
    "trainer": ("max_steps", "global_batch_size", "micro_batch_size", "seq_length", "log_every", "eval_iters",
                "keep_last", "max_skipped_steps"),
    "launcher": ("nnodes", "timeout_s", "shutdown_timeout_s"),
    "optimizer": ("bucket_size", "loss_scale_window"),
    "schedule": ("stream_steps",),
}


# Settings that are a positive integer or unset (null): 0 is refused, not read as unset.
POSITIVE_OR_UNSET_FIELDS = {
    "launcher": ("nproc_per_node", "threads_per_worker"),
}


def float_settings(section, prefix: str):
    """``(dotted name, value)`` of every float setting of a config ``section`` and its subsections (a schema field
    typed ``float`` or ``Optional[float]``), in schema order."""
    for item in fields(section):
        value = getattr(section, item.name)
        if is_dataclass(value):
            yield from float_settings(value, f"{prefix}{item.name}.")
        elif str(item.type) in ("float", "Optional[float]", "float | None"):
            yield f"{prefix}{item.name}", value


def _check_finite(config: PpctlConfig) -> None:
    """Every float setting is a finite number (or unset where it may be): an infinite or nan value passes most range
    checks unnoticed (nan compares false) and makes every loss or gradient norm non-finite."""
    for name, value in float_settings(config, ""):
        require(value is None or math.isfinite(value), f"{name}={value} must be a finite number")


def _check_positive(config: PpctlConfig) -> None:
    _check_finite(config)
    for section, names in POSITIVE_FIELDS.items():
        for name in names:
            value = getattr(getattr(config, section), name)
            require(value >= 1, f"{section}.{name}={value} must be a positive integer")
    for section, names in POSITIVE_OR_UNSET_FIELDS.items():
        for name in names:
            value = getattr(getattr(config, section), name)
            require(value is None or value >= 1,
                    f"{section}.{name}={value} must be a positive integer, or unset (null)")
    require(config.optimizer.lr > 0, f"optimizer.lr={config.optimizer.lr} must be positive")
    optimizer = config.optimizer
    for name in ("beta1", "beta2"):  # torch.optim.AdamW's own ranges, refused here rather than in every worker
        value = getattr(optimizer, name)
        require(0 <= value < 1, f"optimizer.{name}={value} must be >= 0 and < 1")
    require(optimizer.eps >= 0, f"optimizer.eps={optimizer.eps} must be >= 0")
    require(0 < optimizer.min_loss_scale <= optimizer.loss_scale,
            f"optimizer.min_loss_scale={optimizer.min_loss_scale} must be > 0 and <= "
            f"optimizer.loss_scale={optimizer.loss_scale}")
    require(config.trainer.seed >= 0, f"trainer.seed={config.trainer.seed} must be >= 0")
    for name in ("eval_every", "save_every"):
        value = getattr(config.trainer, name)
        require(value >= 0, f"trainer.{name}={value} must be >= 0 (0 disables)")
    require(config.optimizer.weight_decay >= 0, "optimizer.weight_decay must be >= 0")


def _check_model(config: PpctlConfig) -> ResolvedModel:
    """The model's rules, its family's own among them; returns the model its family resolves."""
    model, parallel = config.model, config.parallel
    resolved = resolve_model(config)  # ConfigError for a family that is not installed
    _check_model_ranges(config)
    resolved.family.check(resolved.settings, config)
    require(
        model.num_heads % parallel.tp == 0,
        f"model.num_heads={model.num_heads} must be divisible by parallel.tp={parallel.tp}",
    )
    require(
        model.ffn_hidden_size % parallel.tp == 0,
        f"model.ffn_hidden_size={model.ffn_hidden_size} must be divisible by parallel.tp={parallel.tp}",
    )
    require(
        model.position_embedding in POSITION_EMBEDDINGS,
        f"model.position_embedding={model.position_embedding!r} must be one of {', '.join(POSITION_EMBEDDINGS)}",
    )
    _check_recompute(config)
    _check_context_parallel_attention(config)
    _check_moe(config, resolved)
    return resolved


def _check_model_ranges(config: PpctlConfig) -> None:
    """The model's float settings within their ranges (finite already): a rotary base of 0 or less makes every
    frequency inf or nan, a norm epsilon of 0 or less divides by zero on a constant input, a negative std draws
    nothing."""
    model = config.model
    require(model.rope_theta > 0, f"model.rope_theta={model.rope_theta} must be positive (the rotary base; "
                                  f"10000 is GPT-NeoX's and Llama 2's, 500000 Llama 3's)")
    require(model.norm_epsilon > 0, f"model.norm_epsilon={model.norm_epsilon} must be positive")
    require(model.init_std >= 0, f"model.init_std={model.init_std} must be >= 0")


def _check_recompute(config: PpctlConfig) -> None:
    """The recomputation mode and method exist, and the group size is positive."""
    model = config.model
    require(model.recompute in RECOMPUTE_MODES,
            f"model.recompute={model.recompute!r} must be one of {', '.join(RECOMPUTE_MODES)}")
    require(model.recompute_method in RECOMPUTE_METHODS,
            f"model.recompute_method={model.recompute_method!r} must be one of {', '.join(RECOMPUTE_METHODS)}")
    require(model.recompute_num_layers >= 1, f"model.recompute_num_layers={model.recompute_num_layers} must be >= 1")


def _check_moe(config: PpctlConfig, model: ResolvedModel) -> None:
    """``model.moe``: its keys only with experts, each within its range, and no layout MoE cannot run yet."""
    moe, num_layers = config.model.moe, config.model.num_layers
    require(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts} must be >= 0 (0: a dense model)")
    _check_expert_parallel(config)
    if moe.num_experts == 0:
        for item in fields(MoEConfig):
            value = getattr(moe, item.name)
            require(item.name == "num_experts" or value == item.default,
                    f"model.moe.{item.name}={value} is read only with experts: set model.moe.num_experts > 0")
        return
    require(1 <= moe.topk <= moe.num_experts,
            f"model.moe.topk={moe.topk} must be between 1 and model.moe.num_experts={moe.num_experts}")
    # s / s is 1 whatever s: the router's gradient is 0, and what it computes is roundoff (fuzz seed 2 found it).
    require(not (moe.topk == 1 and moe.router_topk_norm and moe.aux_loss_coeff == 0 and moe.z_loss_coeff == 0),
            "model.moe.router_topk_norm=true with model.moe.topk=1 weighs each token's one expert by 1: without "
            "model.moe.aux_loss_coeff or z_loss_coeff the router gets no gradient and never trains; set topk >= 2, "
            "router_topk_norm=false or a router loss")
    require(moe.expert_ffn_hidden_size is None or moe.expert_ffn_hidden_size >= 1,
            f"model.moe.expert_ffn_hidden_size={moe.expert_ffn_hidden_size} must be a positive integer, or unset")
    require(moe.layer_freq >= 1, f"model.moe.layer_freq={moe.layer_freq} must be a positive integer")
    require(0 <= moe.first_dense_layers < num_layers,
            f"model.moe.first_dense_layers={moe.first_dense_layers} must be in 0..model.num_layers-1={num_layers - 1} "
            f"(at least one MoE layer)")
    require(moe.shared_experts >= 0, f"model.moe.shared_experts={moe.shared_experts} must be >= 0")
    require(moe.router_score in ROUTER_SCORES,
            f"model.moe.router_score={moe.router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        require(getattr(moe, name) >= 0, f"model.moe.{name}={getattr(moe, name)} must be >= 0")
    require(moe.expert_bias_update_rate > 0,
            f"model.moe.expert_bias_update_rate={moe.expert_bias_update_rate} must be positive")
    require(moe.capacity_factor is None or moe.capacity_factor > 0,
            f"model.moe.capacity_factor={moe.capacity_factor} must be positive, or unset (dropless)")
    require(moe.drop_policy in DROP_POLICIES,
            f"model.moe.drop_policy={moe.drop_policy!r} must be one of {', '.join(DROP_POLICIES)}")
    _check_moe_layout(config, model)


def _check_expert_tensor_parallel(config: PpctlConfig) -> None:
    """``parallel.etp`` is 1 (checked before the layout folds the expert ranks)."""
    etp = config.parallel.etp
    require(etp == 1, f"parallel.etp={etp}: expert tensor parallelism is not built; experts run whole on their rank "
                      "(etp=1)")


def _check_expert_parallel(config: PpctlConfig) -> None:
    """``parallel.ep`` splits a model's experts evenly (the fold of the ranks itself: the layout)."""
    parallel, experts = config.parallel, config.model.moe.num_experts
    require(not parallel.overlap_ep_comm or parallel.ep > 1,
            "parallel.overlap_ep_comm=true hides expert all-to-alls behind compute, but parallel.ep=1 exchanges "
            "none: split the experts over ranks (parallel.ep > 1) or leave it false")
    if parallel.ep == 1:
        return
    require(experts > 0, f"parallel.ep={parallel.ep} splits a mixture's experts, but the model has none: set "
                         "model.moe.num_experts (a preset such as model=mixtral_tiny), or parallel.ep=1")
    require(experts % parallel.ep == 0, f"model.moe.num_experts={experts} must be divisible by parallel.ep="
                                        f"{parallel.ep}: each EP rank holds an equal share of every MoE layer's "
                                        "experts")


def _check_moe_layout(config: PpctlConfig, model: ResolvedModel) -> None:
    """What MoE runs with: TP only with sequence parallelism (each TP rank routes its own tokens, as Megatron-Core
    asks), a capacity only on unsplit microbatches (its drop ranks a microbatch's tokens together), no
    stream of steps (its per-step routing statistics reduce over every rank), a Hugging Face folder to start from
    only where the family's format reads a mixture (``hf_moe_architecture``; ``init_from_problem`` checks that the
    folder is one, of this run's shape)."""
    parallel, moe = config.parallel, config.model.moe
    experts = f"model.moe.num_experts={moe.num_experts}"
    require(parallel.tp == 1 or parallel.sequence_parallel,
            f"parallel.tp={parallel.tp} with {experts} needs parallel.sequence_parallel=true: each TP rank routes its "
            f"own share of the tokens to the experts (as Megatron-Core asks)")
    split = parallel.tp * parallel.cp
    require(moe.capacity_factor is None or split == 1,
            f"model.moe.capacity_factor={moe.capacity_factor} with parallel.tp*cp={split}: the capacity drop ranks a "
            f"microbatch's tokens together, which TP and CP split over ranks; unset it (dropless) or run at tp=cp=1")
    require(not schedule_spec(config).streams_steps,
            f"schedule {config.schedule.name} streams steps with no barrier between them, but {experts} reduces its "
            f"routing statistics (expert load, bias) over every rank after each step; choose another schedule")
    require(not config.model.init_from or model.hf_moe_architecture is not None,
            f"model.init_from with {experts} and model.family={config.model.family}: this family's Hugging Face "
            f"format reads no mixture of experts (ppctl reads them as {hf_experts_formats()})")
    shared_width = moe.shared_experts * (moe.expert_ffn_hidden_size or config.model.ffn_hidden_size)
    require(shared_width % parallel.tp == 0,
            f"model.moe.shared_experts={moe.shared_experts} gives a shared MLP {shared_width} wide, which must be a "
            f"multiple of parallel.tp={parallel.tp}")


def _check_context_parallel_attention(config: PpctlConfig) -> None:
    """The CP communication mode exists, and a2a can split each TP rank's heads over the CP ranks."""
    model, parallel = config.model, config.parallel
    require(parallel.cp_comm in CP_COMM_MODES,
            f"parallel.cp_comm={parallel.cp_comm!r} must be one of {', '.join(CP_COMM_MODES)}")
    if parallel.cp > 1 and parallel.cp_comm == "a2a":
        require(
            model.num_heads % (parallel.tp * parallel.cp) == 0,
            f"parallel.cp_comm=a2a splits heads over tp*cp: model.num_heads={model.num_heads} must be divisible "
            f"by parallel.tp * parallel.cp = {parallel.tp * parallel.cp}",
        )


def _check_batch_division(config: PpctlConfig) -> None:
    trainer, parallel = config.trainer, config.parallel
    per_step = trainer.micro_batch_size * parallel.dp
    require(
        trainer.global_batch_size % per_step == 0,
        f"trainer.global_batch_size={trainer.global_batch_size} must be divisible by "
        f"trainer.micro_batch_size * parallel.dp = {per_step}",
    )


def _check_batch(config: PpctlConfig, layout: ParallelLayout) -> None:
    trainer, parallel = config.trainer, config.parallel
    _check_batch_division(config)
    require(
        trainer.seq_length <= config.model.max_seq_length,
        f"trainer.seq_length={trainer.seq_length} must not exceed model.max_seq_length={config.model.max_seq_length}",
    )
    if parallel.cp > 1:
        require(
            trainer.seq_length % (2 * parallel.cp) == 0,
            f"trainer.seq_length={trainer.seq_length} must be divisible by 2 * parallel.cp = {2 * parallel.cp}",
        )
    if parallel.sequence_parallel:
        require(parallel.tp > 1, "parallel.sequence_parallel=true needs parallel.tp > 1")
        # SP splits each CP rank's tokens (seq_length / cp of them) over the TP ranks.
        require(
            trainer.seq_length % (parallel.cp * parallel.tp) == 0,
            f"trainer.seq_length={trainer.seq_length} must be divisible by parallel.cp * parallel.tp = "
            f"{parallel.cp * parallel.tp} with sequence parallelism",
        )
    world = layout.world_size
    require(
        config.launcher.nnodes * nproc_per_node(config) == world,
        f"launcher.nproc_per_node * launcher.nnodes = {config.launcher.nnodes * nproc_per_node(config)} must equal "
        f"the world size tp*cp*dp*pp = {world}",
    )


def _check_schedule_chunks(config: PpctlConfig) -> None:
    """The chunks per rank the schedule's placement allows: one, several (looped), two per wave, or two (a V)."""
    spec, vpp, waves = schedule_spec(config), config.parallel.vpp, config.parallel.waves
    if spec.chunks_per_wave is None:
        require(waves is None, f"parallel.waves={waves} is read only with schedule=hanayo; schedule {spec.name} "
                               f"has no waves")
    else:
        require(waves is None or waves >= 1, f"parallel.waves={waves} must be at least 1")
        chunks = spec.chunks_per_wave * (waves or 1)
        require(vpp == chunks, f"parallel.vpp={vpp}: schedule {spec.name} places {spec.chunks_per_wave} * "
                               f"parallel.waves = {chunks} chunks on each rank; leave parallel.vpp unset")
    if spec.chunks_per_rank is not None:
        require(vpp == spec.chunks_per_rank,
                f"parallel.vpp={vpp}: schedule {spec.name} places exactly {spec.chunks_per_rank} chunks on each "
                f"rank ({spec.placement_name}); set parallel.vpp={spec.chunks_per_rank}")
        return
    require(
        vpp == 1 or spec.multi_chunk,
        f"parallel.vpp={vpp} needs a schedule with several chunks per rank (e.g. interleaved_1f1b); "
        f"schedule {spec.name} uses one",
    )


def _check_schedule(config: PpctlConfig) -> None:
    spec, parallel = schedule_spec(config), config.parallel
    error = spec.microbatch_error(parallel.pp, parallel.vpp, num_microbatches(config))
    require(error is None, f"schedule {spec.name}: {error}")
    if spec.streams_steps:
        _check_stream(config, spec.name)


def _check_stream(config: PpctlConfig, name: str) -> None:
    """A schedule that streams across steps (PipeDream-2BW) updates each rank on its own, with no barrier:
    the delayed update it implies is asked for explicitly, and nothing may need every rank's gradients first."""
    optimizer = config.optimizer
    require(optimizer.gradient_delay == 1,
            f"schedule {name} computes each step's gradients on the weights before the last update; set "
            f"optimizer.gradient_delay=1 (its single-process reference is the same run with parallel=single)")
    require(optimizer.clip_grad <= 0,
            f"schedule {name} updates each rank without waiting for the others, but optimizer.clip_grad="
            f"{optimizer.clip_grad} clips by the global norm of every rank's gradients; set optimizer.clip_grad=0")
    require(config.trainer.precision != "fp16",
            f"schedule {name} updates each rank without waiting for the others, but fp16's loss scaling skips a "
            f"step on any rank's overflow; use trainer.precision=bf16 or fp32")


def _check_misc(config: PpctlConfig, model: ResolvedModel, data: bool = True) -> None:
    require(
        config.trainer.precision in PRECISIONS,
        f"trainer.precision={config.trainer.precision!r} must be one of {', '.join(PRECISIONS)}",
    )
    _check_documents(config)
    if data:
        _check_data(config)
        _check_init_from(config, model)
    require(config.optimizer.gradient_delay in (0, 1),
            f"optimizer.gradient_delay={config.optimizer.gradient_delay} must be 0 (the usual update) or 1 "
            f"(PipeDream-2BW's, one step late)")
    require(
        config.launcher.backend in BACKENDS,
        f"launcher.backend={config.launcher.backend!r} must be one of {', '.join(BACKENDS)}",
    )
    if config.trainer.auto_resume:
        require(bool(config.trainer.out_dir),
                "trainer.auto_resume=true continues the run directory trainer.out_dir: set it")
        require(not config.trainer.overwrite,
                "trainer.auto_resume=true continues the run directory, trainer.overwrite=true deletes its checkpoints: "
                "choose one")
    if config.launcher.inject_fault:
        _check_fault(config)
    require(config.launcher.max_restarts >= 0,
            f"launcher.max_restarts={config.launcher.max_restarts} must be >= 0")
    require(config.launcher.kind in LAUNCHERS,
            f"launcher.kind={config.launcher.kind!r} must be one of {', '.join(LAUNCHERS)}")
    if config.launcher.kind == "slurm":
        _check_slurm(config)
    elif config.launcher.nnodes > 1:  # a Slurm job's script names the rendezvous on its first node
        require(bool(config.launcher.rdzv_endpoint), "launcher.nnodes > 1 needs launcher.rdzv_endpoint (host:port)")
    if config.launcher.rdzv_endpoint:
        parse_endpoint(config.launcher.rdzv_endpoint)
    require(
        0 <= config.launcher.node_rank < config.launcher.nnodes,
        f"launcher.node_rank={config.launcher.node_rank} must be in 0..launcher.nnodes-1",
    )


def _check_documents(config: PpctlConfig) -> None:
    """``data.documents`` is a known mode; packed instruction rows, read alone or as a source of a blend, are kept
    apart (joined, a conversation would attend to the ones packed before it)."""
    data = config.data
    require(data.documents in DOCUMENTS_MODES,
            f"data.documents={data.documents!r} must be one of {', '.join(DOCUMENTS_MODES)}")
    sources = [(f"data.blend[{index}].source", entry.source) for index, entry in enumerate(data.blend)] or [
        ("data.source", data.source)]
    for where, source in sources:
        require(not (source in INSTRUCTION_SOURCES and data.packing == "packed" and data.documents == "joined"),
                f"{where}={source} with data.packing=packed and data.documents=joined lets each row attend to "
                f"the rows packed before it: set data.documents=separate (data={source}'s default), or "
                f"data.packing=padded")


def _check_init_from(config: PpctlConfig, model: ResolvedModel) -> None:
    """``model.init_from``: a Hugging Face folder of this model's architecture and shape, with every tensor it needs
    (a run that resumes reads its checkpoint and ignores it: ``starts_from_a_checkpoint``), whose ``tokenizer.json``
    is the run's tokenizer; an empty name (an unset shell variable) is refused: no folder is ``null``."""
    require(config.model.init_from != "", "model.init_from='' names no folder (an unset shell variable?): give a "
                                          "Hugging Face model folder, or leave model.init_from out (null) to start "
                                          "from random values")
    trainer = config.trainer
    if config.model.init_from and not starts_from_a_checkpoint(trainer.resume_from, trainer.auto_resume,
                                                               trainer.out_dir):
        from ppctl.data.tokenizer import init_from_tokenizer_problem

        problem = (init_from_problem(config.model, model.family)
                   or init_from_tokenizer_problem(config.model.init_from, config.data))
        require(problem is None, problem or "")


FAULT_PATTERN = re.compile(r"(\d+):(raise|kill)(?:@(\d+))?")
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
SLURM_MAX_SIGNAL_LEAD_S = 65535  # sbatch's --signal takes at most this many seconds
SLURM_TIME_PATTERN = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")


def parse_fault(spec: str) -> tuple[int, str, int | None]:
    """``launcher.inject_fault``'s ``RANK:raise|kill[@STEP]`` as ``(rank, kind, step or None)``."""
    match = FAULT_PATTERN.fullmatch(spec)
    require(match is not None,
            f"launcher.inject_fault={spec!r} must look like RANK:raise or RANK:kill, optionally @STEP (1:kill@5)")
    return int(match[1]), match[2], None if match[3] is None else int(match[3])


def _check_fault(config: PpctlConfig) -> None:
    """``launcher.inject_fault`` names a rank of the job and a step it reaches: a fault that cannot fire is refused."""
    spec = config.launcher.inject_fault
    rank, _, step = parse_fault(spec)
    world_size = layout_of(config).world_size
    require(rank < world_size, f"launcher.inject_fault={spec!r} names rank {rank}, but the job has {world_size} "
                               f"rank(s) (0..{world_size - 1}): the fault would never fire")
    require(step is None or 1 <= step <= config.trainer.max_steps,
            f"launcher.inject_fault={spec!r} fires after step {step}, outside this run's steps 1..trainer.max_steps="
            f"{config.trainer.max_steps}: the fault would never fire")


def _check_slurm(config: PpctlConfig) -> None:
    """What ``ppctl submit`` will ask Slurm for: well-formed, and the same node count as the layout's."""
    slurm, launcher = config.launcher.slurm, config.launcher
    if slurm.nodes is not None:
        require(slurm.nodes == launcher.nnodes,
                f"launcher.slurm.nodes={slurm.nodes} and launcher.nnodes={launcher.nnodes} disagree: set one of them")
    if slurm.time is not None:
        require(SLURM_TIME_PATTERN.fullmatch(str(slurm.time)) is not None,
                f"launcher.slurm.time={slurm.time!r} must be a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                f"D-HH:MM:SS")
    require(slurm.gpus_per_node is None or slurm.gpus_per_node >= 0,
            f"launcher.slurm.gpus_per_node={slurm.gpus_per_node} must be >= 0")
    require(slurm.cpus_per_task is None or slurm.cpus_per_task >= 1,
            f"launcher.slurm.cpus_per_task={slurm.cpus_per_task} must be a positive integer")
    require(0 <= slurm.signal_lead_s <= SLURM_MAX_SIGNAL_LEAD_S,
            f"launcher.slurm.signal_lead_s={slurm.signal_lead_s} must be in 0..{SLURM_MAX_SIGNAL_LEAD_S} (Slurm's limit)")
    limit_s = slurm_time_seconds(str(slurm.time)) if slurm.time is not None else 0
    require(limit_s == 0 or slurm.signal_lead_s < limit_s,  # a time of 0 asks Slurm for no limit
            f"launcher.slurm.signal_lead_s={slurm.signal_lead_s} is not shorter than launcher.slurm.time={slurm.time} "
            f"({limit_s} s): the job would be told to stop before it starts working; lower signal_lead_s")
    if slurm.requeue:
        require(config.trainer.checkpoints,
                "launcher.slurm.requeue=true resumes a stopped job from its checkpoint, but trainer.checkpoints=false "
                "saves none: set launcher.slurm.requeue=false or trainer.checkpoints=true")
    for option in slurm.extra_args:
        require(str(option).startswith("-"),
                f"launcher.slurm.extra_args: {option!r} must be one sbatch option (starting with -)")
    script_values = [(f"launcher.slurm.{name}", getattr(slurm, name)) for name in ("partition", "account", "qos")]
    script_values += [("launcher.slurm.extra_args", option) for option in slurm.extra_args]
    script_values.append(("trainer.out_dir", config.trainer.out_dir))
    for name, value in script_values:
        if value is not None:
            require(control_character(str(value)) is None, script_value_problem(name, str(value)))


def control_character(value: str) -> str | None:
    """The first control character (a newline, a tab, ...) in ``value``, or None."""
    found = CONTROL_CHARACTER.search(value)
    return None if found is None else found[0]


def script_value_problem(name: str, value: str) -> str:
    """The one line that refuses a value with a control character in it: a job script would split it into lines."""
    return (f"{name}={value!r} holds the control character {control_character(value)!r}: ppctl submit writes it "
            f"into the job script, where it would start a new line; remove it")


def slurm_time_seconds(time: str) -> int:
    """A Slurm time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in seconds."""
    days, _, clock = time.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:
        hours, minutes, seconds = parts
        return (hours * 60 + minutes) * 60 + seconds
    minutes, seconds = (parts + [0])[:2]
    return minutes * 60 + seconds


def _check_data(config: PpctlConfig) -> None:
    """The data source exists, its tokenizer fits the vocabulary and the token dtype, the split can be made."""
    data, trainer = config.data, config.trainer
    require(data.source in DATA_SOURCES, f"data.source={data.source!r} must be one of {', '.join(DATA_SOURCES)}")
    require(0 <= data.validation_fraction < 1,
            f"data.validation_fraction={data.validation_fraction} must be >= 0 and < 1")
    require(data.num_proc is None or data.num_proc >= 1, f"data.num_proc={data.num_proc} must be a positive integer")
    require(data.shard_mib > 0, f"data.shard_mib={data.shard_mib} must be positive (MiB of input per shard)")
    require(data.fingerprint in ("content", "stat"), f"data.fingerprint={data.fingerprint!r} must be content or stat")
    if data.blend:
        _check_blend_alone(data)
    elif data.source == "synthetic":
        return
    require(data.validation_fraction > 0 or trainer.eval_every == 0,
            f"data.validation_fraction={data.validation_fraction} leaves no validation split but "
            f"trainer.eval_every={trainer.eval_every}; set trainer.eval_every=0 or raise data.validation_fraction")
    from ppctl.data.cache import token_dtype_for
    from ppctl.data.corpus import BlendSpec, CorpusSpec

    vocab_size = tokenizer_vocab_size(data)
    try:
        if data.blend:
            blend = BlendSpec.of(data)
            blend.check()  # at least two sources, weights finite and > 0, each source's files
            _check_blend_indexed(blend, data)
        elif data.source == "indexed":
            _check_indexed(CorpusSpec.of(data), data.eod_mask_loss, data.documents == "separate")
        else:
            CorpusSpec.of(data).corpus()  # the files exist, are of one type; a hub name is tried when preparing
        token_dtype_for(data.token_dtype, vocab_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    require(config.model.vocab_size >= vocab_size,
            f"model.vocab_size={config.model.vocab_size} is smaller than the {vocab_size} ids of data.tokenizer="
            f"{data.tokenizer}; set model.vocab_size >= {vocab_size} or leave it unset to follow the tokenizer")
    _check_instruction_data(data)


def _check_indexed(spec, eod_mask_loss: bool, separate_documents: bool) -> None:
    """An indexed source (``data=indexed``, or a blend's entry: ``spec``): every ``.idx``/``.bin`` pair is whole and
    consistent, of an integer dtype, with no id outside the tokenizer's vocabulary, and with
    ``data.documents=separate`` or ``data.eod_mask_loss`` each document ends with the tokenizer's end-of-document id
    (``DataError``, one line naming the file, before any worker starts)."""
    from ppctl.data.dataset import check_indexed_document_ends
    from ppctl.data.prepare import indexed_pairs, prepared_indexed

    pairs = indexed_pairs(spec)
    prepared_indexed(spec, pairs)
    check_indexed_document_ends(spec, pairs, eod_mask_loss, separate_documents)


def _check_blend_indexed(blend, data) -> None:
    """Each indexed entry of a blend is checked as the source alone is (``_check_indexed``), named by its entry."""
    from ppctl.data.corpus import DataError

    for index, spec in enumerate(blend.specs):
        if spec.source == "indexed":
            try:
                _check_indexed(spec, data.eod_mask_loss, data.documents == "separate")
            except DataError as error:
                raise DataError(f"{blend.label(index)}: {error}") from None


def _check_instruction_data(data) -> None:
    """``data=chat`` and ``data=prompt_completion``: the packing, the policies, and chat's template (also for a
    blend's chat source)."""
    require(data.packing in PACKINGS, f"data.packing={data.packing!r} must be one of {', '.join(PACKINGS)}")
    require(data.too_long in TOO_LONG, f"data.too_long={data.too_long!r} must be one of {', '.join(TOO_LONG)}")
    require(data.bad_rows in BAD_ROWS, f"data.bad_rows={data.bad_rows!r} must be one of {', '.join(BAD_ROWS)}")
    if "chat" not in [data.source, *(entry.source for entry in data.blend)]:
        return
    from ppctl.data.instruction import InstructionOptions, chat_template_of
    from ppctl.data.tokenizer import build_tokenizer

    try:
        chat_template_of(InstructionOptions("chat", chat_template=data.chat_template), build_tokenizer(data.tokenizer))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_blend_alone(data) -> None:
    """A blend (``data.blend``) names every source itself: ``data.path`` and synthetic data would be left unread."""
    require(data.path is None, f"data.blend names each source's path; unset data.path={data.path}, or move it into "
                               f"data.blend as {{path: {data.path}, weight: ...}}")
    require(data.source != "synthetic", "data.source=synthetic with data.blend: a blend draws from token files "
                                        "its entries name; leave data.source unset or drop data.blend")


def _check_lr_schedule(config: PpctlConfig) -> None:
    """The learning-rate schedule's settings (see ``ppctl.optim.lr``)."""
    optimizer = config.optimizer
    require(optimizer.lr_decay_style in DECAY_STYLES,
            f"optimizer.lr_decay_style={optimizer.lr_decay_style!r} must be one of {', '.join(DECAY_STYLES)}")
    require(optimizer.warmup_steps >= 0, f"optimizer.warmup_steps={optimizer.warmup_steps} must be >= 0")
    require(0 <= optimizer.min_lr <= optimizer.lr,
            f"optimizer.min_lr={optimizer.min_lr} must be >= 0 and <= optimizer.lr={optimizer.lr}")
    if optimizer.decay_steps is not None:
        require(optimizer.decay_steps > optimizer.warmup_steps,
                f"optimizer.decay_steps={optimizer.decay_steps} must be greater than "
                f"optimizer.warmup_steps={optimizer.warmup_steps}")
    else:  # the decay defaults to the whole run, which must outlast the warm-up too
        require(config.trainer.max_steps > optimizer.warmup_steps,
                f"optimizer.warmup_steps={optimizer.warmup_steps} must be less than optimizer.decay_steps "
                f"(default trainer.max_steps={config.trainer.max_steps})")
