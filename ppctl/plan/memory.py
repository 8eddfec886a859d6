"""The memory model: bytes per pipeline rank, by part, predicted from the config alone (pure: no torch).

Per rank, for its model chunks (``ppctl.parallel.layout.layer_map``) on one TP rank, the model being the
resolved config's ``ModelShape`` (``ResolvedConfig.model.memory_shape``, built once by the model's family):

- ``parameters``: the chunks' parameters in the model's dtype (``chunk_parameters``, the
  same count as the family's chunk builds: TP shards, vocabulary padding, a tied output layer
  that shares the embedding's weight on one chunk; the family's ``Architecture`` says which
  norms, biases and projections its layers have).
- ``gradients``: the plain optimizer accumulates into ``param.grad`` (the model's dtype);
  the bucketed one (distributed optimizer, half precision, PipeDream-2BW) into one fp32
  buffer of every parameter (fp64 for fp64 models), a parameter's ``.grad`` freed after
  each microbatch.
- ``optimizer``: AdamW's two moments, plus with the bucketed optimizer an fp32 main copy,
  of the rank's shard: all of it, or 1/(dp*cp) (and 1/2 for DualPipe's mirrored copies)
  with ``optimizer.distributed``.
- ``activations``: what autograd keeps per microbatch per chunk (``chunk_activation_bytes``,
  derived from the layers as built and checked against saved tensors in the tests), times
  the microbatches the schedule keeps in flight on each chunk at the worst moment: the
  rank's actions walked in order, a forward adding its chunk's activations, a whole
  backward (or a W) removing them, a B swapping them for what W needs (the stash).
  Recomputation keeps each checkpointed group's input only, and adds the rest of one group's
  activations while a backward rebuilds it, on top of what the rank holds as that backward
  starts (``backward_states``). The same walk over a simulated timeline gives the bytes over
  time (``activation_bytes_over_time``, ``inspect-schedule``).
- ``buffers``: the pipeline messages in flight (one activation being sent, one gradient
  being received) and the working memory of one microbatch at the step's peak, the larger of
  two moments: a backward (its layers' largest moment, ``layer_backward_moments``: an MLP's
  gradients and a weight's, on top of what the rank holds as it starts and its rebuilt group)
  and, on a rank holding a last stage, the loss's forward (its logits, on top of what the rank
  holds after that stage's forwards: ``forward_states``), which never runs within a rebuild.
  The states are a schedule's (``RankStates``, computed once per schedule), weighed per model.
  Checked at full size in fake tensors (``ppctl check-memory``, ``ppctl.run.fake_rank``).

A mixture of experts (``ModelShape.moe``): an MoE layer holds its router, its shared experts and its EP rank's
``num_experts / ep`` experts (all of them at ep=1), exactly as built, their gradients and optimizer state with them;
with ep > 1 the distributed optimizer shards the experts' state over their edp ranks (``expert_replica``: edp,
times DualPipe's 2 copies) in buckets of their own, the rest over dp*cp as a dense model's. Its activations are
approximate: per microbatch of T tokens (a TP rank's T / tp under the sequence parallelism TP needs with experts) it
keeps the routed rows (T * topk of them dropless, at most
num_experts * capacity with a capacity factor) at the input of the experts and after them, each expert MLP's inner
activations for its rows, the shared experts' as a dense MLP's, and the router's float32 scores over the experts (a
few T x num_experts tensors); a chunk's recomputed groups are weighed at its mean layer. With ep > 1 a rank's
experts run the rows every rank of its EP group routed to them, which differ between EP ranks with the routing: the
model keeps their mean (T * topk dropless, as at ep=1), plus the int64 indices of the exchange's two gathers
(measured at ep=2: each pp rank's mean of its EP ranks within 7%). The split backward's stash counts the router's
and the experts' inputs and output gradients alike.

Knowingly left out: the allocator's fragmentation and caching, kernel workspaces
(cuBLAS, flash attention), CUDA context, and the communication libraries' buffers; the
s x s attention probabilities of a non-fused attention kernel (ppctl attends through
SDPA's fused kernels, except all-gather context parallelism on CPU); ring and a2a
context-parallel attention's own blocks in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import accumulate, compress, repeat
from operator import ge, itemgetter
from typing import Iterable, Sequence

from ppctl.model.memory_shape import ModelShape
from ppctl.model.recompute import Recompute

DTYPE_BYTES = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2}


def float_bytes(precision: str) -> int:
    """Bytes of what a run keeps in full float precision (main parameters and gradients, softmax statistics,
    the loss's logits): float64 in an fp64 run, else float32."""
    return 8 if precision == "fp64" else 4

INDEX_BYTES = 8  # int64 token and position ids
FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "BW", "B", "W"


@dataclass(frozen=True)
class MemoryParts:
    """Bytes of one rank by part (``inspect-layout --json``'s ``memory`` object, with ``total``)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        """The sum of the parts."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def to_json(self) -> dict:
        """The parts and ``total``, in bytes."""
        return {**{field.name: getattr(self, field.name) for field in fields(self)}, "total": self.total}


@dataclass(frozen=True)
class Parallelism:
    """The sizes the per-rank shares follow, and the run's precision, optimizer, recomputation and backward kind."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    cp_comm: str = "allgather"
    precision: str = "fp32"
    bucketed_optimizer: bool = False
    optimizer_shards: int = 1  # ranks sharing the optimizer state (dp*cp, times DualPipe's 2 copies), or 1
    ep: int = 1  # expert parallelism: each rank holds num_experts / ep of every MoE layer's experts
    expert_optimizer_shards: int = 1  # with ep > 1: ranks sharing the experts' optimizer state (edp, times copies)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    split_backward: bool = False  # the schedule splits each backward into B and W (its linears run as split ops)


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a rank: its global stage, transformer layers (``moe_layers`` of them MoE layers), and the
    embedding / loss it holds."""

    stage: int
    layers: int
    pre_process: bool
    post_process: bool
    moe_layers: int = 0  # how many of its layers are MoE layers


# --- parameters, gradients, optimizer state ------------------------------------------------

def layer_parameters(shape: ModelShape, tp: int) -> int:
    """One transformer layer's parameters on one TP rank: two norms and the row-parallel biases whole; the
    query, key, value and output projections, the MLP's matrices (two, or three gated) and the column-parallel
    biases split."""
    h, f, a, k = shape.hidden, shape.ffn, shape.attention_width, shape.kv_width
    split = h * (a + 2 * k) + a * h + (3 if shape.gated_mlp else 2) * h * f
    split += (a + 2 * k if shape.qkv_bias else 0) + (f if shape.linear_biases else 0)
    return 2 * shape.norm_parameters + split // tp + (2 * h if shape.linear_biases else 0)


def mlp_parameters(shape: ModelShape, ffn: int, tp: int) -> int:
    """A dense MLP of ``ffn`` features on one TP rank: its matrices (two, or three gated) and column-parallel bias
    split, its row-parallel bias whole."""
    h = shape.hidden
    split = (3 if shape.gated_mlp else 2) * h * ffn + (ffn if shape.linear_biases else 0)
    return split // tp + (h if shape.linear_biases else 0)


def moe_layer_parameters(shape: ModelShape, tp: int, ep: int = 1) -> int:
    """One MoE layer's parameters on one TP rank: the dense layer's without its MLP, the router (a row per expert),
    the MLPs of this EP rank's ``num_experts / ep`` experts (whole: experts run at tp=1) and the shared experts'
    MLP."""
    moe = shape.moe
    shared = mlp_parameters(shape, moe.shared_ffn_hidden_size, tp) if moe.shared_experts else 0
    router = moe.num_experts * shape.hidden
    return layer_parameters(shape, tp) - mlp_parameters(shape, shape.ffn, tp) + router + shared + \
        expert_layer_parameters(shape, ep)


def expert_layer_parameters(shape: ModelShape, ep: int = 1) -> int:
    """The routed experts' parameters of one MoE layer on one EP rank: ``num_experts / ep`` expert MLPs."""
    moe = shape.moe
    return moe.num_experts // ep * mlp_parameters(shape, moe.expert_ffn_hidden_size, 1)


def chunk_parameters(shape: ModelShape, chunk: Chunk, tp: int, ep: int = 1) -> int:
    """Parameters of one chunk on one TP (and EP) rank."""
    count = (chunk.layers - chunk.moe_layers) * layer_parameters(shape, tp)
    if chunk.moe_layers:
        count += chunk.moe_layers * moe_layer_parameters(shape, tp, ep)
    if chunk.pre_process:
        count += shape.padded_vocab * shape.hidden // tp
        count += shape.max_seq_length * shape.hidden if shape.learned_positions else 0
    if chunk.post_process:
        count += shape.norm_parameters
        shares_embedding = shape.tie_embeddings and chunk.pre_process
        count += 0 if shares_embedding else shape.padded_vocab * shape.hidden // tp
    return count


def state_parts(parameters: int, parallel: Parallelism, expert_parameters: int = 0) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of ``parameters`` elements on one rank, ``expert_parameters`` of them
    experts split by expert parallelism (ep > 1): the distributed optimizer shards those over
    ``expert_optimizer_shards`` (their own buckets), the rest over ``optimizer_shards``."""
    model_bytes = DTYPE_BYTES[parallel.precision]
    main_bytes = float_bytes(parallel.precision)
    if not parallel.bucketed_optimizer:
        return parameters * model_bytes, parameters * model_bytes, 2 * parameters * model_bytes
    shard = -(-(parameters - expert_parameters) // parallel.optimizer_shards)
    shard += -(-expert_parameters // parallel.expert_optimizer_shards)
    return parameters * model_bytes, parameters * main_bytes, 3 * shard * main_bytes


# --- activations ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tokens:
    """One microbatch on one rank: ``batch`` sequences of ``seq`` tokens (the CP rank's share)."""

    batch: int
    seq: int


def layer_activation_bytes(shape: ModelShape, tokens: Tokens, parallel: Parallelism,
                           attention_core: bool = True, moe_layer: bool = False) -> int:
    """What one transformer layer keeps for its backward, per microbatch, on one TP rank.

    In units of b*s*h (b sequences of s tokens, hidden h) in the model's dtype: the layer's
    input and the two norms' outputs (each saved by the next op), the residual between the
    blocks; with a fused QKV its output (query, key and value widths, TP-split: it stays whole
    while attention reads the values in it) and, with rotary positions, the rotated queries and
    keys; with q, k and v apart the queries and the keys and values repeated to the query heads;
    attention's output (TP-split; the output projection reads it in place); the MLP's
    activations (b*s*f each, TP-split: the up projection's output and GELU's, or SwiGLU's gate,
    up, SiLU and product); the norms' statistics (LayerNorm: mean and 1/std in the model's
    dtype; RMSNorm: 1/rms and, unless ``keeps_rms_units`` says not, each norm's unit-RMS input, both in float32
    or wider, the input upcast in a half-precision run as in an fp32 one); attention's log-sum-exp (float32, per
    head). With sequence parallelism the norms see s/tp tokens, but the column-parallel layers keep their gathered
    (whole-sequence) inputs: ``gathered_norm_outputs`` copies of them. All-gather context
    parallelism keeps the gathered keys and values of the whole sequence. ``moe_layer``: its MLP is
    ``shape.moe``'s experts (``moe_mlp_activation_bytes``).
    """
    b, s, h, f, t = tokens.batch, tokens.seq, shape.hidden, shape.ffn, parallel.tp
    a, k = shape.attention_width, shape.kv_width
    e, wide = DTYPE_BYTES[parallel.precision], float_bytes(parallel.precision)
    bsh = b * s * h
    norm_tokens = b * s / t if parallel.sequence_parallel else b * s
    # each RMSNorm's unit-RMS input, upcast: float32 (or wider) in a half-precision run as in an fp32 one
    units = wide * 2 * norm_tokens * h if keeps_rms_units(shape, parallel) else 0
    if parallel.sequence_parallel:
        gathered_outputs = gathered_norm_outputs(shape, parallel, tokens)
        whole = 2 * bsh / t + gathered_outputs * bsh  # layer input, residual (s/tp tokens); gathered norm outputs
        if moe_layer:  # the router and the experts read the MLP norm's own s/tp tokens; only shared experts gather
            mlp_gathers = 0 if shape.moe.shared_experts else mlp_gathered_copies(shape, parallel, tokens)
            whole += bsh / t - mlp_gathers * bsh
    else:
        whole = 4 * bsh
    statistics = e * 4 * norm_tokens if shape.norm_has_bias else wide * 2 * norm_tokens
    if shape.fused_qkv:
        attention = b * s * (a + 2 * k) / t + b * s * a / t + (b * s * (a + k) / t if shape.rotary else 0)
        gathered_width = k
    else:
        attention = 4 * b * s * a / t  # queries, repeated keys and values, output
        gathered_width = a
    mlp = 0 if moe_layer else mlp_activation_units(shape, b * s, f) / t
    cp_gathers = parallel.cp > 1 and parallel.cp_comm == "allgather"
    gathered = 2 * b * s * gathered_width * (parallel.cp - 1) / t if cp_gathers else 0
    log_sum_exp = wide * b * s * shape.heads / t if attention_core else 0
    experts = moe_mlp_activation_bytes(shape, tokens, parallel) if moe_layer else 0
    return round(e * (whole + attention + mlp + gathered) + units + statistics + log_sum_exp) + experts


def mlp_activation_units(shape: ModelShape, rows: int, ffn: int) -> float:
    """The elements a dense MLP of ``ffn`` features keeps for ``rows`` tokens beyond its input: the up projection's
    output and GELU's, or SwiGLU's gate, up, SiLU and product."""
    return (4 if shape.gated_mlp else 2) * rows * ffn


def moe_mlp_activation_bytes(shape: ModelShape, tokens: Tokens, parallel: Parallelism) -> int:
    """What an MoE MLP keeps for one microbatch (approximate; the module docstring): the routed rows at the experts'
    input and the placed outputs before the weighted sum (model dtype), the experts' and the shared experts' inner
    activations, the router's scores, probabilities and chosen weights (float32 or wider) and the int64 ids that
    sort and place the rows.

    With expert parallelism (ep > 1) the experts' rows are those their EP rank received, ``rows`` on average over
    the EP group (the same rows travel, each to one rank), which the model keeps. The exchange's two gathers (into
    expert-major order and back) keep their int64 indices of the received rows."""
    moe, e, wide = shape.moe, DTYPE_BYTES[parallel.precision], float_bytes(parallel.precision)
    sequence = tokens.batch * tokens.seq  # the shared experts' (a TP-split dense MLP's) tokens
    token_count = sequence // parallel.tp if parallel.sequence_parallel else sequence  # this TP rank's to route
    assignments = token_count * moe.topk
    rows = routed_rows(shape, tokens, parallel)
    elements = (rows + assignments) * shape.hidden + assignments
    elements += mlp_activation_units(shape, rows, moe.expert_ffn_hidden_size)
    if moe.shared_experts:
        elements += mlp_activation_units(shape, sequence, moe.shared_ffn_hidden_size) / parallel.tp
    router = wide * (3 * token_count * moe.num_experts + 2 * assignments)
    indices = rows + 2 * assignments
    if parallel.ep > 1:
        indices += 2 * rows
    return round(e * elements + router + INDEX_BYTES * indices)


def keeps_rms_units(shape: ModelShape, parallel: Parallelism) -> bool:
    """Whether each RMSNorm keeps its unit-RMS input (for its scale's gradient) besides its input and 1/rms: PyTorch's
    ops do; a split op (a schedule that splits B and W) keeps the input and 1/rms alone and recomputes it."""
    return not shape.norm_has_bias and not parallel.split_backward


def gathered_norm_outputs(shape: ModelShape, parallel: Parallelism, tokens: Tokens) -> int:
    """How many whole-sequence copies (b*s*h each) of its two norms' outputs a layer keeps with sequence parallelism.

    The sequence all-gather hands each block a [b, s, h] view of a sequence-major buffer, which
    is not contiguous. A plain ``F.linear`` flattens its input's tokens into a copy of its own and
    keeps that copy for its weight gradient: one per projection reading the gathered input (fused
    QKV or q, k and v apart; the MLP's input projection, or SwiGLU's gate and up). A split op (a
    schedule that splits B and W) keeps the gathered view itself: one buffer per block. Measured
    with saved-tensor hooks on a Llama layer at tp=2 under 1F1B: five b*s*h copies, not two. A microbatch of one
    sequence is gathered contiguous (b = 1: sequence-major is batch-major), so every projection reads the
    buffer as it is: one per block (measured in fake tensors on Llama 3 8B at tp=8: two, five at b = 2).
    """
    if parallel.split_backward or tokens.batch == 1:
        return 2
    return (1 if shape.fused_qkv else 3) + mlp_gathered_copies(shape, parallel, tokens)


def mlp_gathered_copies(shape: ModelShape, parallel: Parallelism, tokens: Tokens) -> int:
    """The whole-sequence copies of the MLP norm's output a dense MLP keeps under SP (``gathered_norm_outputs``)."""
    return 1 if parallel.split_backward or tokens.batch == 1 or not shape.gated_mlp else 2


def layer_input_bytes(shape: ModelShape, tokens: Tokens, parallel: Parallelism) -> int:
    """A layer's input alone: what a recomputed group keeps."""
    share = parallel.tp if parallel.sequence_parallel else 1
    return DTYPE_BYTES[parallel.precision] * tokens.batch * tokens.seq * shape.hidden // share


def ends_activation_bytes(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> int:
    """The embedding's token (and learned position) ids and, with TP, the mask of the ids another rank owns; the
    rotary tables; the last stage's final norm (its input, RMSNorm's unit-RMS input and the statistics on the rank's
    tokens, s/tp of them with sequence parallelism; its output as the output layer keeps it: gathered to the whole
    sequence), the cross-entropy's float32 softmax over the real classes, labels and loss mask."""
    b, s, h, e, t = tokens.batch, tokens.seq, shape.hidden, DTYPE_BYTES[parallel.precision], parallel.tp
    wide = float_bytes(parallel.precision)
    total = 0
    if chunk.pre_process:
        total += (2 if shape.learned_positions else 1) * INDEX_BYTES * b * s + (b * s if t > 1 else 0)
    if shape.rotary and chunk.layers:
        total += 2 * e * b * s * (shape.attention_width // shape.heads)  # the rotary cos and sin, shared by the layers
    if chunk.post_process:
        norm_tokens = b * s / t if parallel.sequence_parallel else b * s
        units = wide * norm_tokens * h if keeps_rms_units(shape, parallel) else 0  # upcast, as a layer's norms'
        statistics = e * 2 * norm_tokens if shape.norm_has_bias else wide * norm_tokens  # mean, 1/std; or 1/rms
        total += round(e * (norm_tokens * h + b * s * h) + units + statistics)
        # The loss keeps the softmax of the rank's real classes (not the padding): the most on TP rank 0.
        total += wide * b * s * min(shape.vocab or shape.padded_vocab, shape.padded_vocab // t)
        total += INDEX_BYTES * b * s + b * s
    return total


def recompute_groups(layers: int, parallel: Parallelism) -> list[tuple[int, bool]]:
    """The chunk's layers as (count, recomputed) runs, as the model runs them (``Recompute.layer_groups``)."""
    recompute = Recompute(parallel.recompute, parallel.recompute_method, parallel.recompute_num_layers)
    return [(end - first, recomputed) for first, end, recomputed in recompute.layer_groups(layers)]


def chunk_activation_bytes(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> tuple[int, int]:
    """(kept per microbatch in flight, extra while its backward rebuilds the largest recomputed group).

    The group's input is kept already: rebuilding it makes the rest of its layers' activations. A split backward's
    B (but the first stage's, which defers it all to W) rebuilds a group into what it stashes for W: the kept
    peak, which counts the stash once B ended, holds that part of the rebuilt group already."""
    per_layer = mean_layer_activation_bytes(shape, chunk, tokens, parallel)
    stashed = layers_stash_bytes(shape, chunk, tokens, parallel) if (
        parallel.split_backward and not chunk.pre_process and chunk.layers) else 0
    kept, rebuilt = 0, 0
    for count, recomputed in recompute_groups(chunk.layers, parallel):
        if recomputed:
            kept += layer_input_bytes(shape, tokens, parallel)
            rebuilt = max(rebuilt, count * (per_layer - stashed) - layer_input_bytes(shape, tokens, parallel))
        else:
            kept += count * per_layer
    return round(kept) + ends_activation_bytes(shape, chunk, tokens, parallel), round(rebuilt)


def mean_layer_activation_bytes(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> float:
    """What one of the chunk's layers keeps per microbatch: the dense layer's, or with MoE layers the mean of its
    layers' (the same for every layer of a dense model)."""
    attention_core = parallel.recompute != "selective"
    dense = layer_activation_bytes(shape, tokens, parallel, attention_core)
    if not chunk.moe_layers:
        return dense
    routed = layer_activation_bytes(shape, tokens, parallel, attention_core, moe_layer=True)
    return ((chunk.layers - chunk.moe_layers) * dense + chunk.moe_layers * routed) / chunk.layers


def stash_bytes(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> int:
    """What a split backward's B leaves for W per microbatch: each deferred linear's input and output gradient
    (``layers_stash_bytes``), recomputed or not, and the output layer's (the first stage's B defers its whole
    backward: what its forward kept and the received gradient)."""
    # the gradient the chunk received stays with the stash (measured in fake tensors: one message more per chunk)
    received = layer_input_bytes(shape, tokens, parallel)
    if chunk.pre_process:  # the deferred backward starts from it
        return chunk_activation_bytes(shape, chunk, tokens, parallel)[0] + received
    b, s, t, e = tokens.batch, tokens.seq, parallel.tp, DTYPE_BYTES[parallel.precision]
    logits = e * b * s * (shape.hidden + shape.padded_vocab / t) if chunk.post_process else 0
    return round(chunk.layers * layers_stash_bytes(shape, chunk, tokens, parallel) + logits
                 + (0 if chunk.post_process else received))


def layers_stash_bytes(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> float:
    """What B leaves for W per layer of ``chunk`` (their mean with MoE layers): its linears' inputs (q, k and v read
    one; so do gate and up) and output gradients. An MoE layer's MLP stashes its router's (input and logits'
    gradient), each expert's for its routed rows (both on the rank's own tokens: s/tp with sequence parallelism),
    and the shared experts' (their input is the router's)."""
    b, s, h, f, t = tokens.batch, tokens.seq, shape.hidden, shape.ffn, parallel.tp
    a, k = shape.attention_width, shape.kv_width
    e, mlp_width = DTYPE_BYTES[parallel.precision], 3 if shape.gated_mlp else 2
    per_layer = e * b * s * (4 * h + (2 * a + 2 * k) / t + mlp_width * f / t)
    if not chunk.moe_layers:
        return per_layer
    moe = shape.moe
    shared = h + mlp_width * moe.shared_ffn_hidden_size if moe.shared_experts else 0
    routed = moe.topk * (2 * h + mlp_width * moe.expert_ffn_hidden_size)
    routed_tokens = b * s / t if parallel.sequence_parallel else b * s
    per_moe_layer = (e * b * s * (2 * h + (2 * a + 2 * k) / t + shared)
                     + e * routed_tokens * (h + moe.num_experts + routed))
    return ((chunk.layers - chunk.moe_layers) * per_layer + chunk.moe_layers * per_moe_layer) / chunk.layers


def held_bytes_change(kind: str, stage: int, kept: dict[int, int], stash: dict[int, int]) -> int:
    """How one ``(kind, stage)`` action changes the activation bytes its rank holds: a forward adds what the stage
    keeps, a whole backward frees it, a B swaps it for the stash its W needs, and the W frees that."""
    if kind == FORWARD:
        return kept[stage]
    if kind == BACKWARD:
        return -kept[stage]
    if kind == BACKWARD_INPUT:
        return stash[stage] - kept[stage]
    if kind == BACKWARD_WEIGHT:
        return -stash[stage]
    return 0


def peak_in_flight_bytes(actions: Iterable[tuple[str, int]], kept: dict[int, int], stash: dict[int, int]) -> int:
    """The most activation bytes a rank holds at once, walking its ``(kind, stage)`` actions in order (after any
    action: a B whose stash outweighs what the forward kept, as with recomputation, raises it too)."""
    return in_flight_peak(in_flight_states(actions), kept, stash)


InFlightState = tuple[tuple[int, int, int], ...]  # per stage of the rank: (stage, forwards kept, B stashes kept)


def in_flight_states(actions: Iterable[tuple[str, int]]) -> frozenset[InFlightState]:
    """The distinct activations a rank holds after each of its ``(kind, stage)`` actions, as counts per stage.

    The bytes held are these counts weighed by each stage's kept and stash bytes, so a
    schedule's few distinct states (its steady state repeats) serve every model and batch
    a planner weighs it for (``in_flight_peak``), where a walk of its actions would not.
    The states after a BW or a W are left out (each only lowers a count of the state before it,
    which dominates it), but for a first action's.
    """
    actions = list(actions)
    kept = list(map(_STATE_KEPT_AFTER.get, map(itemgetter(0), actions), repeat(True)))
    if kept:
        kept[0] = True
    return _states_after(actions, kept)


def forward_states(actions: Iterable[tuple[str, int]], stages: Iterable[int]) -> frozenset[InFlightState]:
    """The undominated states (``in_flight_states``) just after each forward of one of ``stages``: for a model
    copy's last stages, what a rank holds while their loss computes its logits (``loss_workspace_bytes``)."""
    actions, forwards = list(actions), {(FORWARD, stage) for stage in stages}
    return _states_after(actions, [action in forwards for action in actions])


def backward_states(actions: Iterable[tuple[str, int]], kind: str, stage: int) -> frozenset[InFlightState]:
    """The undominated states (``in_flight_states``) as each ``kind`` action (a BW, B or W) of ``stage`` starts, and
    for a B just after it too: where its recomputed groups are rebuilt and its working memory held (a split B
    rebuilds into the stash it leaves, so its rebuild counts from the state after it)."""
    actions = list(actions)
    chosen = [False] * len(actions)
    for index, action in enumerate(actions):
        if action == (kind, stage):
            if index:
                chosen[index - 1] = True
            chosen[index] = chosen[index] or kind == BACKWARD_INPUT
    return _states_after(actions, chosen)


def _states_after(actions: list[tuple[str, int]], chosen: list[bool]) -> frozenset[InFlightState]:
    """The undominated states after the ``chosen`` actions (a flag per action), as ``in_flight_states`` gives them."""
    stages = sorted({stage for _, stage in actions})
    # The walk in C loops (a rank has up to thousands of actions, a search walks millions): per stage, its two
    # counts (forwards kept, stashes kept) as running sums of each action's change to them, zipped into states.
    counts = []
    for stage in stages:
        counts.append(accumulate(map({(FORWARD, stage): 1, (BACKWARD_INPUT, stage): -1, (BACKWARD, stage): -1}.get,
                                     actions, repeat(0))))
        counts.append(accumulate(map({(BACKWARD_INPUT, stage): 1, (BACKWARD_WEIGHT, stage): -1}.get,
                                     actions, repeat(0))))
    seen = set(compress(zip(*counts), chosen))
    return frozenset(tuple((stage, state[2 * index], state[2 * index + 1]) for index, stage in enumerate(stages))
                     for state in _undominated(seen))


# The kinds after which ``in_flight_states`` keeps no state: each only lowers a count.
_STATE_KEPT_AFTER = {BACKWARD: False, BACKWARD_WEIGHT: False}


def _undominated(states: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The states that no other state matches or exceeds in every count: bytes per count are never negative, so
    only these can hold the most (a GPipe rank's thousands of states are one)."""
    kept: list[tuple[int, ...]] = []
    for state in sorted(states, key=sum, reverse=True):  # a state is dominated only by one of larger or equal sum
        if not any(all(map(ge, other, state)) for other in kept):  # other >= state in every count
            kept.append(state)
    return kept


def in_flight_peak(states: Iterable[InFlightState], kept: dict[int, int], stash: dict[int, int]) -> int:
    """The most bytes of ``states`` (``in_flight_states``) at these bytes per stage; 0 when none is above 0."""
    return max([0, *(sum(forwards * kept[stage] + stashes * stash[stage] for stage, forwards, stashes in state)
                     for state in states)])


def activation_bytes_over_time(actions: Iterable, kept: dict[int, int],
                               stash: dict[int, int]) -> list[tuple[float, int]]:
    """The activation bytes a rank holds over time: the step function of its timed actions (anything with ``kind``,
    ``stage``, ``start`` and ``end``, such as the simulator's ``TimedAction``), in the rank's order.

    Returns ``(time, bytes)`` points, the first ``(0.0, 0)``: from each point's time the rank holds its bytes,
    until the next point. A forward's bytes count from its start (it keeps them as it runs); a backward's, a B's
    or a W's change counts at its end (what it frees is needed until then). Actions that change nothing add no
    point; several points may share one time (a zero-length action), the last holding from then on. The most
    bytes of the points is ``peak_in_flight_bytes`` of the same actions.
    """
    points, held = [(0.0, 0)], 0
    for action in actions:
        change = held_bytes_change(action.kind, action.stage, kept, stash)
        if change:
            held += change
            points.append((action.start if action.kind == FORWARD else action.end, held))
    return points


def chunk_backward_moments(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> list[int]:
    """The bytes each moment of a backward of ``chunk``'s layers holds on top of what they keep: its dense layers'
    and its MoE layers' (``layer_backward_moments``); a split backward's B's, but on the first stage, whose B defers
    its whole backward to W (``stash_bytes``)."""
    split = parallel.split_backward and not chunk.pre_process
    return [moment for moe_layer in _layer_kinds(chunk)
            for moment in layer_backward_moments(shape, tokens, parallel, split, moe_layer)]


def chunk_weight_moment(shape: ModelShape, chunk: Chunk, tokens: Tokens, parallel: Parallelism) -> int:
    """What a split backward's W of ``chunk`` holds at once on top of its stash: two weight gradients of its largest
    weight (before each is added to ``.grad`` or the optimizer's buffer; an MoE layer's expert weights); 0 where the
    backward is not split or W runs the first stage's whole backward (``chunk_backward_moments``)."""
    if not parallel.split_backward or chunk.pre_process or not chunk.layers:
        return 0
    h, t, e = shape.hidden, parallel.tp, DTYPE_BYTES[parallel.precision]
    weights = [h * shape.attention_width / t] + [h * shape.moe.expert_ffn_hidden_size if moe_layer
                                                 else h * shape.ffn / t for moe_layer in _layer_kinds(chunk)]
    return round(e * 2 * max(weights))


def _layer_kinds(chunk: Chunk) -> list[bool]:
    """The kinds of layer ``chunk`` holds: False for dense, True for MoE."""
    return ([False] if chunk.layers > chunk.moe_layers else []) + ([True] if chunk.moe_layers else [])


def layer_backward_moments(shape: ModelShape, tokens: Tokens, parallel: Parallelism, split: bool,
                           moe_layer: bool = False) -> list[int]:
    """The moments of one layer's backward at which it holds the most on top of what it keeps (bytes, one TP rank).

    Autograd frees each node's saved tensors once the node ran, so a backward never holds all the gradients of a
    layer's tensors at once; measured per operation in fake tensors (the live storages at each backward's peak, on
    GPT-2 small, Llama 3 8B and Mixtral 8x7B at tp 1, 2 and 8, with and without SP), its peak is one of:

    - the MLP's down projection: the gradient of its input (b*s*f/tp), its weight's gradient (h*f/tp, before it is
      added to ``.grad`` or the bucketed optimizer's buffer) and, under SP, the incoming gradient gathered to the
      whole sequence (b*s*h, freed after it);
    - the activation's backward: the gradients of the product and of its two operands less the product (SwiGLU:
      two b*s*f/tp), or GELU's gradient less its output (one);
    - attention's output projection (the gathered gradient, the attention output's gradient, the weight's) and its
      core (the queries', keys' and values' gradients);
    - with a split backward (``split``: B's moments; W's are ``chunk_weight_moment``'s), B computes no weight
      gradient but frees nothing the stash keeps: the activation's backward holds the product's and both operands' gradients
      (three b*s*f/tp; GELU: two), the up projections' B their outputs' gradients and each its input's (b*s*h,
      under SP then scattered to s/tp tokens).

    ``moe_layer``: an MoE layer's experts in place of the MLP, on the routed rows (``moe_mlp_activation_bytes``'s):
    their activation's backward holds two (split B: three) rows*f_expert gradients, less the weighted sum's saved
    rows*h on a whole backward."""
    b, s, h, t = tokens.batch, tokens.seq, shape.hidden, parallel.tp
    a, k, e = shape.attention_width, shape.kv_width, DTYPE_BYTES[parallel.precision]
    gathered = b * s * h if parallel.sequence_parallel and t > 1 else 0
    attention = [gathered + b * s * a / t + (0 if split else h * a / t), b * s * (2 * a + 2 * k) / t]
    if moe_layer:
        rows, ffn = routed_rows(shape, tokens, parallel), shape.moe.expert_ffn_hidden_size
        inner, weight, saved_sum, inputs, scattered = rows * ffn, h * ffn, rows * h, rows * h, 0
        down = inner + weight if not split else inner
    else:
        inner, weight, saved_sum, inputs = b * s * shape.ffn / t, h * shape.ffn / t, 0, b * s * h
        scattered = b * s * h / t if gathered else 0  # under SP an input's gradient is scattered to s/tp tokens
        down = gathered + inner + (0 if split else weight)
    operands = 2 if shape.gated_mlp else 1
    if split:
        up = operands * (inner + inputs) + scattered  # the up projections' B: their outputs' and inputs' gradients
        moments = [down, (operands + 1) * inner, up] + attention
    else:
        moments = [down, operands * inner - saved_sum] + attention
    return [round(e * moment) for moment in moments]


def routed_rows(shape: ModelShape, tokens: Tokens, parallel: Parallelism) -> int:
    """The rows an MoE layer's experts run on one rank for one microbatch: the rank's tokens (s/tp of them under SP)
    times topk dropless, at most num_experts * capacity with a capacity factor (an EP rank's mean alike)."""
    moe = shape.moe
    sequence = tokens.batch * tokens.seq
    token_count = sequence // parallel.tp if parallel.sequence_parallel else sequence
    assignments = token_count * moe.topk
    capacity = moe.capacity(token_count)
    return assignments if capacity is None else min(assignments, moe.num_experts * capacity)


def loss_workspace_bytes(shape: ModelShape, chunks: Sequence[Chunk], tokens: Tokens, parallel: Parallelism) -> int:
    """On a rank holding the last stage, the loss's logits while its forward runs, on top of what the rank keeps: three
    of them at once in a half-precision run (the logits, their float32 copy and the max-shifted copy; the softmax it
    keeps is an activation) and two in fp32 or fp64 (the copy is the logits), more than their gradients in the
    backward (measured in fake tensors on Llama 3 8B at tp=8, bf16: the last stage's peak 6% under without the
    third); 0 on other ranks."""
    if not any(chunk.post_process for chunk in chunks):
        return 0
    wide, e = float_bytes(parallel.precision), DTYPE_BYTES[parallel.precision]
    return (2 * wide + (e if e != wide else 0)) * tokens.batch * tokens.seq * shape.padded_vocab // parallel.tp


@dataclass(frozen=True)
class ActivationTables:
    """A rank's activation bytes per microbatch by global stage, and what a backward of each stage adds.

    ``kept``: what a forward of the stage keeps until its backward; ``stash``: what a B of the stage leaves for its
    W; ``rebuilt``: the most a backward of the stage adds while it rebuilds a recomputed group (0 without
    recomputation; a split B's beyond what it stashes, on top of the state after it); ``working``: the largest
    moment of the backward that rebuilds (``chunk_backward_moments``: a whole backward, a split B, or the first
    stage's W); ``weight_working``: a split W's (``chunk_weight_moment``).
    """

    kept: dict[int, int]
    stash: dict[int, int]
    rebuilt: dict[int, int]
    working: dict[int, int]
    weight_working: dict[int, int]


def activation_tables(shape: ModelShape, chunks: Sequence[Chunk], tokens: Tokens,
                      parallel: Parallelism) -> ActivationTables:
    """The ``ActivationTables`` of a rank holding ``chunks``."""
    kept_and_rebuilt = {chunk.stage: chunk_activation_bytes(shape, chunk, tokens, parallel) for chunk in chunks}
    return ActivationTables(kept={stage: kept for stage, (kept, _) in kept_and_rebuilt.items()},
                            stash={chunk.stage: stash_bytes(shape, chunk, tokens, parallel) for chunk in chunks},
                            rebuilt={stage: rebuilt for stage, (_, rebuilt) in kept_and_rebuilt.items()},
                            working={chunk.stage: max(chunk_backward_moments(shape, chunk, tokens, parallel),
                                                      default=0) if chunk.layers else 0 for chunk in chunks},
                            weight_working={chunk.stage: chunk_weight_moment(shape, chunk, tokens, parallel)
                                            for chunk in chunks})


@dataclass(frozen=True)
class RankStates:
    """What the memory model reads of one rank's actions (``rank_states``), weighed per model by its bytes per stage:
    the ``in_flight_states``; the ``forward_states`` of the loss's stages it runs (None where it runs none); and per
    stage the ``backward_states`` at which its backwards rebuild and work."""

    in_flight: frozenset[InFlightState]
    loss_forwards: frozenset[InFlightState] | None
    backwards: dict[tuple[str, int], frozenset[InFlightState]]  # by (kind, stage) of its backwards (BW, B, W)


def rank_states(actions: Iterable[tuple[str, int]], loss_stages: Iterable[int]) -> RankStates:
    """The ``RankStates`` of a rank's ``(kind, stage)`` actions, ``loss_stages`` those of its stages that compute the
    loss."""
    actions, loss_stages = list(actions), set(loss_stages)
    backwards = {action for action in actions if action[0] in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
    return RankStates(in_flight_states(actions), forward_states(actions, loss_stages) if loss_stages else None,
                      {action: backward_states(actions, *action) for action in backwards})


def rank_memory(shape: ModelShape, chunks: Sequence[Chunk], states: RankStates, tokens: Tokens,
                parallel: Parallelism) -> MemoryParts:
    """One pipeline rank's predicted memory (one TP rank of it; every TP and DP rank alike); ``states``: the
    ``RankStates`` of its actions.

    ``activations``: the most the rank keeps at the end of an action, or while a backward rebuilds a recomputed
    group (what it holds as that backward starts, plus the group). The step's peak is the largest of two kinds of
    moment: a backward's (what the rank holds as it starts, its rebuilt group and its working memory), and the
    loss's forward (what the rank holds then and the logits' workspace), which never runs within a rebuild;
    ``buffers`` holds the part of that peak above ``activations``, and the messages in flight."""
    parameters = sum(chunk_parameters(shape, chunk, parallel.tp, parallel.ep) for chunk in chunks)
    # at ep=1 the experts are dense parameters to the optimizer: reduced and sharded over the same replicas
    experts = sum(chunk.moe_layers for chunk in chunks) * expert_layer_parameters(shape, parallel.ep) \
        if parallel.ep > 1 else 0
    parameters, gradients, optimizer = state_parts(parameters, parallel, experts)
    tables = activation_tables(shape, chunks, tokens, parallel)
    kept_peak = in_flight_peak(states.in_flight, tables.kept, tables.stash)
    # what the rank holds as each stage's rebuilding backward starts: a whole backward, a split B, or the first
    # stage's W (its B defers the whole backward to W); and as a split W starts
    rebuilding = {chunk.stage: _held_as(states, tables, rebuilding_kind(chunk, parallel), chunk.stage)
                  for chunk in chunks}
    weights = [_held_as(states, tables, BACKWARD_WEIGHT, stage) + working
               for stage, working in tables.weight_working.items() if working]
    activations = max([kept_peak, *(held + tables.rebuilt[stage] for stage, held in rebuilding.items())])
    backward = max([0, *weights, *(held + tables.rebuilt[stage] + tables.working[stage]
                                   for stage, held in rebuilding.items())])
    message = DTYPE_BYTES[parallel.precision] * tokens.batch * tokens.seq * shape.hidden
    message //= parallel.tp if parallel.sequence_parallel else 1
    loss_held = kept_peak if states.loss_forwards is None else in_flight_peak(states.loss_forwards, tables.kept,
                                                                               tables.stash)
    loss_moment = loss_held + loss_workspace_bytes(shape, chunks, tokens, parallel)
    buffers = 2 * message + max(backward, loss_moment, activations) - activations
    return MemoryParts(parameters, gradients, optimizer, activations, buffers)


def rebuilding_kind(chunk: Chunk, parallel: Parallelism) -> str:
    """The kind of action whose backward of ``chunk`` rebuilds its recomputed groups and holds its working memory:
    BW, a split B, or W on the first stage, whose B defers the whole backward to W."""
    if not parallel.split_backward:
        return BACKWARD
    return BACKWARD_WEIGHT if chunk.pre_process else BACKWARD_INPUT


def _held_as(states: RankStates, tables: ActivationTables, kind: str, stage: int) -> int:
    """The most the rank holds as its ``kind`` actions of ``stage`` start (``backward_states``; 0 where none)."""
    return in_flight_peak(states.backwards.get((kind, stage), ()), tables.kept, tables.stash)


def kept_peak_bytes(shape: ModelShape, chunks: Sequence[Chunk], states: RankStates, tokens: Tokens,
                    parallel: Parallelism) -> int:
    """The most the rank keeps at the end of any action (``rank_memory``'s activations but a rebuilt group)."""
    tables = activation_tables(shape, chunks, tokens, parallel)
    return in_flight_peak(states.in_flight, tables.kept, tables.stash)


# --- from a config ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigMemoryInputs:
    """What the memory model reads from a config: the model's shape, one microbatch's tokens on a rank, the parallel
    sizes and run settings, each pp rank's chunks (``chunks[pp_rank]``) and the weight versions a rank keeps."""

    shape: ModelShape
    tokens: Tokens
    parallel: Parallelism
    chunks: list[list[Chunk]]
    weight_versions: int


def config_memory_inputs(resolved) -> ConfigMemoryInputs:
    """The ``ConfigMemoryInputs`` of a ``ResolvedConfig`` (``ppctl.resolve.resolved``: its config, layout, built
    schedule and layer map)."""
    from ppctl.pipeline.schedules import streams_steps

    config, layout = resolved.config, resolved.layout
    model, parallel_config, trainer = config.model, config.parallel, config.trainer
    half = trainer.precision in ("bf16", "fp16")
    streams = streams_steps(resolved.schedule)
    replicas = parallel_config.dp * parallel_config.cp * layout.placement.copies
    parallel = Parallelism(
        tp=parallel_config.tp, cp=parallel_config.cp, sequence_parallel=parallel_config.sequence_parallel,
        cp_comm=parallel_config.cp_comm, precision=trainer.precision,
        bucketed_optimizer=config.optimizer.distributed or half or streams,
        optimizer_shards=replicas if config.optimizer.distributed else 1, ep=layout.ep,
        expert_optimizer_shards=layout.edp * layout.placement.copies if config.optimizer.distributed else 1,
        recompute=model.recompute, recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers, split_backward=resolved.schedule.splits_backward)
    return ConfigMemoryInputs(shape=resolved.model.memory_shape,
                              tokens=Tokens(trainer.micro_batch_size, trainer.seq_length // parallel_config.cp),
                              parallel=parallel, chunks=rank_chunks(resolved),
                              weight_versions=2 if streams or config.optimizer.gradient_delay else 1)


def rank_chunks(resolved) -> list[list[Chunk]]:
    """The ``Chunk`` of each stage of a ``ResolvedConfig``, per pp rank."""
    moe = resolved.model.moe
    chunks: list[list[Chunk]] = [[] for _ in range(resolved.layout.pp)]
    for (pp_rank, _), stage in resolved.layer_map.items():
        moe_layers = sum(map(moe.is_moe_layer, stage.layers)) if moe is not None else 0
        chunks[pp_rank].append(Chunk(stage.stage, len(stage.layers), stage.pre_process, stage.post_process, moe_layers))
    return chunks


def config_memory(resolved, states: list[RankStates] | None = None) -> list[MemoryParts]:
    """The predicted memory of every pipeline rank of a ``ResolvedConfig``, by pp rank; ``states``: its schedule's
    ``schedule_states``, when the caller has them already."""
    inputs = config_memory_inputs(resolved)
    states = states or schedule_states(resolved.schedule)
    memory = []
    for pp_rank, chunks in enumerate(inputs.chunks):
        parts = rank_memory(inputs.shape, chunks, states[pp_rank], inputs.tokens, inputs.parallel)
        extra_weights = (inputs.weight_versions - 1) * parts.parameters  # the previous weights kept as well
        memory.append(MemoryParts(parts.parameters + extra_weights, parts.gradients, parts.optimizer,
                                  parts.activations, parts.buffers))
    return memory


def config_kept_peaks(resolved) -> list[int]:
    """Per pp rank of a ``ResolvedConfig``, ``kept_peak_bytes``: its predicted activations but a rebuilt group."""
    inputs = config_memory_inputs(resolved)
    return [kept_peak_bytes(inputs.shape, chunks, states, inputs.tokens, inputs.parallel)
            for chunks, states in zip(inputs.chunks, schedule_states(resolved.schedule))]


def schedule_states(schedule) -> list[RankStates]:
    """Per pp rank, the ``rank_states`` of its actions in ``schedule`` (its loss stages: the last stages of the
    model copies it runs)."""
    placement = schedule.placement
    return [rank_states([(action.kind, action.stage) for action in rank_actions],
                        set(placement.loss_stages).intersection(placement.stages_of(pp_rank)))
            for pp_rank, rank_actions in enumerate(schedule.actions)]


def config_activation_tables(resolved) -> list[ActivationTables]:
    """Each pp rank's ``ActivationTables`` for a ``ResolvedConfig`` (as ``config_memory`` reads them)."""
    inputs = config_memory_inputs(resolved)
    return [activation_tables(inputs.shape, chunks, inputs.tokens, inputs.parallel) for chunks in inputs.chunks]


def config_activation_timelines(resolved, sim_result) -> list[list[tuple[float, int]]]:
    """Per pp rank, the activation bytes it holds over the simulated time of ``sim_result`` (a ``SimResult`` of
    the resolved config's schedule, one step or several), as ``activation_bytes_over_time`` points; the
    recomputation's working set (``ActivationTables.rebuilt``) is not in them."""
    tables = config_activation_tables(resolved)
    return [activation_bytes_over_time(timeline.actions, table.kept, table.stash)
            for timeline, table in zip(sim_result.ranks, tables)]
