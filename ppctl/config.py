"""The typed configuration schema, its composition with Hydra, and validation.

The schema is a tree of dataclasses registered in Hydra's ConfigStore: a misspelled
key or a wrong type is refused while composing. ``validate`` then checks the rules
that span several settings (world size, divisibility, schedule rules) and raises
``ConfigError`` with one line naming the setting and the rule. All of this is pure:
no process is started and no process group is touched.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from ppctl.optim.lr import DECAY_STYLES
from ppctl.parallel.layout import CP_COMM_MODES, LayoutError, ParallelLayout, split_layers
from ppctl.parallel.placement import PlacementError

PACKAGE_CONF_DIR = Path(__file__).resolve().parent / "conf"


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the setting and the rule."""


def setting(default: Any, doc: str) -> Any:
    """A schema field with its default and its one-line meaning (``metadata["doc"]``, shown in
    docs/configuration.md)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    """GPT shape. ``vocab_size`` follows the tokenizer unless set; it is padded for TP (see ``padded_vocab_size``)."""

    name: str = setting("gpt_tiny", "a label for logs")
    num_layers: int = setting(4, "transformer layers")
    hidden_size: int = setting(64, "width of the residual stream; divisible by `num_heads`")
    num_heads: int = setting(4, "attention heads; divisible by `parallel.tp`")
    ffn_hidden_size: int = setting(256, "MLP inner width; divisible by `parallel.tp`")
    vocab_size: Optional[int] = setting(
        None, "the classes the model predicts; unset: the tokenizer's (257 for `byte`: bytes + end of document; a "
        "tokenizer file's size, +1 when it has no end-of-text token; 257 for synthetic data); never smaller than "
        "the tokenizer's. The embedding rows are padded to a multiple of `make_vocab_size_divisible_by * tp` "
        "(shown by `inspect-layout`), padded rows never enter the math")
    max_seq_length: int = setting(256, "longest sequence (learned position table size)")
    position_embedding: str = setting("learned", "`learned` or `rope` (rotary)")
    tie_embeddings: bool = setting(
        False, "output layer shares the word embedding (across stages: gradients all-reduced over the "
        "`embedding` group)")
    norm_epsilon: float = setting(1e-5, "LayerNorm epsilon")
    init_std: float = setting(
        0.02, "std of the normal initialisation (layout independent: seeded by (seed, parameter name))")
    make_vocab_size_divisible_by: int = setting(64, "vocabulary padding unit (times tp)")


@dataclass
class ParallelConfig:
    """Parallel sizes; world size = tp * cp * dp * pp."""

    tp: int = setting(1, "tensor-parallel size")
    pp: int = setting(2, "pipeline-parallel size (the `single` option sets 1)")
    vpp: Optional[int] = setting(
        None, "model chunks per pipeline rank: several with `interleaved_1f1b`, exactly 2 with `zbv`, "
        "`dualpipe` and `dualpipev`; unset: what the schedule places (2 for those three, else 1)")
    dp: int = setting(1, "data-parallel size")
    cp: int = setting(1, "context-parallel size (seq_length divisible by 2*cp)")
    cp_comm: str = setting(
        "allgather", "how attention spans the CP group: `allgather` (keys and values gathered), `ring` "
        "(key/value blocks passed around the CP ring, overlapped with compute) or `a2a` (all-to-all to "
        "head-split, as DeepSpeed-Ulysses; num_heads divisible by tp*cp)")
    sequence_parallel: bool = setting(
        False, "Megatron sequence parallelism (needs tp > 1, seq_length divisible by cp*tp)")
    order: str = setting("tp-cp-dp-pp", "rank order, fastest-varying first (Megatron-Core's convention)")
    pipeline_layout: Optional[str] = setting(
        None, "explicit per-stage split in Megatron-LM syntax, e.g. `Ettt|tttt|tttL` (`t*3` repeats); "
        "default: even split, `num_layers` divisible by pp*vpp (by pp with `dualpipe`'s two model copies)")


@dataclass
class ScheduleConfig:
    """Which pipeline schedule runs the microbatches."""

    name: str = setting("1f1b", "the pipeline schedule")


@dataclass
class DataConfig:
    """Where samples come from: ``python_stdlib`` (embedded default), ``text`` or ``synthetic``."""

    source: str = setting(
        "python_stdlib", "`python_stdlib` (the standard library's source, one document per file), `text` (your "
        "corpus: `data.path`), `synthetic` (random tokens)")
    path: Optional[str] = setting(
        None, "for `text`: a file, a folder or a glob of `.txt` (one document per file), `.json`/`.jsonl`, "
        "`.parquet` or `.csv` files (one document per row), one type at a time; or a hub dataset name "
        "(`owner/name`, needs the network once)")
    text_field: str = setting("text", "the field (column) holding the text in json, parquet and csv files")
    cache_dir: str = setting("data/cache", "where token files and their indexes are cached")
    tokenizer: str = setting(
        "byte", "`byte` (UTF-8 bytes, 256 = end of document) or the path of a Hugging Face `tokenizers` JSON file "
        "(end of document: its own end-of-text token, else a new id)")
    token_dtype: str = setting(
        "auto", "dtype of the token file: `auto` (uint16 up to 65,536 ids, else uint32), `uint16`, `uint32`")
    validation_fraction: float = setting(
        0.05, "the last fraction of the tokens that forms the validation split (0: none; then set "
        "`trainer.eval_every=0`)")
    num_proc: Optional[int] = setting(
        None, "processes that tokenise (`datasets.map`); unset: 1 below 64 MB of text, else min(4, cores)")
    eod_mask_loss: bool = setting(
        False, "give labels that are the end-of-document id zero loss weight (Megatron-LM's `--eod-mask-loss`); "
        "synthetic data uses its last id, vocab_size - 1, as end of document")


@dataclass
class OptimizerConfig:
    """AdamW settings; ``clip_grad`` <= 0 disables clipping."""

    name: str = setting(
        "adamw", "`torch.optim.AdamW` (weight decay on weight matrices only: never on norms and biases, on "
        "embeddings only with `decay_embeddings`)")
    lr: float = setting(0.003, "peak learning rate (reached at the end of the warm-up)")
    warmup_steps: int = setting(
        0, "linear warm-up steps: the n-th step (counted from 1, as on the console) uses lr * n / warmup_steps")
    lr_decay_style: str = setting(
        "constant", "after the warm-up: `constant` (lr), `linear` or `cosine` (from lr down to `min_lr` over the "
        "steps from `warmup_steps` to `decay_steps`, as Megatron-LM)")
    min_lr: float = setting(0.0, "the learning rate the decay ends at (0 <= min_lr <= lr)")
    decay_steps: Optional[int] = setting(
        None, "the lr is `min_lr` once this many steps are done (default `trainer.max_steps`); greater than "
        "`warmup_steps`")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    decay_embeddings: bool = setting(
        False, "weight decay also on the word and position embeddings and the output layer")
    beta1: float = setting(0.9, "AdamW beta1 (first-moment decay)")
    beta2: float = setting(0.95, "AdamW beta2 (second-moment decay)")
    eps: float = setting(1e-8, "AdamW epsilon")
    clip_grad: float = setting(
        1.0, "clip the global gradient norm (every parameter counted once across TP/PP/DP); <= 0 disables")
    distributed: bool = setting(
        False, "distributed optimizer (ZeRO-1 as Megatron-Core): gradients reduce-scattered over dp*cp, each rank "
        "keeps the fp32 main parameters and AdamW state of its shard only, parameters all-gathered after the step")
    bucket_size: int = setting(
        4_000_000, "elements per gradient bucket of the distributed optimizer (each padded to split evenly over dp*cp)")
    overlap_grad_reduce: bool = setting(
        True, "distributed optimizer: reduce-scatter each bucket as soon as its last gradient is ready, "
        "overlapping the rest of the backward")
    loss_scale: float = setting(
        65536.0, "fp16: the initial loss scale (halved on each overflow, which skips that step)")
    loss_scale_window: int = setting(1000, "fp16: good steps in a row before the loss scale doubles")
    min_loss_scale: float = setting(1.0, "fp16: the loss scale never goes below this")
    overlap_param_gather: bool = setting(
        True, "distributed optimizer: all-gather the updated parameters bucket by bucket in the background, "
        "each waited for just before the first forward that uses it")


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = setting(200, "optimizer steps")
    global_batch_size: int = setting(8, "sequences per step; divisible by micro_batch_size * dp")
    micro_batch_size: int = setting(1, "sequences per microbatch")
    seq_length: int = setting(64, "tokens per sequence (<= model.max_seq_length)")
    seed: int = setting(1234, "model initialisation and sample order")
    out_dir: Optional[str] = setting(None, "run directory (default `runs/<timestamp>`)")
    overwrite: bool = setting(
        False, "start over in a run directory that holds checkpoints: delete its checkpoints and TensorBoard logs "
        "first (without it, a run that does not resume that directory is refused there)")
    precision: str = setting(
        "fp32", "`fp32`, `fp64`, `bf16` or `fp16` (half-precision parameters, activations and messages; fp32 "
        "main parameters, gradient accumulation, loss and softmax statistics; fp16 adds dynamic loss scaling)")
    log_every: int = setting(10, "console line every N steps (and the first and last)")
    tensorboard: bool = setting(True, "write TensorBoard event files")
    trace: bool = setting(False, "record per-rank action timelines")
    stop_on_nonfinite: bool = setting(
        False, "stop with a one-line error at the first non-finite gradient norm (default: skip that step, "
        "count it in `train/skipped_steps`)")
    eval_every: int = setting(
        50, "validation loss (`val/loss`, `val/perplexity`) every N steps, through the schedule's forward-only "
        "path; 0 disables")
    eval_iters: int = setting(2, "global batches of the validation split per validation loss")
    checkpoints: bool = setting(
        True, "write checkpoints under `<run dir>/checkpoints` (every `save_every` steps, at the end, and when "
        "interrupted by SIGTERM/SIGINT)")
    save_every: int = setting(0, "also save every N steps; 0: only at the end and when interrupted")
    keep_last: int = setting(2, "complete checkpoints kept (older ones are deleted after a save)")
    resume_from: Optional[str] = setting(
        None, "a run directory (its latest complete checkpoint; logs continue there) or a checkpoint directory; "
        "any layout, schedule and optimizer sharding")


@dataclass
class LauncherConfig:
    """How workers are started (torchrun)."""

    nnodes: int = setting(1, "nodes")
    nproc_per_node: Optional[int] = setting(
        None, "workers per node (default world size / nnodes); nnodes * nproc_per_node must equal the world size")
    node_rank: int = setting(0, "this node's rank (multi-node)")
    rdzv_endpoint: Optional[str] = setting(
        None, "`host:port` of the c10d rendezvous (required with nnodes > 1); unset on one node: the run hosts its "
        "own on a free port")
    rdzv_id: Optional[str] = setting(None, "rendezvous id, the same on every node of a job (default `ppctl`)")
    backend: str = setting(
        "auto", "`auto` (NCCL when CUDA has a GPU per local worker, else gloo), `gloo`, `nccl`")
    threads_per_worker: Optional[int] = setting(None, "intra-op threads per worker (default cores / local workers)")
    timeout_s: int = setting(
        120, "process-group and point-to-point timeout: a stuck collective or receive fails naming the rank and "
        "the wait instead of hanging")
    shutdown_timeout_s: int = setting(
        60, "after SIGTERM/SIGINT (Ctrl-C): how long workers get to finish the step and save a checkpoint before "
        "`ppctl` kills what is left")
    inject_fault: Optional[str] = setting(
        None, "testing aid: `RANK:raise` or `RANK:kill` makes that rank fail on purpose")


@dataclass
class PpctlConfig:
    """The whole configuration tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self) -> None:
        # An unset vpp follows the schedule's placement, so `schedule=zbv parallel.pp=2` needs no vpp.
        if self.parallel.vpp is None:
            spec = _schedule_specs().get(self.schedule.name)
            self.parallel.vpp = spec.chunks_per_rank if spec is not None and spec.chunks_per_rank else 1
        # An unset vocabulary follows the tokenizer, so the resolved config.yaml holds the number.
        if self.model.vocab_size is None:
            self.model.vocab_size = tokenizer_vocab_size(self.data)


SCHEMA_GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
}

# ---------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------


PRIMARY_CONFIG = "config"  # the primary config's name, ppctl's and a user tree's by default
PACKAGE_PRIMARY = "ppctl_config"  # ppctl's primary config, also kept in Hydra's ConfigStore under this name


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    store.store(name="ppctl_schema", node=PpctlConfig)
    for group, node in SCHEMA_GROUPS.items():
        store.store(group=group, name=f"{group}_schema", node=node)
    # A user tree without a primary config composes on ppctl's. Hydra looks the primary up before it adds
    # ppctl's folder to the search path (and remembers that it found none), but the ConfigStore is searched from
    # the start; its group defaults are still looked up in the user's tree first.
    store.store(name=PACKAGE_PRIMARY, node=OmegaConf.load(PACKAGE_CONF_DIR / f"{PRIMARY_CONFIG}.yaml"))


def compose_config(
    overrides: list[str] | None = None,
    config_dir: str | os.PathLike | None = None,
    config_name: str = "config",
) -> PpctlConfig:
    """Compose the Hydra config with ``overrides`` into a typed ``PpctlConfig``.

    ``config_dir`` is a user's own config tree; ppctl's groups stay on the search path
    behind it, so a user tree may hold only what it changes (one group file is enough:
    without a ``config.yaml`` of its own it composes on ppctl's). Raises ``ConfigError``
    with one line for unknown keys, bad types, missing files and YAML or override syntax
    errors (those name the file or the override, the line and the column).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    _register_schema()
    primary = Path(config_dir).resolve() if config_dir else PACKAGE_CONF_DIR
    if not primary.is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such directory")
    name = primary_config_name(primary, config_dir, config_name)
    extra = [f"hydra.searchpath=[file://{PACKAGE_CONF_DIR}]"] if config_dir else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None):
            composed = compose(config_name=name, overrides=list(overrides or []) + extra)
        composed = OmegaConf.merge(OmegaConf.structured(PpctlConfig), _without_hydra(composed))
        return OmegaConf.to_object(composed)
    except ConfigError:
        raise
    except Exception as error:  # Hydra and OmegaConf errors are many classes; report one line
        raise ConfigError(_one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()


def _without_hydra(composed: Any) -> Any:
    from omegaconf import OmegaConf, open_dict

    with open_dict(composed):
        composed.pop("hydra", None)
    return OmegaConf.create(OmegaConf.to_container(composed, resolve=True))


def primary_config_name(primary: Path, config_dir: str | os.PathLike | None, config_name: str) -> str:
    """The primary config to compose: ``config_name`` from ``primary``, or ppctl's own when a user tree has no
    ``config.yaml`` (and no other name was asked for); ``ConfigError`` when the asked-for file is missing."""
    file = primary / f"{config_name.removesuffix('.yaml')}.yaml"
    if file.is_file():
        return config_name
    if config_dir is not None and config_name.removesuffix(".yaml") == PRIMARY_CONFIG:
        return PACKAGE_PRIMARY
    where = f"--config-dir {config_dir}" if config_dir is not None else f"ppctl's configs ({primary})"
    raise ConfigError(f"--config-name {config_name}: no {file.name} in {where}")


def _one_line(error: BaseException) -> str:
    """Fold a Hydra/OmegaConf error (often several lines, often chained) into one line.

    A YAML syntax error names its file, line and column; an override that does not parse names
    itself and the column; a cause that only repeats the error is said once.
    """
    located = _yaml_problem(error) or _override_problem(error)
    if located is not None:
        return located
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if "Available options" in str(error):
        options = [line for line in lines[1:] if not line.endswith(":") and "_schema" not in line]
        options = options[: next((i for i, line in enumerate(options) if "=" in line), len(options))]
        return f"{text.rstrip('.:')}; available: {', '.join(options)}"
    # Hydra's wrapper names OmegaConf's exception class; the cause says what is wrong in plain words.
    text = re.sub(r":?\s*\w+ raised while composing config:?", ":", text)
    cause = error.__cause__ or error.__context__
    cause_line = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    # OmegaConf chains a key error to its own copy, and Hydra repeats a parse error's message in its cause.
    if cause_line and cause_line not in text:
        text = f"{text.rstrip('.:')}: {cause_line}"
    return text.rstrip(":")


def _in_chain(error: BaseException, kind: type) -> BaseException | None:
    """The first exception of type ``kind`` in ``error``'s chain (its causes and contexts), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _yaml_problem(error: BaseException) -> str | None:
    """``FILE, line L, column C: invalid YAML: ...`` for a YAML syntax error in ``error``'s chain, else None."""
    import yaml

    found = _in_chain(error, yaml.MarkedYAMLError)
    if found is None:
        return None
    mark = found.problem_mark or found.context_mark
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    text = f"{where}: invalid YAML: {found.problem or found.context}"
    opened = found.context_mark
    if found.problem and found.context and opened is not None and opened is not mark:
        # e.g. "while parsing a flow sequence" that began further up: say where, it is what to fix
        text += f" ({found.context} that begins at line {opened.line + 1}, column {opened.column + 1})"
    return text


OVERRIDE_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _override_problem(error: BaseException) -> str | None:
    """``override TEXT: cannot parse it at column C: ...`` for an override Hydra's grammar refused, else None."""
    from hydra.errors import OverrideParseException

    found = _in_chain(error, OverrideParseException)
    if found is None:
        return None
    text = found.override
    located = override_syntax_error(text)
    if located is None:  # the grammar accepted it; Hydra refused it while reading the value
        reason = next((line.strip() for line in found.message.splitlines() if line.strip()), "")
        return f"override {text}: {reason}"
    column, reason = located
    at = f"column {column + 1}" + (" (its end)" if column >= len(text) else "")
    return f"override {text}: cannot parse it at {at}: {reason} (the override grammar: {OVERRIDE_GRAMMAR})"


def override_syntax_error(text: str) -> tuple[int, str] | None:
    """Where Hydra's override grammar first fails on ``text``: (0-based column, the parser's words), or None.

    Hydra's own error keeps the parser's words but drops the column, so the override is parsed
    again here with a listener that keeps both.
    """
    try:
        from antlr4 import CommonTokenStream, InputStream
        from antlr4.error.ErrorListener import ErrorListener
        from hydra.grammar.gen.OverrideLexer import OverrideLexer
        from hydra.grammar.gen.OverrideParser import OverrideParser
    except ImportError:  # another Hydra layout: the message goes without a column
        return None

    class SyntaxFound(Exception):
        pass

    class Listener(ErrorListener):
        def syntaxError(self, recognizer, offending_symbol, line, column, msg, e):
            raise SyntaxFound(column, msg)

    lexer = OverrideLexer(InputStream(text))
    parser = OverrideParser(CommonTokenStream(lexer))
    for stage in (lexer, parser):
        stage.removeErrorListeners()
        stage.addErrorListener(Listener())
    try:
        parser.override()
    except SyntaxFound as found:
        return found.args[0], found.args[1]
    except Exception:  # this runs while reporting another error: never let it hide that one
        return None
    return None


def to_yaml(config: PpctlConfig) -> str:
    """The resolved config as YAML (saved as ``config.yaml`` in each run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_config_file(path: str | os.PathLike) -> PpctlConfig:
    """Read a resolved ``config.yaml`` back into a typed ``PpctlConfig``."""
    from omegaconf import OmegaConf

    loaded = OmegaConf.merge(OmegaConf.structured(PpctlConfig), OmegaConf.load(path))
    return OmegaConf.to_object(loaded)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

POSITION_EMBEDDINGS = ("learned", "rope")
PRECISIONS_READY = ("fp32", "fp64", "bf16", "fp16")
PRECISIONS_LATER = ()
DATA_SOURCES = ("python_stdlib", "text", "synthetic")
SYNTHETIC_VOCAB_SIZE = 257  # synthetic data's default vocabulary: the byte tokenizer's
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class DerivedSizes:
    """Numbers that follow from a valid config."""

    world_size: int
    num_microbatches: int
    padded_vocab_size: int
    nproc_per_node: int


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up to a multiple of ``divisible_by * tp`` (Megatron's padding)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def layout_of(config: PpctlConfig) -> ParallelLayout:
    """The ``ParallelLayout`` a config describes, with the schedule's stage placement."""
    parallel = config.parallel
    spec = schedule_spec(config)
    try:
        return ParallelLayout(
            tp=parallel.tp, cp=parallel.cp, dp=parallel.dp, pp=parallel.pp, vpp=parallel.vpp, order=parallel.order,
            placement=spec.placement(parallel.pp, parallel.vpp),
        )
    except (LayoutError, PlacementError) as error:
        raise ConfigError(str(error)) from None


def config_layer_map(config: PpctlConfig):
    """``{(pp_rank, chunk): StageLayers}`` for the configured model, split and schedule placement."""
    return layout_of(config).layer_map(config.model.num_layers, config.parallel.pipeline_layout)


def validate(config: PpctlConfig, layer_split: bool = True) -> DerivedSizes:
    """Check every cross-setting rule; return derived sizes or raise ``ConfigError`` (one line).

    Every command runs this before anything starts. An implemented schedule is also
    built and proved by the schedule checker (complete, and it runs under NCCL-like sends).
    ``layer_split=False`` leaves out whether the model's layers divide into the stages
    (``inspect-schedule`` draws a schedule, whatever the model).
    """
    _check_positive(config)
    _check_schedule_chunks(config)
    layout = layout_of(config)
    if layer_split:
        _check_layer_split(config, layout)
    _check_model(config)
    _check_batch(config, layout)
    _check_schedule(config)
    _check_misc(config)
    _check_lr_schedule(config)
    _check_schedule_plan(config)
    return DerivedSizes(
        world_size=layout.world_size,
        num_microbatches=num_microbatches(config),
        padded_vocab_size=padded_vocab_size(
            config.model.vocab_size, config.model.make_vocab_size_divisible_by, config.parallel.tp
        ),
        nproc_per_node=nproc_per_node(config),
    )


def _check_layer_split(config: PpctlConfig, layout: ParallelLayout) -> None:
    try:
        split_layers(config.model.num_layers, layout.placement.stages_per_copy, config.parallel.pipeline_layout)
    except LayoutError as error:
        raise ConfigError(str(error)) from None


def _check_schedule_plan(config: PpctlConfig) -> None:
    """Build an implemented schedule and run the checker on it (the same proof the workers rely on)."""
    from ppctl.pipeline.check import check_schedule
    from ppctl.pipeline.schedules import ScheduleError, build_schedule

    spec, parallel = schedule_spec(config), config.parallel
    if not spec.implemented:
        return
    try:
        check_schedule(build_schedule(spec.name, parallel.pp, parallel.vpp, num_microbatches(config)))
    except ScheduleError as error:
        raise ConfigError(f"schedule {spec.name}: {error}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


POSITIVE_FIELDS = {
    "model": ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_length",
              "make_vocab_size_divisible_by"),
    "parallel": ("tp", "pp", "vpp", "dp", "cp"),
    "trainer": ("max_steps", "global_batch_size", "micro_batch_size", "seq_length", "log_every", "eval_iters",
                "keep_last"),
    "launcher": ("nnodes", "timeout_s", "shutdown_timeout_s"),
    "optimizer": ("bucket_size", "loss_scale_window"),
}


def _check_positive(config: PpctlConfig) -> None:
    for section, names in POSITIVE_FIELDS.items():
        for name in names:
            value = getattr(getattr(config, section), name)
            _require(value >= 1, f"{section}.{name}={value} must be a positive integer")
    for name in ("nproc_per_node", "threads_per_worker"):
        value = getattr(config.launcher, name)
        _require(value is None or value >= 1, f"launcher.{name}={value} must be a positive integer")
    _require(config.optimizer.lr > 0, f"optimizer.lr={config.optimizer.lr} must be positive")
    optimizer = config.optimizer
    _require(0 < optimizer.min_loss_scale <= optimizer.loss_scale,
             f"optimizer.min_loss_scale={optimizer.min_loss_scale} must be > 0 and <= "
             f"optimizer.loss_scale={optimizer.loss_scale}")
    _require(config.trainer.seed >= 0, f"trainer.seed={config.trainer.seed} must be >= 0")
    for name in ("eval_every", "save_every"):
        value = getattr(config.trainer, name)
        _require(value >= 0, f"trainer.{name}={value} must be >= 0 (0 disables)")
    _require(config.optimizer.weight_decay >= 0, "optimizer.weight_decay must be >= 0")


def _check_model(config: PpctlConfig) -> None:
    model, parallel = config.model, config.parallel
    _require(
        model.hidden_size % model.num_heads == 0,
        f"model.hidden_size={model.hidden_size} must be divisible by model.num_heads={model.num_heads}",
    )
    _require(
        model.num_heads % parallel.tp == 0,
        f"model.num_heads={model.num_heads} must be divisible by parallel.tp={parallel.tp}",
    )
    _require(
        model.ffn_hidden_size % parallel.tp == 0,
        f"model.ffn_hidden_size={model.ffn_hidden_size} must be divisible by parallel.tp={parallel.tp}",
    )
    _require(
        model.position_embedding in POSITION_EMBEDDINGS,
        f"model.position_embedding={model.position_embedding!r} must be one of {', '.join(POSITION_EMBEDDINGS)}",
    )
    if model.position_embedding == "rope":
        _require((model.hidden_size // model.num_heads) % 2 == 0, "model.position_embedding=rope needs an even head dim")
    _check_context_parallel_attention(config)


def _check_context_parallel_attention(config: PpctlConfig) -> None:
    """The CP communication mode exists, and a2a can split each TP rank's heads over the CP ranks."""
    model, parallel = config.model, config.parallel
    _require(parallel.cp_comm in CP_COMM_MODES,
             f"parallel.cp_comm={parallel.cp_comm!r} must be one of {', '.join(CP_COMM_MODES)}")
    if parallel.cp > 1 and parallel.cp_comm == "a2a":
        _require(
            model.num_heads % (parallel.tp * parallel.cp) == 0,
            f"parallel.cp_comm=a2a splits heads over tp*cp: model.num_heads={model.num_heads} must be divisible "
            f"by parallel.tp * parallel.cp = {parallel.tp * parallel.cp}",
        )


def message_seq_length(config: PpctlConfig) -> int:
    """Tokens of each sequence a rank holds between blocks, so in one pipeline message.

    A CP rank's part of the sequence (seq_length / cp), and with sequence parallelism
    a TP rank's part of that.
    """
    parallel = config.parallel
    tokens = config.trainer.seq_length // parallel.cp
    return tokens // parallel.tp if parallel.sequence_parallel else tokens


def _check_batch_division(config: PpctlConfig) -> None:
    trainer, parallel = config.trainer, config.parallel
    per_step = trainer.micro_batch_size * parallel.dp
    _require(
        trainer.global_batch_size % per_step == 0,
        f"trainer.global_batch_size={trainer.global_batch_size} must be divisible by "
        f"trainer.micro_batch_size * parallel.dp = {per_step}",
    )


def _check_batch(config: PpctlConfig, layout: ParallelLayout) -> None:
    trainer, parallel = config.trainer, config.parallel
    _check_batch_division(config)
    _require(
        trainer.seq_length <= config.model.max_seq_length,
        f"trainer.seq_length={trainer.seq_length} must not exceed model.max_seq_length={config.model.max_seq_length}",
    )
    if parallel.cp > 1:
        _require(
            trainer.seq_length % (2 * parallel.cp) == 0,
            f"trainer.seq_length={trainer.seq_length} must be divisible by 2 * parallel.cp = {2 * parallel.cp}",
        )
    if parallel.sequence_parallel:
        _require(parallel.tp > 1, "parallel.sequence_parallel=true needs parallel.tp > 1")
        # SP splits each CP rank's tokens (seq_length / cp of them) over the TP ranks.
        _require(
            trainer.seq_length % (parallel.cp * parallel.tp) == 0,
            f"trainer.seq_length={trainer.seq_length} must be divisible by parallel.cp * parallel.tp = "
            f"{parallel.cp * parallel.tp} with sequence parallelism",
        )
    world = layout.world_size
    _require(
        config.launcher.nnodes * nproc_per_node(config) == world,
        f"launcher.nproc_per_node * launcher.nnodes = {config.launcher.nnodes * nproc_per_node(config)} must equal "
        f"the world size tp*cp*dp*pp = {world}",
    )


def _schedule_specs() -> dict:
    from ppctl.pipeline.schedules import SCHEDULE_SPECS

    return SCHEDULE_SPECS


def schedule_spec(config: PpctlConfig):
    """The registry entry of the configured schedule, or ``ConfigError`` naming the known ones."""
    specs, name = _schedule_specs(), config.schedule.name
    _require(name in specs, f"schedule.name={name!r} is unknown; choose one of {', '.join(specs)}")
    return specs[name]


def _check_schedule_chunks(config: PpctlConfig) -> None:
    """The chunks per rank the schedule's placement allows: one, several (looped), or exactly two (a V)."""
    spec, vpp = schedule_spec(config), config.parallel.vpp
    _require(spec.placement is not None,
             f"schedule {spec.name}: its stage placement is not implemented yet; available: "
             f"{', '.join(name for name, other in _schedule_specs().items() if other.placement is not None)}")
    if spec.chunks_per_rank is not None:
        _require(vpp == spec.chunks_per_rank,
                 f"parallel.vpp={vpp}: schedule {spec.name} places exactly {spec.chunks_per_rank} chunks on each "
                 f"rank ({spec.placement_name}); set parallel.vpp={spec.chunks_per_rank}")
        return
    _require(
        vpp == 1 or spec.multi_chunk,
        f"parallel.vpp={vpp} needs a schedule with several chunks per rank (e.g. interleaved_1f1b); "
        f"schedule {spec.name} uses one",
    )


def _check_schedule(config: PpctlConfig) -> None:
    spec, parallel = schedule_spec(config), config.parallel
    error = spec.microbatch_error(parallel.pp, parallel.vpp, num_microbatches(config))
    _require(error is None, f"schedule {spec.name}: {error}")


def check_runnable(config: PpctlConfig) -> None:
    """Refuse what validates but cannot be trained yet (features of later issues), one line each."""
    from ppctl.pipeline.schedules import SCHEDULE_SPECS

    spec = SCHEDULE_SPECS[config.schedule.name]
    _require(spec.implemented, f"schedule.name={config.schedule.name} is not implemented yet; "
             f"available: {', '.join(n for n, s in SCHEDULE_SPECS.items() if s.implemented)}")
    _require(
        config.trainer.precision in PRECISIONS_READY,
        f"trainer.precision={config.trainer.precision} is not implemented yet; use one of {', '.join(PRECISIONS_READY)}",
    )


def _check_misc(config: PpctlConfig) -> None:
    precisions = PRECISIONS_READY + PRECISIONS_LATER
    _require(
        config.trainer.precision in precisions,
        f"trainer.precision={config.trainer.precision!r} must be one of {', '.join(precisions)}",
    )
    _check_data(config)
    _require(
        config.launcher.backend in BACKENDS,
        f"launcher.backend={config.launcher.backend!r} must be one of {', '.join(BACKENDS)}",
    )
    fault = config.launcher.inject_fault
    if fault:
        rank, _, kind = fault.partition(":")
        _require(rank.isdigit() and kind in ("raise", "kill"), "launcher.inject_fault must look like RANK:raise or RANK:kill")
    if config.launcher.nnodes > 1:
        _require(bool(config.launcher.rdzv_endpoint), "launcher.nnodes > 1 needs launcher.rdzv_endpoint (host:port)")
    if config.launcher.rdzv_endpoint:
        parse_endpoint(config.launcher.rdzv_endpoint)
    _require(
        0 <= config.launcher.node_rank < config.launcher.nnodes,
        f"launcher.node_rank={config.launcher.node_rank} must be in 0..launcher.nnodes-1",
    )


DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port when the endpoint names none


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """The host and port of ``launcher.rdzv_endpoint`` (``host:port``, ``[v6 address]:port``; no port: torchrun's
    29400), or ``ConfigError``."""
    text = endpoint.strip()
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon or (":" in host and not host.startswith("[")):  # no port, or a bare IPv6 address
        host, port = text, str(DEFAULT_RDZV_PORT)
    host = host.removeprefix("[").removesuffix("]")
    _require(bool(host) and port.isdigit() and int(port) < 1 << 16,
             f"launcher.rdzv_endpoint={endpoint!r} must be host:port with a port from 0 to 65535")
    return host, int(port)


def tokenizer_vocab_size(data: DataConfig) -> int:
    """The ids the configured tokenizer emits, end of document included (synthetic data: ``SYNTHETIC_VOCAB_SIZE``)."""
    if data.source == "synthetic":
        return SYNTHETIC_VOCAB_SIZE
    from ppctl.data.tokenizer import build_tokenizer

    try:
        return build_tokenizer(data.tokenizer).vocab_size
    except (OSError, ValueError) as error:
        raise ConfigError(str(error)) from None


def _check_data(config: PpctlConfig) -> None:
    """The data source exists, its tokenizer fits the vocabulary and the token dtype, the split can be made."""
    data, trainer = config.data, config.trainer
    _require(data.source in DATA_SOURCES, f"data.source={data.source!r} must be one of {', '.join(DATA_SOURCES)}")
    _require(0 <= data.validation_fraction < 1,
             f"data.validation_fraction={data.validation_fraction} must be >= 0 and < 1")
    _require(data.num_proc is None or data.num_proc >= 1, f"data.num_proc={data.num_proc} must be a positive integer")
    if data.source == "synthetic":
        return
    _require(data.validation_fraction > 0 or trainer.eval_every == 0,
             f"data.validation_fraction={data.validation_fraction} leaves no validation split but "
             f"trainer.eval_every={trainer.eval_every}; set trainer.eval_every=0 or raise data.validation_fraction")
    from ppctl.data.prepare import CorpusSpec, token_dtype_for

    vocab_size = tokenizer_vocab_size(data)
    try:
        CorpusSpec.of(data).corpus()  # the files exist, are of one type; a hub name is tried when preparing
        token_dtype_for(data.token_dtype, vocab_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _require(config.model.vocab_size >= vocab_size,
             f"model.vocab_size={config.model.vocab_size} is smaller than the {vocab_size} ids of data.tokenizer="
             f"{data.tokenizer}; set model.vocab_size >= {vocab_size} or leave it unset to follow the tokenizer")


def _check_lr_schedule(config: PpctlConfig) -> None:
    """The learning-rate schedule's settings (see ``ppctl.optim.lr``)."""
    optimizer = config.optimizer
    _require(optimizer.lr_decay_style in DECAY_STYLES,
             f"optimizer.lr_decay_style={optimizer.lr_decay_style!r} must be one of {', '.join(DECAY_STYLES)}")
    _require(optimizer.warmup_steps >= 0, f"optimizer.warmup_steps={optimizer.warmup_steps} must be >= 0")
    _require(0 <= optimizer.min_lr <= optimizer.lr,
             f"optimizer.min_lr={optimizer.min_lr} must be >= 0 and <= optimizer.lr={optimizer.lr}")
    if optimizer.decay_steps is not None:
        _require(optimizer.decay_steps > optimizer.warmup_steps,
                 f"optimizer.decay_steps={optimizer.decay_steps} must be greater than "
                 f"optimizer.warmup_steps={optimizer.warmup_steps}")
    else:  # the decay defaults to the whole run, which must outlast the warm-up too
        _require(config.trainer.max_steps > optimizer.warmup_steps,
                 f"optimizer.warmup_steps={optimizer.warmup_steps} must be less than optimizer.decay_steps "
                 f"(default trainer.max_steps={config.trainer.max_steps})")


def num_microbatches(config: PpctlConfig) -> int:
    """Microbatches per DP rank per step."""
    trainer = config.trainer
    return max(1, trainer.global_batch_size // (trainer.micro_batch_size * config.parallel.dp))


def nproc_per_node(config: PpctlConfig) -> int:
    """Workers per node (default: the world size split evenly over the nodes)."""
    if config.launcher.nproc_per_node is not None:
        return config.launcher.nproc_per_node
    world = config.parallel.tp * config.parallel.cp * config.parallel.dp * config.parallel.pp
    return max(1, world // config.launcher.nnodes)


# ---------------------------------------------------------------------------
# Reference table (the key table of docs/configuration.md is generated from the schema)
# ---------------------------------------------------------------------------


def render_default(value: Any) -> str:
    """A default as docs/configuration.md shows it: ``null``, ``true``/``false``, numbers as written, strings in
    backticks."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))  # 1e-05 -> 1e-5
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def config_reference() -> list[tuple[str, Any, str]]:
    """``(section.key, default, meaning)`` for every schema field, in schema order."""
    rows = []
    for section in fields(PpctlConfig):
        for item in fields(section.default_factory):
            rows.append((f"{section.name}.{item.name}", item.default, item.metadata["doc"]))
    return rows


def config_reference_table() -> str:
    """The markdown table ``| key | default | meaning |`` of every field (docs/configuration.md's, between its
    markers)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in config_reference():
        meaning = doc.replace("|", r"\|")  # a pipe inside a cell would split it
        lines.append(f"| `{key}` | {render_default(default)} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m ppctl.config: print the table to paste into docs/configuration.md
    print(config_reference_table(), end="")
