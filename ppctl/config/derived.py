"""What follows from a config: its layout and layer map, its schedule's registry entry, and sizes.

The layout (with the schedule's stage placement), microbatches per step, the padded vocabulary,
the tokens of a pipeline message, workers per node, the tokenizer's vocabulary, the rendezvous
endpoint, and ``fill_unset``: the values of the settings that follow another part of ppctl when
left unset. Each raises ``ConfigError`` (one line) where the config cannot give an answer.
"""

from __future__ import annotations

import math

from ppctl.config.schema import SYNTHETIC_VOCAB_SIZE, ConfigError, DataConfig, PpctlConfig, require
from ppctl.parallel.layout import LayoutError, ParallelLayout, even_pipeline_layout
from ppctl.parallel.placement import PlacementError

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port when the endpoint names none


def fill_unset(config: PpctlConfig) -> None:
    """Give the settings left unset the values they follow (``compose_config`` and ``load_config_file`` call this).

    ``parallel.vpp``: the chunks per rank the schedule places (2 for the V schedules, 2 per wave of
    ``parallel.waves`` for ``hanayo``, the file's for ``schedule=custom``, else 1), so ``schedule=zbv
    parallel.pp=2`` needs no vpp; ``model.vocab_size``: the tokenizer's ids, so the resolved
    config.yaml holds the number; ``launcher.nnodes``: ``launcher.slurm.nodes`` when only that is set.
    """
    if config.parallel.vpp is None:
        config.parallel.vpp = _placed_chunks(config)
    if config.model.vocab_size is None:
        config.model.vocab_size = tokenizer_vocab_size(config.data)
    if config.launcher.slurm.nodes is not None and config.launcher.nnodes == 1:
        config.launcher.nnodes = config.launcher.slurm.nodes  # the allocation's nodes are torchrun's


def _placed_chunks(config: PpctlConfig) -> int:
    """The chunks per rank the configured schedule places when ``parallel.vpp`` is unset."""
    from ppctl.pipeline.schedules import CUSTOM

    spec = schedule_specs().get(config.schedule.name)
    if spec is None:
        return 1  # validation names the unknown schedule
    if spec.chunks_per_wave is not None:
        return spec.chunks_per_wave * (config.parallel.waves or 1)
    if spec.name == CUSTOM and config.schedule.file:
        return _file_chunks_per_rank(config.schedule.file) or 1
    return spec.chunks_per_rank or 1


def _file_chunks_per_rank(path: str):
    """The chunks per rank of the schedule in ``path``, or None when it cannot be read (validation says why)."""
    from ppctl.pipeline.schedules import ScheduleError, read_schedule_file

    try:
        return read_schedule_file(path).chunks_per_rank
    except ScheduleError:
        return None


def schedule_specs() -> dict:
    """The schedule registry (``ppctl.pipeline.schedules.SCHEDULE_SPECS``) and ``custom``, imported when first needed."""
    from ppctl.pipeline.schedules import CUSTOM_SPEC, SCHEDULE_SPECS

    return {**SCHEDULE_SPECS, CUSTOM_SPEC.name: CUSTOM_SPEC}


def configured_schedule(config: PpctlConfig):
    """The schedule a config runs: the registry builds it, or ``schedule=custom`` reads it from ``schedule.file``.

    Raises ``ScheduleError`` (one line) where it cannot be built or read.
    """
    from ppctl.pipeline.schedules import CUSTOM, build_schedule, read_schedule_file

    parallel = config.parallel
    if config.schedule.name == CUSTOM:
        require(bool(config.schedule.file), "schedule=custom needs schedule.file=PATH (torch's compute-only CSV or "
                                            "ppctl's JSON, as inspect-schedule --json prints it)")
        return read_schedule_file(config.schedule.file)
    return build_schedule(config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config))


def interleaves_experts(config: PpctlConfig) -> bool:
    """Whether overlapped pairs and weight fills run interleaved: ``parallel.overlap_ep_comm`` with ep > 1 (the
    schedule then carries its weight fills: ``Schedule.with_weight_fills``)."""
    return config.parallel.overlap_ep_comm and config.parallel.ep > 1


def schedule_placement(config: PpctlConfig):
    """The configured schedule's stage placement (``schedule=custom``: the file's), or ``ConfigError``."""
    from ppctl.pipeline.schedules import CUSTOM, ScheduleError

    spec, parallel = schedule_spec(config), config.parallel
    if spec.name != CUSTOM:
        return spec.placement(parallel.pp, parallel.vpp)
    try:
        return configured_schedule(config).placement
    except ScheduleError as error:
        raise ConfigError(str(error)) from None


def schedule_spec(config: PpctlConfig):
    """The registry entry of the configured schedule, or ``ConfigError`` naming the known ones."""
    specs, name = schedule_specs(), config.schedule.name
    require(name in specs, f"schedule.name={name!r} is unknown; choose one of {', '.join(specs)}")
    return specs[name]


def layout_of(config: PpctlConfig) -> ParallelLayout:
    """The ``ParallelLayout`` a config describes, with the schedule's stage placement."""
    parallel = config.parallel
    placement = schedule_placement(config)
    try:
        return ParallelLayout(
            tp=parallel.tp, cp=parallel.cp, dp=parallel.dp, pp=parallel.pp, vpp=parallel.vpp, order=parallel.order,
            placement=placement, ep=parallel.ep, etp=parallel.etp,
        )
    except (LayoutError, PlacementError) as error:
        raise ConfigError(str(error)) from None


def pipeline_layout_of(config: PpctlConfig) -> str | None:
    """The layout string of the model's split into stages as configured: ``parallel.pipeline_layout``, the even
    split that counts the embedding and/or the loss as layers (``account_for_*_in_split``), or None for the plain
    even split. ``parallel.balance=auto`` chooses its split when the config is resolved
    (``ppctl.resolve.resolved``), with the planner's balancer: ask the ``ResolvedConfig`` for it."""
    parallel = config.parallel
    if parallel.balance == "auto":
        raise ValueError("parallel.balance=auto: its split is chosen by ppctl.resolve.resolved.resolve")
    if parallel.pipeline_layout or not (parallel.account_for_embedding_in_split or parallel.account_for_loss_in_split):
        return parallel.pipeline_layout
    stages = layout_of(config).placement.stages_per_copy
    try:
        return even_pipeline_layout(config.model.num_layers, stages, parallel.account_for_embedding_in_split,
                                    parallel.account_for_loss_in_split)
    except LayoutError as error:
        raise ConfigError(str(error)) from None


def num_microbatches(config: PpctlConfig) -> int:
    """Microbatches per DP rank per step."""
    trainer = config.trainer
    return max(1, trainer.global_batch_size // (trainer.micro_batch_size * config.parallel.dp))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up to a multiple of ``divisible_by * tp`` (Megatron's padding)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def message_seq_length(config: PpctlConfig) -> int:
    """Tokens of each sequence a rank holds between blocks, so in one pipeline message.

    A CP rank's part of the sequence (seq_length / cp), and with sequence parallelism
    a TP rank's part of that.
    """
    parallel = config.parallel
    tokens = config.trainer.seq_length // parallel.cp
    return tokens // parallel.tp if parallel.sequence_parallel else tokens


def nproc_per_node(config: PpctlConfig) -> int:
    """Workers per node (default: the world size split evenly over the nodes)."""
    if config.launcher.nproc_per_node is not None:
        return config.launcher.nproc_per_node
    world = config.parallel.tp * config.parallel.cp * config.parallel.dp * config.parallel.pp
    return max(1, world // config.launcher.nnodes)


def tokenizer_vocab_size(data: DataConfig) -> int:
    """The ids the configured tokenizer emits, end of document included (synthetic data: ``SYNTHETIC_VOCAB_SIZE``)."""
    if data.source == "synthetic":
        return SYNTHETIC_VOCAB_SIZE
    from ppctl.data.tokenizer import build_tokenizer

    try:
        return build_tokenizer(data.tokenizer).vocab_size
    except (OSError, ValueError) as error:
        raise ConfigError(str(error)) from None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """The host and port of ``launcher.rdzv_endpoint`` (``host:port``, ``[v6 address]:port``; no port: torchrun's
    29400), or ``ConfigError``."""
    text = endpoint.strip()
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon or (":" in host and not host.startswith("[")):  # no port, or a bare IPv6 address
        host, port = text, str(DEFAULT_RDZV_PORT)
    host = host.removeprefix("[").removesuffix("]")
    require(bool(host) and port.isdigit() and int(port) < 1 << 16,
            f"launcher.rdzv_endpoint={endpoint!r} must be host:port with a port from 0 to 65535")
    return host, int(port)
