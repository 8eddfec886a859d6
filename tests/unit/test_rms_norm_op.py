"""Llama's RMS norm as a split op (``ppctl.autograd.weight_grad.rms_norm``), without processes.

The split op's forward and hand-written gradients must equal plain autograd through the
same math (float32 or wider inside, cast back before the scale), and its backward split
into a B and a W must equal a whole backward bit for bit.
"""

import pytest
import torch

from ppctl.autograd.weight_grad import ComputedWeightGrads, WeightGradStore, rms_norm
from ppctl.pipeline.stage import run_backward

EPS = 1e-6
# float32: the hand-written input gradient sums in another order than autograd's chain of ops.
TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def reference_rms_norm(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain autograd: normalise in float32 or wider, cast back, then scale (Hugging Face's LlamaRMSNorm order)."""
    upcast = inputs.to(torch.promote_types(inputs.dtype, torch.float32))
    unit = upcast * torch.rsqrt(upcast.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return weight * unit.to(inputs.dtype)


def make_data(dtype: torch.dtype, seed: int = 3):
    """Inputs ``[2, 5, 6]``, a scale and an output gradient, drawn in float64 and cast to ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(2, 5, 6, dtype=torch.float64, generator=generator)
    weight = 1 + 0.5 * torch.randn(6, dtype=torch.float64, generator=generator)
    grad_output = torch.randn(2, 5, 6, dtype=torch.float64, generator=generator)
    return inputs.to(dtype), weight.to(dtype), grad_output.to(dtype)


def gradients(function, inputs, weight, grad_output):
    """``(output, input gradient, scale gradient)`` of ``function(x, w)`` through a plain backward."""
    x, w = inputs.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    output = function(x, w)
    output.backward(grad_output)
    return output.detach(), x.grad, w.grad


def split_gradients(inputs, weight, grad_output):
    """The same through a B then a W, as a pipeline stage runs them: B computes and keeps, W accumulates."""
    store = WeightGradStore()
    x, w = inputs.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    output = rms_norm(x, w, EPS, store)
    with store.defer("mb"):
        grad_input, grad_weight = run_backward(output, grad_output, inputs=(x, w), accumulate=False)
        store.stash(ComputedWeightGrads((w,), (grad_weight,)))
    assert w.grad is None
    store.accumulate("mb")
    return output.detach(), grad_input, w.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("path", ["plain", "split-op"])
def test_rms_norm_equals_plain_autograd(path, dtype):
    """Forward and both gradients, without a store (plain ops) and with one (the split op, not deferring)."""
    store = None if path == "plain" else WeightGradStore()
    data = make_data(dtype)
    actual = gradients(lambda x, w: rms_norm(x, w, EPS, store), *data)
    expected = gradients(reference_rms_norm, *data)
    for got, wanted, what in zip(actual, expected, ("output", "input grad", "scale grad"), strict=True):
        assert got.dtype == wanted.dtype == dtype
        torch.testing.assert_close(got, wanted, **TOLERANCES[dtype], msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_b_then_w_equals_a_whole_backward_bitwise(dtype):
    data = make_data(dtype)
    whole = gradients(lambda x, w: rms_norm(x, w, EPS, WeightGradStore()), *data)
    split = split_gradients(*data)
    for got, wanted, what in zip(split, whole, ("output", "input grad", "scale grad"), strict=True):
        assert torch.equal(got, wanted), what


def test_half_precision_normalises_in_float32_then_casts_back():
    """bf16 in: the statistics in float32, the unit-RMS input rounded to bf16 before the bf16 scale."""
    inputs, weight, grad_output = make_data(torch.bfloat16)
    for store in (None, WeightGradStore()):
        assert torch.equal(rms_norm(inputs, weight, EPS, store), reference_rms_norm(inputs, weight))
    output, grad_input, grad_weight = gradients(lambda x, w: rms_norm(x, w, EPS, WeightGradStore()),
                                                inputs, weight, grad_output)
    expected = gradients(reference_rms_norm, inputs, weight, grad_output)
    assert grad_input.dtype == grad_weight.dtype == torch.bfloat16
    torch.testing.assert_close(grad_input, expected[1], rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(grad_weight, expected[2], rtol=1.6e-2, atol=1e-2)


def test_a_frozen_scale_gets_no_gradient():
    inputs, weight, grad_output = make_data(torch.float64)
    x = inputs.clone().requires_grad_()
    rms_norm(x, weight, EPS, WeightGradStore()).backward(grad_output)
    expected_input = gradients(reference_rms_norm, inputs, weight, grad_output)[1]
    torch.testing.assert_close(x.grad, expected_input, **TOLERANCES[torch.float64])
