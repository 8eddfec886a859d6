"""The configuration schema: typed dataclasses, each field with its default and its one-line meaning.

The tree is ``PpctlConfig`` (model, parallel, schedule, data, optimizer, trainer, launcher), registered
in Hydra's ConfigStore by ``ppctl.resolve.compose`` so that a misspelled key or a wrong type is refused
while composing. The schema also names the values some fields allow (``POSITION_EMBEDDINGS``,
``PRECISIONS``, ``DATA_SOURCES``, ``BACKENDS``) and ``ConfigError``.

This module imports nothing of ppctl's (``tests/unit/test_layering.py`` checks it): what a default or a
doc string says about another part of ppctl is written here literally, and
``tests/unit/test_config_schema.py`` checks that it still agrees with that part. The two settings that
follow another part when unset (``parallel.vpp``, ``model.vocab_size``) are left ``None`` here and
filled where a config is composed or read (``ppctl.config.derived.fill_unset``).

Every float setting is a finite number (``ppctl.resolve.validate`` refuses inf and nan by name, whatever the
setting), and within the range its doc string gives; an integer setting that may be unset is a positive number or
``null``, never 0 for "unset".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

# The values some fields allow (validation refuses others; their doc strings name them).
POSITION_EMBEDDINGS = ("learned", "rope")
RECOMPUTE_MODES = ("none", "full", "selective")  # ppctl.model.recompute
RECOMPUTE_METHODS = ("uniform", "block")
PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
DATA_SOURCES = ("python_stdlib", "text", "chat", "prompt_completion", "indexed", "synthetic")
BAD_ROWS = ("refuse", "skip")
TOO_LONG = ("truncate", "refuse")
PACKINGS = ("packed", "padded")
DOCUMENTS_MODES = ("joined", "separate")  # data.documents (ppctl.data.dataset, ppctl.model.attention_mask)
BACKENDS = ("auto", "gloo", "nccl")
BALANCE_MODES = ("even", "auto")  # parallel.balance (ppctl.plan.balance)
ROUTER_SCORES = ("softmax", "sigmoid")  # model.moe.router_score (ppctl.model.moe.router)
DROP_POLICIES = ("probs", "position")  # model.moe.drop_policy
LAUNCHERS = ("local", "slurm")  # launcher.kind: ppctl train starts the workers, or ppctl submit hands a job to Slurm
SYNTHETIC_VOCAB_SIZE = 257  # synthetic data's default vocabulary: the byte tokenizer's


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the setting and the rule."""


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


class FrozenConfigError(AttributeError):
    """A setting assigned after its config was resolved (``freeze``): the config is read-only from then on."""


class Section:
    """A config section: its settings may be assigned until ``freeze``, then reading is all it allows."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise FrozenConfigError(f"{type(self).__name__}.{name}: the config was resolved and is read-only; "
                                    f"build a changed copy (dataclasses.replace) and resolve that")
        object.__setattr__(self, name, value)


def freeze(config: Any) -> None:
    """Make a config and each of its sections read-only (``ppctl.resolve.resolved.resolve`` calls this)."""
    for value in vars(config).values():
        if isinstance(value, Section):
            freeze(value)
    object.__setattr__(config, "_frozen", True)


def default_of(section: type, name: str) -> Any:
    """The schema default of setting ``name`` of a section class (``default_of(ModelConfig, "rope_theta")``): what
    a key a model does not read must keep."""
    return next(item.default for item in fields(section) if item.name == name)


def setting(default: Any, doc: str) -> Any:
    """A schema field with its default and its one-line meaning (``metadata["doc"]``, shown in
    docs/configuration.md)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class MoEConfig(Section):
    """Mixture of experts (``model.moe``, Megatron-Core's ``--num-experts`` and ``--moe-*``): which layers' MLP is a
    routed set of experts, and how tokens are routed (see docs/models.md)."""

    num_experts: int = setting(0, "routed experts of each MoE layer; 0: a dense model (every other `model.moe` key "
                                  "unread)")
    topk: int = setting(2, "experts each token is routed to (1 <= topk <= num_experts)")
    expert_ffn_hidden_size: Optional[int] = setting(
        None, "inner width of one expert's MLP (and of one shared expert); unset: `model.ffn_hidden_size`")
    layer_freq: int = setting(
        1, "every `layer_freq`-th layer after the first `first_dense_layers` is an MoE layer (1: all of them)")
    first_dense_layers: int = setting(0, "the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)")
    shared_experts: int = setting(
        0, "experts every token goes through besides its routed ones, run as one MLP of width "
        "`shared_experts * expert_ffn_hidden_size` (DeepSeek's n_shared_experts)")
    shared_expert_gate: bool = setting(
        False, "with `shared_experts`: each token's shared-expert output scaled by sigmoid(w . x), one learned "
        "vector w per MoE layer (Qwen2-MoE's shared_expert_gate); false: added whole (DeepSeek)")
    router_score: str = setting(
        "softmax", "the router's scores of its logits: `softmax` (over the experts, Mixtral) or `sigmoid` (each "
        "expert alone, DeepSeek-V3)")
    router_topk_norm: bool = setting(
        False, "divide each token's top-k scores by their sum before weighing the experts' outputs (Mixtral's "
        "softmax over the chosen ones, DeepSeek-V3's sigmoid router)")
    aux_loss_coeff: float = setting(
        0.0, "weight of the load-balancing loss, num_experts * sum_i f_i * P_i per microbatch (Switch/GShard)")
    z_loss_coeff: float = setting(0.0, "weight of the router z-loss, the mean of logsumexp(logits)^2 per microbatch")
    expert_bias: bool = setting(
        False, "aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k "
        "choice only, moved after each step by `expert_bias_update_rate` towards the mean load; saved in "
        "checkpoints, not trained")
    expert_bias_update_rate: float = setting(
        1e-3, "with `expert_bias`: the step of each update, bias += rate * sign(mean load - expert's load)")
    capacity_factor: Optional[float] = setting(
        None, "each expert takes at most ceil(capacity_factor * tokens * topk / num_experts) of a microbatch's "
        "tokens, the rest dropped by `drop_policy`; unset: dropless")
    drop_policy: str = setting(
        "probs", "with `capacity_factor`: which of an expert's tokens it keeps, those of the highest routing "
        "weight (`probs`) or the first in the microbatch (`position`)")


@dataclass
class ModelConfig(Section):
    """The model settings every family reads alike. A family's own keys are its subclass of this one
    (``ppctl/model/<family>/settings.py``); the composed ``config.model`` is an instance of the selected family's.
    ``vocab_size`` follows the tokenizer unless set; it is padded for TP (see ``padded_vocab_size``)."""

    name: str = setting("gpt_tiny", "a label for logs")
    family: str = setting(
        "gpt", "the model family: a folder under `ppctl/model/` (`gpt`: GPT-2-shaped; `llama`: RMSNorm, SwiGLU, "
        "grouped-query attention, rotary; see docs/models.md)")
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
    rope_theta: float = setting(
        10000.0, "base of the rotary frequencies, > 0 (`position_embedding=rope`, and `llama`; with learned "
        "positions it is read by nothing, and a changed value is refused)")
    qkv_bias: bool = setting(
        False, "biases on the query, key and value projections (`gpt`: on the fused QKV, GPT-2's `c_attn.bias`; "
        "`llama`: Qwen2's q/k/v biases); a `model.init_from` folder gives its own (every GPT-2 has it), and one set "
        "must be the same")
    position_embedding: str = setting("learned", "`learned` or `rope` (rotary)")
    tie_embeddings: bool = setting(
        False, "output layer shares the word embedding (across stages: gradients all-reduced over the "
        "`embedding` group)")
    norm_epsilon: float = setting(1e-5, "LayerNorm (RMSNorm with `llama`) epsilon, > 0")
    init_std: float = setting(
        0.02, "std of the normal initialisation, >= 0 (layout independent: seeded by (seed, parameter name))")
    init_from: Optional[str] = setting(
        None, "a Hugging Face model folder (`config.json`, safetensors) to start from instead of `init_std`, at any "
        "layout. Alone it gives every `model.*` key (with the default model preset) and `data.tokenizer` (its "
        "`tokenizer.json`, if any); a key set, or a preset chosen, must be the folder's (checked before any worker "
        "starts; see docs/models.md); a run that resumes (`trainer.resume_from`) reads its checkpoint and ignores it")
    make_vocab_size_divisible_by: int = setting(64, "vocabulary padding unit (times tp)")
    recompute: str = setting(
        "none", "activation recomputation: `none`, `full` (groups of whole layers keep only their input and run "
        "again in the backward) or `selective` (only the attention core runs again)")
    recompute_method: str = setting(
        "uniform", "with `recompute=full`: `uniform` (groups of `recompute_num_layers` layers) or `block` (the "
        "first `recompute_num_layers` layers of each chunk, one by one)")
    recompute_num_layers: int = setting(1, "with `recompute=full`: layers per group (`uniform`) or recomputed "
                                           "layers per chunk (`block`)")
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig(Section):
    """Parallel sizes; world size = tp * cp * dp * pp."""

    tp: int = setting(1, "tensor-parallel size")
    pp: int = setting(2, "pipeline-parallel size (the `single` option sets 1)")
    vpp: Optional[int] = setting(
        None, "model chunks per pipeline rank: several with `interleaved_1f1b`, `looped_bfs` and "
        "`interleaved_zb`, 2 * `waves` with `hanayo`, exactly 2 with `zbv`, `v_half`, `v_min`, `dualpipe` and "
        "`dualpipev`, the file's with `custom`; unset: what the schedule places (2 for those five, else 1)")
    waves: Optional[int] = setting(
        None, "`hanayo` only: the waves, each taking the stages down the ranks and back up (2 * waves chunks "
        "per rank); unset: 1")
    dp: int = setting(1, "data-parallel size")
    cp: int = setting(1, "context-parallel size (seq_length divisible by 2*cp)")
    cp_comm: str = setting(
        "allgather", "how attention spans the CP group: `allgather` (keys and values gathered), `ring` "
        "(key/value blocks passed around the CP ring, overlapped with compute) or `a2a` (all-to-all to "
        "head-split, as DeepSpeed-Ulysses; num_heads divisible by tp*cp)")
    sequence_parallel: bool = setting(
        False, "Megatron sequence parallelism (needs tp > 1, seq_length divisible by cp*tp)")
    order: str = setting("tp-cp-dp-pp", "rank order, fastest-varying first (Megatron-Core's convention)")
    ep: int = setting(
        1, "expert-parallel size (MoE models): each MoE layer's experts split over `ep` ranks of a pipeline stage, "
        "tokens exchanged by all-to-all; the stage's tp * cp * dp ranks are folded as etp-ep-edp (Megatron-Core's "
        "MoE parallel folding), so `ep` divides them and the order ends in pp")
    etp: int = setting(1, "expert tensor-parallel size (only 1: experts are not split by TP)")
    overlap_ep_comm: bool = setting(
        False, "with `ep` > 1, interleave the two halves of each overlapped forward-backward pair (`dualpipe`, "
        "`dualpipev`): one piece computes at a time, the turn changing at each expert all-to-all, so that one's "
        "exchange travels while the other computes (DeepSeek-V3's overlap); and under a split backward (ZB, the V "
        "family) let each W beside a backward of another microbatch compute in that backward's all-to-all waits "
        "(weight fills); off by default: CPU workers that already fill their cores gain nothing "
        "(benchmarks/RESULTS.md)")
    pipeline_layout: Optional[str] = setting(
        None, "explicit per-stage split in Megatron-LM syntax, e.g. `Ettt|tttt|tttL` or `E(tt|)*3tL` (`t*3` and "
        "`(...)*N` repeat; a stage may be empty); default: even split, `num_layers` divisible by pp*vpp (by pp "
        "with `dualpipe`'s two model copies)")
    account_for_embedding_in_split: bool = setting(
        False, "even split counting the embedding as one layer (the first stage gets one transformer layer less)")
    account_for_loss_in_split: bool = setting(
        False, "even split counting the output layer and loss as one layer (the last stage gets one layer less)")
    balance: str = setting(
        "even", "how the layers split into stages without `pipeline_layout`: `even`, or `auto` (ppctl chooses the "
        "split that minimises the slowest pp rank's predicted time, from the FLOPs of the layers, the embedding and "
        "the output layer with the loss, and the schedule's placement; empty stages allowed)")
    balance_memory_gb: Optional[float] = setting(
        None, "`balance=auto` only: the GiB (2^30 bytes) every pp rank's predicted memory must fit; the split moves "
        "layers off a rank over it, or the config is refused; unset: no limit")


@dataclass
class ScheduleConfig(Section):
    """Which pipeline schedule runs the microbatches."""

    name: str = setting("1f1b", "the pipeline schedule")
    file: Optional[str] = setting(None, "`schedule=custom`: the schedule file, torch's compute-only CSV or ppctl's "
                                        "JSON (what `inspect-schedule --json` prints)")
    stream_steps: int = setting(8, "`schedule=pipedream_2bw`: steps run as one continuous stream, with no flush "
                                   "between them; after each stream the pipeline drains: logs are written, signals "
                                   "read, and checkpoints and validation taken when due (those cut a stream short)")


@dataclass
class BlendSource:
    """One source of a blend (``data.blend``): a token-file ``data.source`` with its ``data.path``, and its weight."""

    source: str = setting("text", "`text`, `chat`, `prompt_completion` or `indexed` (its `path`), or `python_stdlib`")
    path: Optional[str] = setting(None, "as `data.path`: a file, folder, glob or hub dataset name; for `indexed`, "
                                        "its pairs")
    weight: float = setting(1.0, "its share of the samples, relative to the others' (finite, > 0)")


@dataclass
class DataConfig(Section):
    """Where samples come from: ``python_stdlib`` (embedded default), ``text``, ``chat``, ``prompt_completion``,
    ``indexed`` or ``synthetic``."""

    source: str = setting(
        "python_stdlib", "`python_stdlib` (the standard library's source, one document per file), `text` (your "
        "corpus: `data.path`), `chat` (jsonl conversations, the loss on the assistant's tokens), "
        "`prompt_completion` (jsonl pairs, the loss on the completion), `indexed` (a Megatron-LM indexed dataset, "
        "`.idx` + `.bin`, read as it is: no preparation), `synthetic` (random tokens)")
    path: Optional[str] = setting(
        None, "for `text`: a file, a folder or a glob of `.txt` (one document per file), `.json`/`.jsonl`, "
        "`.parquet` or `.csv` files (one document per row), one type at a time; or a hub dataset name "
        "(`owner/name`, needs the network once); for `indexed`: the prefix of `PREFIX.idx` and `PREFIX.bin` (or "
        "either file's path), a folder of such pairs (not its subfolders; ppctl's own cache entry in its shards' "
        "order) or a glob (`corpus/part-*`; `**` descends), read as one corpus in name order")
    text_field: str = setting("text", "the field (column) holding the text in json, parquet and csv files")
    cache_dir: str = setting("data/cache", "where token files and their indexes are cached")
    tokenizer: str = setting(
        "byte", "`byte` (UTF-8 bytes, 256 = end of document) or the path of a Hugging Face `tokenizers` JSON file "
        "(end of document: its own end-of-text token, else a new id); unset with `model.init_from`: the folder's "
        "`tokenizer.json`, if it has one")
    token_dtype: str = setting(
        "auto", "dtype of the token file: `auto` (uint16 up to 65,536 ids, else uint32), `uint16`, `uint32`")
    validation_fraction: float = setting(
        0.05, "the last fraction of the tokens that forms the validation split (0: none; then set "
        "`trainer.eval_every=0`)")
    num_proc: Optional[int] = setting(
        None, "processes that tokenise, each taking the next shard; unset: 1 below 64 MB of input, else "
        "min(4, cores)")
    shard_mib: float = setting(
        64.0, "input MiB per shard of a prepared corpus: each shard is tokenised by one process, written as one "
        "Megatron-LM `.bin`/`.idx` pair, and kept when a preparation is interrupted")
    fingerprint: str = setting(
        "content", "what says a prepared text corpus is still its files': `content` (each file's SHA-256, read once "
        "and remembered by path, size and mtime) or `stat` (each file's size and mtime alone: nothing read, for "
        "corpora too large to hash in every task of a Slurm array; an edit that keeps both is not seen)")
    eod_mask_loss: bool = setting(
        False, "give labels that are the end-of-document id zero loss weight (Megatron-LM's `--eod-mask-loss`); "
        "synthetic data uses its last id, vocab_size - 1, as end of document")
    messages_field: str = setting(
        "messages", "`chat`: the field of each jsonl row holding its OpenAI-style messages (`role`, `content`)")
    chat_template: Optional[str] = setting(
        None, "`chat`: a tokenizer folder, its `tokenizer_config.json` or a `.jinja` file whose chat template "
        "renders the conversations (a folder's `chat_template.jinja` wins, as in transformers); unset: "
        "`data.tokenizer`'s folder")
    prompt_field: str = setting("prompt", "`prompt_completion`: the field holding the prompt")
    completion_field: str = setting("completion", "`prompt_completion`: the field holding the completion")
    packing: str = setting(
        "packed", "`chat`/`prompt_completion`: `packed` (rows one after the other, windows cut from the stream; "
        "with `data.documents=separate` attention stays inside each) or `padded` (one row per sample, padded to "
        "the window with the end-of-document id, weight 0)")
    too_long: str = setting(
        "truncate", "`chat`/`prompt_completion`: a row longer than `trainer.seq_length + 1` tokens is cut to it "
        "(`truncate`, counted in the summary) or refused naming its file and row (`refuse`)")
    bad_rows: str = setting(
        "refuse", "`chat`/`prompt_completion`: a bad row (no messages, an unknown role, a template that fails on it, "
        "no assistant turn, no prompt or completion) is refused naming its file and row (`refuse`) or skipped and "
        "counted (`skip`)")
    blend: list[BlendSource] = field(default_factory=list, metadata={"doc": (
        "several sources with weights, replacing `data.source` and `data.path`: a list of at least two "
        "`{path: ..., weight: ...}` (a `text` source), `{source: chat, path: ..., weight: ...}` (or "
        "`prompt_completion`) or `{source: python_stdlib, weight: ...}` entries, each weight "
        "finite and > 0 (default 1); each global batch draws from them in the weights' proportions (Megatron-Core's "
        "BlendedDataset), each source prepared and cached as one source is; see docs/data.md")})
    documents: str = setting(
        "joined", "`joined`: one token stream, attention and positions run across documents; `separate`: "
        "attention never crosses an end of document (block-causal), positions restart at each document, and the "
        "label after an end of document weighs zero (Megatron-LM's `--reset-attention-mask --reset-position-ids`); "
        "synthetic data ends a document at its last id, vocab_size - 1")


@dataclass
class OptimizerConfig(Section):
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
    beta1: float = setting(0.9, "AdamW beta1 (first-moment decay), 0 <= beta1 < 1")
    beta2: float = setting(0.95, "AdamW beta2 (second-moment decay), 0 <= beta2 < 1")
    eps: float = setting(1e-8, "AdamW epsilon, >= 0")
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
    gradient_delay: int = setting(
        0, "`1`: PipeDream-2BW's update W(t+1) = W(t) - lr * g_t(W(t-1)), each step's gradients computed on the "
        "weights before the last update (two weight versions); `0`: the usual W(t+1) = W(t) - lr * g_t(W(t))")


@dataclass
class TrainerConfig(Section):
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
    allow_tf32: bool = setting(
        False, "CUDA only: fp32 matmuls and convolutions in TF32 (10 mantissa bits: faster on Ampere and later, "
        "with about a half-precision error, so fp32 runs no longer match one process to fp32's tolerance)")
    stop_on_nonfinite: bool = setting(
        False, "stop with a one-line error at the first non-finite gradient norm (default: skip that step, "
        "count it in `train/skipped_steps`)")
    max_skipped_steps: int = setting(
        10, "stop with a one-line error and a non-zero exit once this many steps in a row were skipped (non-finite "
        "gradient norm): the run trains nothing. fp16's overflows while the loss scale can still fall are not "
        "counted (they neither count nor break the run of skips); one at `optimizer.min_loss_scale` is")
    compile: bool = setting(
        False, "compile each transformer block with `torch.compile` (inductor; on a CPU its C++ back end needs a C++ "
        "compiler): the B/W split's ops, collectives and MoE MLPs stay eager between compiled regions; compiled "
        "code is cached under `<run dir>/.cache/inductor` (see docs/training.md)")
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
    auto_resume: bool = setting(
        False, "continue from the run directory's (`out_dir`'s) latest complete checkpoint when it holds one, else "
        "start as `resume_from` says: one command starts and continues a run (`ppctl submit`'s jobs use it)")


@dataclass
class SlurmConfig(Section):
    """The Slurm job ``ppctl submit`` writes (``launcher=slurm``); unset options are left to the cluster's defaults."""

    partition: Optional[str] = setting(None, "`--partition`")
    account: Optional[str] = setting(None, "`--account`")
    qos: Optional[str] = setting(None, "`--qos`")
    time: Optional[str] = setting(
        None, "`--time`, the job's time limit (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM` or `D-HH:MM:SS`)")
    nodes: Optional[int] = setting(None, "nodes of the allocation; unset: `launcher.nnodes` (set, it sets that)")
    gpus_per_node: Optional[int] = setting(
        None, "`--gpus-per-node`; unset: no GPUs asked for (set it to the workers per node for NCCL)")
    cpus_per_task: Optional[int] = setting(
        None, "`--cpus-per-task` of the one task per node that runs that node's workers")
    requeue: bool = setting(
        True, "stopped by SIGTERM (preemption, the time limit's warning, `scancel --signal=TERM`), the job saves a "
        "checkpoint and requeues itself; the requeued job resumes from it in the same run directory")
    signal_lead_s: int = setting(
        120, "Slurm signals the job this many seconds before its time limit (`--signal=B:TERM@N`), time to "
        "finish the step and save")
    extra_args: list[str] = field(
        default_factory=list, metadata={"doc": "more `#SBATCH` options, one per item (e.g. `[--exclusive,--mem=0]`)"})


@dataclass
class LauncherConfig(Section):
    """How workers are started (torchrun), here or in a Slurm job."""

    kind: str = setting(
        "local", "`local`: `ppctl train` starts the workers on this machine; `slurm`: `ppctl submit` writes "
        "`<run dir>/job.sbatch` (`ppctl train` on every node of the allocation) and submits it with sbatch")

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
    max_restarts: int = setting(
        0, "torchrun's elastic restarts after a worker fails; every restart resumes from the run's latest "
        "complete checkpoint")
    inject_fault: Optional[str] = setting(
        None, "testing aid: `RANK:raise` or `RANK:kill` makes that rank fail on purpose at start; with `@STEP` "
        "(`1:kill@5`) after that step instead, and only in the job's first attempt (torchrun's restart 0)")
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class PpctlConfig(Section):
    """The whole configuration tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


SCHEMA_GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
}
