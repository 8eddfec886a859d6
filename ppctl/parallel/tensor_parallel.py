"""Megatron-style tensor parallelism: the TP group, its communication regions, and TP layers.

A tensor-parallel block is entered through ``copy_to_tp_region`` (identity forward,
all-reduce backward) and left through ``reduce_from_tp_region`` (all-reduce forward,
identity backward). Between the two, every TP rank works on its own slice of the
weights: a column-parallel linear splits its output features (weight rows), a
row-parallel linear splits its input features (weight columns) and all-reduces its
partial outputs. Activations outside the regions are replicated on every TP rank, and
so are their gradients.

With sequence parallelism (``TPGroup.sequence_parallel``, Megatron-LM's
``--sequence-parallel``) the activations outside the regions are split along the
sequence instead of replicated: each TP rank holds ``seq / tp`` tokens of the norms
and residual stream. A region is then entered by an all-gather along the sequence
(reduce-scatter of the gradient) and left by a reduce-scatter (all-gather of the
gradient): the same bytes as the all-reduce, a tp-th of the activation memory.
``enter_tp_region`` / ``leave_tp_region`` pick the pair; every layer goes through them.
Parameters that act on the split sequence (norms, row-parallel biases, the learned
position table: the TP-replicated ones) then see only their rank's tokens, so their
gradients are summed over TP after the backward (``ppctl.optim.grads``).

The linear layers' matmuls and biases run through ``ppctl.autograd.weight_grad``, so a
pipeline B can defer their weight gradients to W; that Function does no communication:
the regions around it stay as they are, and their backward collectives all run in B.

Where overlapped pairs run interleaved (``parallel.overlap_ep_comm``) the group's lanes give it a
second communicator for the backward's collectives and let the other half compute while each
collective travels (``ppctl.parallel.lanes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ppctl.autograd.compiled import outside_graph
from ppctl.autograd.weight_grad import DefersWeightGrads, WeightGradStore, add_bias, linear
from ppctl.parallel.lanes import ONE_LANE, Lanes, OnLanes


@dataclass(frozen=True)
class TPGroup(OnLanes):
    """The tensor-parallel group one rank belongs to.

    ``group`` is a ``torch.distributed`` ProcessGroup (None for tp=1, where nothing is
    communicated), ``size`` the number of TP ranks, ``rank`` this process's index in it;
    ``lanes``: the worker's (``ppctl.parallel.lanes``), which its collectives go through.
    """

    group: object | None
    size: int
    rank: int
    sequence_parallel: bool = False
    lanes: Lanes = field(default=ONE_LANE, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank must be in [0, size) and size >= 1, got rank={self.rank} size={self.size}")
        if self.sequence_parallel and self.size == 1:
            raise ValueError("TPGroup: sequence parallelism needs more than one TP rank")

    @staticmethod
    def single() -> "TPGroup":
        """Return the trivial group of one rank (tp=1): every collective is a no-op."""
        return TPGroup(group=None, size=1, rank=0)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """Return this rank's contiguous slice of ``full`` along ``dim`` (size must divide evenly)."""
        if full.shape[dim] % self.size != 0:
            raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} over tp={self.size}")
        return full.chunk(self.size, dim=dim)[self.rank]

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """Return ``[start, end)`` of the vocabulary ids this rank owns (contiguous ranges)."""
        if vocab_size % self.size != 0:
            raise ValueError(f"vocab_size {vocab_size} must be padded to a multiple of tp={self.size}")
        per_rank = vocab_size // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank


# ---------------------------------------------------------------------------
# Collectives (plain tensors in, new tensors out; never modify the input)
# ---------------------------------------------------------------------------

def _all_reduce(tensor: torch.Tensor, tp: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    result = tensor.clone(memory_format=torch.contiguous_format)
    if tp.size > 1:
        tp.post(dist.all_reduce, result, op=op)
    return result


def _all_gather_last_dim(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(tp.size)]
    tp.post(dist.all_gather, pieces, tensor)
    return torch.cat(pieces, dim=-1)


def _split_last_dim(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return tp.shard(tensor, dim=-1).contiguous()


SEQUENCE_DIM = 1  # activations are [batch, seq, hidden]

# torch 2.13 renamed the single-tensor collectives (the old names warn); older versions
# have only the old names. Same arguments: (output, input, group=...).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_sequence(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate every TP rank's sequence slice, in rank order."""
    leading = tensor.movedim(SEQUENCE_DIM, 0).contiguous()
    gathered = leading.new_empty((tp.size * leading.shape[0], *leading.shape[1:]))
    tp.post(all_gather_single, gathered, leading)
    return gathered.movedim(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum over TP ranks and keep this rank's slice of the sequence."""
    leading = tensor.movedim(SEQUENCE_DIM, 0).contiguous()
    if leading.shape[0] % tp.size:
        raise ValueError(f"sequence length {leading.shape[0]} not divisible by tp={tp.size}")
    scattered = leading.new_empty((leading.shape[0] // tp.size, *leading.shape[1:]))
    tp.post(reduce_scatter_single, scattered, leading)
    return scattered.movedim(0, SEQUENCE_DIM)


# ---------------------------------------------------------------------------
# Autograd regions
# ---------------------------------------------------------------------------

def _region(name: str, forward, backward, doc: str) -> type:
    """An autograd Function applying ``forward(tensor, tp)`` and, to the gradient, ``backward(grad, tp)``."""

    def forward_with_context(ctx, tensor, tp):
        ctx.tp = tp
        return forward(tensor, tp)

    def backward_with_context(ctx, grad_output):
        return backward(grad_output, ctx.tp), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward_with_context),
                                                   "backward": staticmethod(backward_with_context), "__doc__": doc})


def _identity(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return tensor.view_as(tensor)  # a new tensor object, as autograd needs


_CopyToTPRegion = _region("_CopyToTPRegion", _identity, _all_reduce,
                          "Identity forward; all-reduce of the gradient backward.")
_ReduceFromTPRegion = _region("_ReduceFromTPRegion", _all_reduce, _identity,
                              "All-reduce forward; identity backward.")
_GatherFromTPRegion = _region("_GatherFromTPRegion", _all_gather_last_dim, _split_last_dim,
                              "All-gather along the last dim forward; keep this rank's slice of the gradient.")
_ScatterToTPRegion = _region("_ScatterToTPRegion", _split_last_dim, _all_gather_last_dim,
                             "Keep this rank's slice along the last dim forward; all-gather the gradient.")
# The consumer of a gathered sequence is a column-parallel layer, whose input gradient on
# each rank is a partial sum: the backward reduce-scatter both sums it and hands each rank its tokens.
_GatherFromSequenceParallelRegion = _region(
    "_GatherFromSequenceParallelRegion", _all_gather_sequence, _reduce_scatter_sequence,
    "All-gather along the sequence forward; reduce-scatter of the gradient backward.")
_ReduceScatterToSequenceParallelRegion = _region(
    "_ReduceScatterToSequenceParallelRegion", _reduce_scatter_sequence, _all_gather_sequence,
    "Sum partial results and keep this rank's tokens forward; all-gather the gradient backward.")


@outside_graph  # a collective waits on its lane (and a pair's turn): eager, between compiled graphs
def _apply_region(region: type, tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``region.apply(tensor, tp)``: a TP/SP region's collective, outside any compiled graph (``trainer.compile``)."""
    return region.apply(tensor, tp)


def enter_tp_region(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The input of a column-parallel layer: replicated (copy) or, with SP, gathered along the sequence."""
    if tp.sequence_parallel:
        return _apply_region(_GatherFromSequenceParallelRegion, tensor, tp)
    return copy_to_tp_region(tensor, tp)


def leave_tp_region(partial: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum per-rank partial results: all-reduced or, with SP, reduce-scattered along the sequence."""
    if tp.sequence_parallel:
        return _apply_region(_ReduceScatterToSequenceParallelRegion, partial, tp)
    return reduce_from_tp_region(partial, tp)


def sequence_slice(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's tokens of a ``[batch, seq, ...]`` tensor under SP (the whole tensor without SP)."""
    return tp.shard(tensor, dim=SEQUENCE_DIM) if tp.sequence_parallel else tensor


def copy_to_tp_region(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Enter a TP region with a replicated tensor: identity forward, gradient all-reduced backward."""
    return tensor if tp.size == 1 else _apply_region(_CopyToTPRegion, tensor, tp)


def reduce_from_tp_region(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return tensor if tp.size == 1 else _apply_region(_ReduceFromTPRegion, tensor, tp)


def gather_from_tp_region(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate every rank's last-dim slice (forward); split the gradient back (backward)."""
    return tensor if tp.size == 1 else _apply_region(_GatherFromTPRegion, tensor, tp)


def scatter_to_tp_region(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Keep this rank's last-dim slice (forward); all-gather the gradient (backward)."""
    return tensor if tp.size == 1 else _apply_region(_ScatterToTPRegion, tensor, tp)


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------

def column_parallel_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           tp: TPGroup, store: WeightGradStore | None = None) -> torch.Tensor:
    """``inputs @ weight.T + bias`` where ``weight``/``bias`` hold this rank's output rows.

    ``inputs`` is replicated across TP ranks (with SP: this rank's tokens, gathered
    here); the result is this rank's slice of the output features for the whole
    sequence. Used by ColumnParallelLinear and by a tied output layer. With a
    deferring ``store`` (a pipeline B) the weight and bias gradients wait for W.
    """
    return linear(enter_tp_region(inputs, tp), weight, bias, store)


class ColumnParallelLinear(DefersWeightGrads, torch.nn.Module):
    """Linear layer whose output features (weight rows, and bias) are split across TP ranks.

    ``weight`` is ``[out_features / tp, in_features]``: rank r holds rows
    ``[r * out/tp, (r+1) * out/tp)`` of the full weight. The input is replicated (with SP: this
    rank's tokens, gathered here); the output is this rank's feature slice for the whole
    sequence, or the full output when ``gather_output``.
    Parameters start at zero; the model fills them (see ``ppctl.model.gpt``).
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = True,
                 gather_output: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        if out_features % tp.size != 0:
            raise ValueError(f"ColumnParallelLinear: out_features {out_features} not divisible by tp={tp.size}")
        self.tp = tp
        self.gather_output = gather_output
        local_out = out_features // tp.size
        self.weight = torch.nn.Parameter(torch.zeros(local_out, in_features, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(local_out, dtype=dtype)) if bias else None

    def forward(self, inputs: torch.Tensor, entered: bool = False) -> torch.Tensor:
        """Return this rank's slice of the output features (all of them if ``gather_output``).

        ``entered``: ``inputs`` is already in the TP region (``enter_tp_region``), entered once for several
        projections that read it (one collective, as with a fused weight)."""
        if entered:
            outputs = linear(inputs, self.weight, self.bias, self.weight_grad_store)
        else:
            outputs = column_parallel_linear(inputs, self.weight, self.bias, self.tp, self.weight_grad_store)
        return gather_from_tp_region(outputs, self.tp) if self.gather_output else outputs


class RowParallelLinear(DefersWeightGrads, torch.nn.Module):
    """Linear layer whose input features (weight columns) are split across TP ranks.

    ``weight`` is ``[out_features, in_features / tp]``: rank r holds columns
    ``[r * in/tp, (r+1) * in/tp)`` of the full weight. The input is this rank's feature
    slice (or the full input, split here, unless ``input_is_parallel``); partial outputs
    are all-reduced (with SP: reduce-scattered to each rank's tokens), then the bias
    (replicated on every TP rank) is added once.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = True,
                 input_is_parallel: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        if in_features % tp.size != 0:
            raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by tp={tp.size}")
        self.tp = tp
        self.input_is_parallel = input_is_parallel
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features // tp.size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Return the full output features (replicated, or this rank's tokens with SP)."""
        if not self.input_is_parallel:
            inputs = scatter_to_tp_region(inputs, self.tp)
        outputs = leave_tp_region(linear(inputs, self.weight, None, self.weight_grad_store), self.tp)
        return outputs if self.bias is None else add_bias(outputs, self.bias, self.weight_grad_store)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding whose vocabulary rows are split into contiguous ranges across TP ranks.

    Each rank looks up the ids it owns, writes zeros for the others, and the partial
    embeddings are all-reduced so that every TP rank holds the full, replicated result
    (with SP: reduce-scattered, so each rank holds its tokens' embeddings).
    """

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end = tp.vocab_range(vocab_size)
        self.weight = torch.nn.Parameter(torch.zeros(self.vocab_end - self.vocab_start, embedding_dim, dtype=dtype))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map int64 ids ``[...]`` to embeddings ``[..., embedding_dim]`` (replicated over TP)."""
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        not_mine = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        local_ids = (token_ids - self.vocab_start).masked_fill(not_mine, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(not_mine.unsqueeze(-1), 0.0)
        return leave_tp_region(partial, self.tp)


# ---------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# ---------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them.

    Only the first ``num_real`` columns of this rank's slice are classes; the rest are
    TP padding and take no part (their gradient is zero). Forward: global max and sum
    of exponentials are all-reduced over TP; the target logit comes from the rank
    owning the target id (zeros elsewhere, summed).
    Backward: d loss / d logits = softmax - one_hot(target), on this rank's real columns.
    """

    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_start, num_real):
        real_logits = logits[..., :num_real]
        local_max = (real_logits.max(dim=-1).values if num_real
                     else logits.new_full(logits.shape[:-1], float("-inf")))
        logits_max = _all_reduce(local_max, tp, op=dist.ReduceOp.MAX)
        shifted = real_logits - logits_max.unsqueeze(-1)

        not_mine = (targets < vocab_start) | (targets >= vocab_start + num_real)
        local_targets = (targets - vocab_start).masked_fill(not_mine, 0)
        target_logits = (shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
                         if num_real else torch.zeros_like(logits_max))
        target_logits = _all_reduce(target_logits, tp)

        exp_logits = shifted.exp()
        sum_exp = _all_reduce(exp_logits.sum(dim=-1), tp)
        losses = sum_exp.log() - target_logits

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, not_mine)
        ctx.num_columns = logits.shape[-1]
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_targets, not_mine = ctx.saved_tensors
        num_real = softmax.shape[-1]
        grad_logits = softmax.new_zeros((*softmax.shape[:-1], ctx.num_columns))
        grad_real = grad_logits[..., :num_real]
        grad_real.copy_(softmax)
        if num_real:
            is_target = (~not_mine).to(grad_logits.dtype).unsqueeze(-1)
            grad_real.scatter_add_(-1, local_targets.unsqueeze(-1), -is_target)
        grad_logits.mul_(grad_losses.unsqueeze(-1))
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` from this rank's vocabulary slice of the logits ``[..., V/tp]``.

    ``targets`` are global vocabulary ids. Rank r's slice covers ids
    ``[r * V/tp, (r+1) * V/tp)``, where V is the padded vocabulary; ids from
    ``vocab_size`` (the real vocabulary, default V) on are padding and excluded from
    the softmax, so the result does not depend on the padding. Computed in float32
    (float64 when the logits are float64); the result is identical on every TP rank.
    """
    compute_dtype = torch.float64 if logits_shard.dtype == torch.float64 else torch.float32
    columns = logits_shard.shape[-1]
    vocab_start = tp.rank * columns
    num_real = columns if vocab_size is None else min(max(vocab_size - vocab_start, 0), columns)
    return _VocabParallelCrossEntropy.apply(logits_shard.to(compute_dtype), targets, tp, vocab_start, num_real)
