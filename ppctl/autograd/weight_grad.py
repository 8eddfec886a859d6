"""Deferred weight gradients: the layers' half of a backward split into B (input gradient) and W (weights).

Zero-bubble schedules run a stage's backward in two actions. B must produce the
gradient of the stage input as early as possible, so it should compute nothing else;
W, run later to fill a bubble, computes the weight gradients. Walking the autograd
graph twice (once for the input, once for the weights) would cost B + W for W and keep
the whole graph alive in between; instead every op with weights runs as one autograd
Function (``split_op``) that, during a B, computes only its input gradient and stashes
what its weight gradient needs (a linear's input X and output gradient dY, a norm's
input and statistics) in a ``WeightGradStore``. The graph is freed after B; W pops
the microbatch's stash and computes the weight gradients from it.

The store is an object, not global state: a pipeline stage owns one and hands it to
the layers of its chunk that can defer (``attach_weight_grad_store``); its switch,
``store.defer(key)``, is on only around B's autograd call. Any other backward (a whole
``BW``, a plain ``loss.backward()``) finds the switch off and computes the weight
gradients at once, through the same Function and the same ops as W: split and whole
backwards give bitwise equal gradients.

W hands its gradients to autograd (``torch.autograd.backward`` on each parameter), so
they go through AccumulateGrad like those of a whole backward: ``param.grad`` is
accumulated the same way and post-accumulate hooks (the distributed optimizer's) fire
once per parameter per microbatch.
"""

from __future__ import annotations

from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable

from ppctl.autograd.compiled import outside_graph

Grads = tuple["torch.Tensor | None", ...]


# ---------------------------------------------------------------------------
# Ops whose weight gradient can be deferred
# ---------------------------------------------------------------------------

class SplitOp:
    """One op with weights, described by three functions: its forward, its input gradient, its weight gradients.

    ``forward(inputs, weights) -> (output, saved)``: ``saved`` are the tensors both
    gradients need (besides the weights). ``weight_grads`` gets ``wanted``, one flag per
    weight (False for an absent or frozen one), and returns one gradient or None per weight.
    ``defers`` says whether a B stashes the weight-gradient work for W (a matmul) or does
    it at once (a cheap reduction whose stash, dY, would cost more memory than it saves time).
    """

    defers = True

    def forward(self, inputs: torch.Tensor, weights: Sequence) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Return the op's output and the tensors its backward needs."""
        raise NotImplementedError

    def input_grad(self, grad_output: torch.Tensor, saved: tuple, weights: tuple) -> torch.Tensor:
        """Return the gradient of the op's input."""
        raise NotImplementedError

    def weight_grads(self, grad_output: torch.Tensor, saved: tuple, weights: tuple, wanted: Sequence[bool]) -> Grads:
        """Return the gradient of each weight (None where not ``wanted``)."""
        raise NotImplementedError


def _flatten_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """``[..., features] -> [tokens, features]``: every leading dim is a batch dim for a weight gradient."""
    return tensor.reshape(-1, tensor.shape[-1])


class LinearOp(SplitOp):
    """``inputs @ weight.T + bias``: dX = dY W; dW = dY^T X and db = sum of dY, over the flattened tokens."""

    def forward(self, inputs, weights):
        """Return ``F.linear`` of the inputs; keeps X for dW."""
        weight, bias = weights
        return F.linear(inputs, weight, bias), (inputs,)

    def input_grad(self, grad_output, saved, weights):
        """dX = dY W."""
        return grad_output.matmul(weights[0])

    def weight_grads(self, grad_output, saved, weights, wanted):
        """dW = dY^T X, db = dY summed over tokens (in the parameters' dtype)."""
        (inputs,), (weight, bias) = saved, weights
        grad_2d = _flatten_tokens(grad_output)
        grad_weight = grad_2d.t().mm(_flatten_tokens(inputs)).to(weight.dtype) if wanted[0] else None
        grad_bias = grad_2d.sum(dim=0).to(bias.dtype) if wanted[1] else None
        return grad_weight, grad_bias


@dataclass(frozen=True)
class GroupedLinearOp(SplitOp):
    """One linear per group of rows (a mixture's experts): rows ``[start_g, start_g + counts[g])`` of the input go
    through ``weight[g]`` (``[groups, out, in]``) and ``bias[g]``. dX and dW per group as ``LinearOp``'s; dW is
    ``[groups, out, in]``, a group without rows gets zeros."""

    counts: tuple[int, ...]

    def forward(self, inputs, weights):
        """Each group's rows through its own weight, concatenated; keeps X for dW."""
        weight, bias = weights
        blocks = inputs.split(self.counts)
        outputs = [F.linear(block, weight[group], None if bias is None else bias[group])
                   for group, block in enumerate(blocks)]
        return torch.cat(outputs), (inputs,)

    def input_grad(self, grad_output, saved, weights):
        """dX = dY_g W_g for each group's rows."""
        return torch.cat([grad.matmul(weights[0][group])
                          for group, grad in enumerate(grad_output.split(self.counts))])

    def weight_grads(self, grad_output, saved, weights, wanted):
        """dW_g = dY_g^T X_g and db_g = dY_g summed over the group's rows."""
        (inputs,), (weight, bias) = saved, weights
        grads, blocks = grad_output.split(self.counts), inputs.split(self.counts)
        grad_weight = (torch.stack([grad.t().mm(block) for grad, block in zip(grads, blocks)]).to(weight.dtype)
                       if wanted[0] else None)
        grad_bias = torch.stack([grad.sum(dim=0) for grad in grads]).to(bias.dtype) if wanted[1] else None
        return grad_weight, grad_bias


class BiasAddOp(SplitOp):
    """``inputs + bias`` (a row-parallel layer's bias, added after its partial outputs are summed).

    A B computes db itself (a sum over tokens; W accumulates it): stashing dY for it would hold
    a whole activation per bias until W.
    """

    defers = False

    def forward(self, inputs, weights):
        """Return ``inputs + bias``; nothing to keep."""
        return inputs + weights[0], ()

    def input_grad(self, grad_output, saved, weights):
        """The gradient passes through unchanged."""
        return grad_output

    def weight_grads(self, grad_output, saved, weights, wanted):
        """db = dY summed over tokens."""
        return (_flatten_tokens(grad_output).sum(dim=0).to(weights[0].dtype) if wanted[0] else None,)


@dataclass(frozen=True)
class LayerNormOp(SplitOp):
    """Layer norm over the last dims ``normalized_shape``, with an elementwise scale and shift.

    ATen's fused kernels do the math; its backward takes a mask of the gradients to
    compute, so the input gradient and the weight gradients are two calls of it. A B
    computes the scale and shift gradients itself (two reductions; W accumulates them):
    stashing the norm's input and dY as well made the stash 1.23x the forward's saved
    activations against 0.98x without (``benchmarks/bw_split.py``), at no measurable cost to B.
    """

    defers = False

    normalized_shape: tuple[int, ...]
    eps: float

    def forward(self, inputs, weights):
        """Return the normalised, scaled and shifted inputs; keeps the inputs, their mean and 1/std."""
        output, mean, rstd = torch.native_layer_norm(inputs, self.normalized_shape, *weights, self.eps)
        return output, (inputs, mean, rstd)

    def _backward(self, grad_output, saved, weights, mask: list[bool]) -> Grads:
        inputs, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(grad_output, inputs, self.normalized_shape, mean, rstd,
                                                         *weights, mask)

    def input_grad(self, grad_output, saved, weights):
        """The input gradient alone (ATen's backward with only its first output asked)."""
        return self._backward(grad_output, saved, weights, [True, False, False])[0]

    def weight_grads(self, grad_output, saved, weights, wanted):
        """Scale and shift gradients alone (ATen's backward without the input gradient)."""
        return tuple(self._backward(grad_output, saved, weights, [False, *wanted])[1:])


def _rms_unit(inputs: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs / rms(inputs)`` and ``1 / rms``, in float32 or wider (Llama's norm upcasts half precision)."""
    upcast = inputs.to(torch.promote_types(inputs.dtype, torch.float32))
    rstd = torch.rsqrt(upcast.pow(2).mean(dim=-1, keepdim=True) + eps)
    return upcast * rstd, rstd


@dataclass(frozen=True)
class RMSNormOp(SplitOp):
    """RMS norm over the last dim with an elementwise scale, as Llama computes it.

    ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the normalisation in float32 or
    wider. Like ``LayerNormOp``, a B computes the scale gradient itself (one reduction;
    W accumulates it) rather than stash the norm's input and dY for W.
    """

    defers = False

    eps: float

    def forward(self, inputs, weights):
        """Return the normalised, scaled inputs; keeps the inputs and 1/rms (in the compute dtype)."""
        unit, rstd = _rms_unit(inputs, self.eps)
        return weights[0] * unit.to(inputs.dtype), (inputs, rstd)

    def input_grad(self, grad_output, saved, weights):
        """dX = rstd * (dU - U * mean(dU * U)), U the unit-RMS input and dU its gradient (compute dtype)."""
        inputs, rstd = saved
        unit = inputs.to(rstd.dtype) * rstd
        grad_unit = (grad_output * weights[0]).to(rstd.dtype)
        grad_input = rstd * (grad_unit - unit * (grad_unit * unit).mean(dim=-1, keepdim=True))
        return grad_input.to(inputs.dtype)

    def weight_grads(self, grad_output, saved, weights, wanted):
        """dW = dY * U summed over tokens, U the unit-RMS input cast back to the input dtype."""
        if not wanted[0]:
            return (None,)
        inputs, rstd = saved
        unit = (inputs.to(rstd.dtype) * rstd).to(inputs.dtype)
        return (_flatten_tokens(grad_output * unit).sum(dim=0).to(weights[0].dtype),)


# ---------------------------------------------------------------------------
# The autograd Function and what a B leaves for its W
# ---------------------------------------------------------------------------

@dataclass
class DeferredWeightGrads:
    """What one op's weight gradients need, stashed by a B: its op, dY, its saved tensors and weights."""

    op: SplitOp
    grad_output: torch.Tensor
    saved: tuple
    weights: tuple
    wanted: tuple[bool, ...]

    def targets(self) -> list[torch.Tensor]:
        """The weights that ``compute`` gives a gradient."""
        return [weight for weight, wanted in zip(self.weights, self.wanted) if wanted]

    def compute(self) -> Grads:
        """The weight gradients, one per weight (None where not wanted)."""
        return self.op.weight_grads(self.grad_output, self.saved, self.weights, self.wanted)

    def held_tensors(self) -> list[torch.Tensor]:
        """The activations kept for W (the weights are parameters: not counted)."""
        return [self.grad_output, *self.saved]


@dataclass
class ComputedWeightGrads:
    """Weight gradients a B had to compute itself (parameters of ops that cannot defer), kept for W to accumulate."""

    weights: tuple
    grads: tuple

    def targets(self) -> list[torch.Tensor]:
        """The weights B computed a gradient for."""
        return [weight for weight, grad in zip(self.weights, self.grads) if grad is not None]

    def compute(self) -> Grads:
        """The gradients, as B computed them."""
        return self.grads

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradients kept for W."""
        return [grad for grad in self.grads if grad is not None]


class _SplitWeightGrad(torch.autograd.Function):
    """Runs a ``SplitOp``; its backward defers the weight gradients when the store is deferring."""

    @staticmethod
    def forward(ctx, op: SplitOp, store: "WeightGradStore | None", inputs: torch.Tensor, *weights):
        output, saved = op.forward(inputs, weights)
        # The weights are kept as themselves, not as saved tensors: W hands their gradients to autograd
        # by object, and a recomputed region (activation checkpointing) gives back saved tensors as
        # other objects. Parameters are leaves, so holding them here makes no reference cycle.
        ctx.op, ctx.store, ctx.weights = op, store, weights
        ctx.save_for_backward(*saved)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved, weights = ctx.saved_tensors, ctx.weights
        grad_input = ctx.op.input_grad(grad_output, saved, weights) if ctx.needs_input_grad[2] else None
        wanted = tuple(ctx.needs_input_grad[3:])
        if not any(wanted):
            return (None, None, grad_input, *(None,) * len(weights))
        if ctx.store is not None and ctx.store.deferring and ctx.op.defers:
            ctx.store.stash(DeferredWeightGrads(ctx.op, grad_output, saved, weights, wanted))
            return (None, None, grad_input, *(None,) * len(weights))
        return (None, None, grad_input, *ctx.op.weight_grads(grad_output, saved, weights, wanted))


@outside_graph  # its backward asks the store at run time: never traced into a compiled graph (trainer.compile)
def split_op(op: SplitOp, inputs: torch.Tensor, weights: Sequence, store: "WeightGradStore | None") -> torch.Tensor:
    """Apply ``op`` to ``inputs`` with ``weights``; with a deferring ``store`` its weight gradients wait for W."""
    return _SplitWeightGrad.apply(op, store, inputs, *weights)


# Without a store (a stage whose schedule never splits its backward, or no pipeline at all) the
# layers run PyTorch's own ops: a Python autograd Function per op made a small model's backward
# about 37% slower.

def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           store: "WeightGradStore | None") -> torch.Tensor:
    """``F.linear`` whose weight and bias gradients a B defers to W (plain ``F.linear`` without a store)."""
    if store is None:
        return F.linear(inputs, weight, bias)
    return split_op(LinearOp(), inputs, (weight, bias), store)


def grouped_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: Sequence[int],
                   store: "WeightGradStore | None") -> torch.Tensor:
    """Rows in groups of ``counts`` through ``weight[g]`` and ``bias[g]`` (``GroupedLinearOp``); with a store the
    weight gradients wait for W (without one, the same linears as PyTorch's own ops)."""
    if store is None:
        blocks = inputs.split(list(counts))
        return torch.cat([F.linear(block, weight[group], None if bias is None else bias[group])
                          for group, block in enumerate(blocks)])
    return split_op(GroupedLinearOp(tuple(counts)), inputs, (weight, bias), store)


def add_bias(inputs: torch.Tensor, bias: torch.Tensor, store: "WeightGradStore | None") -> torch.Tensor:
    """``inputs + bias``; with a store, run as a split op (its B computes db, its W accumulates it)."""
    if store is None:
        return inputs + bias
    return split_op(BiasAddOp(), inputs, (bias,), store)


def layer_norm(inputs: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float, store: "WeightGradStore | None") -> torch.Tensor:
    """``F.layer_norm``; with a store, run as a split op (its B computes the scale and shift gradients)."""
    if store is None:
        return F.layer_norm(inputs, normalized_shape, weight, bias, eps)
    return split_op(LayerNormOp(tuple(normalized_shape), eps), inputs, (weight, bias), store)


def rms_norm(inputs: torch.Tensor, weight: torch.Tensor, eps: float,
             store: "WeightGradStore | None") -> torch.Tensor:
    """Llama's RMS norm over the last dim; with a store, run as a split op (its B computes the scale gradient)."""
    if store is None:
        unit, _ = _rms_unit(inputs, eps)
        return weight * unit.to(inputs.dtype)
    return split_op(RMSNormOp(eps), inputs, (weight,), store)


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------

class WeightGradStore:
    """One stage's deferred weight-gradient work, keyed by the microbatch whose B stashed it.

    ``defer(key)`` turns deferral on for one B; ``accumulate(key)`` is that microbatch's W.
    """

    def __init__(self):
        self._stashes: dict[Hashable, list] = {}
        self._deferring_key: Hashable | None = None

    @property
    def deferring(self) -> bool:
        """Whether a B is running: split ops stash their weight-gradient work instead of computing it."""
        return self._deferring_key is not None

    @contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Within this block (one B's autograd call), stash weight-gradient work under ``key``."""
        if self.deferring:
            raise RuntimeError(f"WeightGradStore: B of {key} started inside the B of {self._deferring_key}")
        if key in self._stashes:
            raise RuntimeError(f"WeightGradStore: a second B of {key} before its W")
        self._stashes[key] = []
        self._deferring_key = key
        try:
            yield
        except BaseException:
            del self._stashes[key]  # a failed B leaves no half stash for a W to find
            raise
        finally:
            self._deferring_key = None

    def stash(self, entry: DeferredWeightGrads | ComputedWeightGrads) -> None:
        """Keep one op's weight-gradient work for the W of the microbatch whose B is running."""
        if not self.deferring:
            raise RuntimeError("WeightGradStore.stash outside a B (use defer(key))")
        self._stashes[self._deferring_key].append(entry)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._stashes

    def pending(self) -> bool:
        """Whether some B's weight-gradient work still waits for its W."""
        return bool(self._stashes)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor kept between a B and its W (for memory accounting)."""
        return [tensor for entries in self._stashes.values() for entry in entries for tensor in entry.held_tensors()]

    def accumulate(self, key: Hashable, pause: Callable[[], None] = lambda: None) -> None:
        """W: compute the weight gradients ``key``'s B stashed and accumulate them through autograd.

        Each op's gradients go to autograd as soon as its weights have all their
        contributions (a weight shared by two ops gets their sum once, as a whole backward
        gives it), and each stash entry is dropped once used. ``pause()`` is called between two
        entries (a weight fill lets its backward go on there: ``ppctl.pipeline.interleave``).
        """
        if key not in self._stashes:
            raise RuntimeError(f"WeightGradStore: W of {key} without its B (no stashed weight gradients)")
        entries = deque(self._stashes.pop(key))
        count = len(entries)
        uses = Counter(id(weight) for entry in entries for weight in entry.targets())
        summed: dict[int, torch.Tensor] = {}
        while entries:
            if len(entries) < count:
                pause()  # between two entries: a weight fill's backward may go on here
            entry = entries.popleft()
            ready = []
            for weight, grad in zip(entry.weights, entry.compute()):
                if grad is None:
                    continue
                summed[id(weight)] = grad if id(weight) not in summed else summed[id(weight)] + grad
                uses[id(weight)] -= 1
                if uses[id(weight)] == 0:
                    ready.append(weight)
            if ready:
                _accumulate_grads(ready, [summed.pop(id(weight)) for weight in ready])


def _accumulate_grads(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(weights, grads)`` on leaves, straight to the engine (its Python checks cost
    more than a small layer's gradient): AccumulateGrad adds each into ``.grad`` and runs its hooks."""
    Variable._execution_engine.run_backward(tensors=tuple(weights), grad_tensors=tuple(grads), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


# ---------------------------------------------------------------------------
# Modules that can defer
# ---------------------------------------------------------------------------

class DefersWeightGrads:
    """Mixin of a module whose weight gradients can wait for a W: its ops read ``self.weight_grad_store``.

    None (the default) computes weight gradients at once; a pipeline stage sets its
    store with ``attach_weight_grad_store``.
    """

    weight_grad_store: WeightGradStore | None = None


def attach_weight_grad_store(module: nn.Module, store: WeightGradStore | None) -> None:
    """Hand ``store`` to every submodule of ``module`` (itself included) that can defer its weight gradients."""
    for submodule in module.modules():
        if isinstance(submodule, DefersWeightGrads):
            submodule.weight_grad_store = store
