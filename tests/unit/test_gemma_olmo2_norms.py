"""The RMSNorm that scales before the cast back (``RMSNorm(offset=...)``: Gemma's ``1 + w``, OLMo 2's ``w``) against
transformers' own norms, and its split backward (a zero-bubble B, then W) against the plain one.

In bfloat16 ppctl's norm is transformers' ``GemmaRMSNorm`` (offset 1) and ``Olmo2RMSNorm`` (offset 0) bit for bit:
both scale the float32 unit-RMS input and cast once, where Llama's norm casts first (the default, offset None,
unchanged). Through ``split_op`` with a deferring store, the input gradient (B) and the scale gradient (W) are the
plain autograd ones to float64 rounding, for both offsets. Gemma's embedding normalizer ``sqrt(hidden_size)`` is
rounded to the parameters' dtype as transformers rounds it in a model it loads in that dtype (bfloat16: 5.65625 for
32): its scaled vectors are transformers' bit for bit in bfloat16, float32 and float64.
"""

from __future__ import annotations

import pytest
import torch

from ppctl.autograd.weight_grad import WeightGradStore
from ppctl.model.llama.layers import RMSNorm

WIDTH, EPS = 24, 1e-6


def _inputs(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, WIDTH, generator=generator, dtype=torch.float64)
    weight = torch.randn(WIDTH, generator=generator, dtype=torch.float64) * 0.3
    return hidden.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("offset, name", [(1.0, "GemmaRMSNorm"), (0.0, "Olmo2RMSNorm")])
def test_bfloat16_norm_is_transformers_bit_for_bit(offset, name):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    hidden, weight = _inputs(torch.bfloat16)
    theirs = (GemmaRMSNorm if name == "GemmaRMSNorm" else Olmo2RMSNorm)(WIDTH, eps=EPS).to(torch.bfloat16)
    ours = RMSNorm(WIDTH, eps=EPS, dtype=torch.bfloat16, offset=offset)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
        assert torch.equal(ours(hidden), theirs(hidden))
        if offset == 0.0:  # Llama's order (cast, then scale) is another rounding: the offset is what changes it
            llama = RMSNorm(WIDTH, eps=EPS, dtype=torch.bfloat16)
            llama.weight.copy_(weight)
            assert not torch.equal(llama(hidden), theirs(hidden))


def _gradients(offset: float, store: WeightGradStore | None):
    """(input gradient, scale gradient) of the norm under a fixed probe loss, split into B and W with ``store``."""
    hidden, weight = _inputs(torch.float64)
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    norm = RMSNorm(WIDTH, eps=EPS, dtype=torch.float64, offset=offset)
    norm.weight_grad_store = store
    with torch.no_grad():
        norm.weight.copy_(weight)
    hidden.requires_grad_()
    loss = (norm(hidden) * probe).sum()
    if store is None:
        loss.backward()
    else:
        with store.defer("microbatch"):
            loss.backward()
        store.accumulate("microbatch")
    return hidden.grad, norm.weight.grad


@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_split_backward_equals_the_plain_one(offset):
    plain, split = _gradients(offset, None), _gradients(offset, WeightGradStore())
    for ours, expected in zip(split, plain):
        assert torch.allclose(ours, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_embedding_normalizer_is_rounded_to_the_dtype_as_transformers_rounds_it(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from ppctl.model.llama.model import WordEmbedding
    from ppctl.parallel.tensor_parallel import TPGroup

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained builds a model of that dtype: its normalizer made in it
    try:
        theirs = GemmaTextScaledWordEmbedding(10, 32, None, embed_scale=32 ** 0.5)
    finally:
        torch.set_default_dtype(default)
    ours = WordEmbedding(10, 32, TPGroup.single(), dtype, scale=32 ** 0.5)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.word.weight.copy_(theirs.weight)
        token_ids = torch.tensor([[1, 4, 9]])
        assert torch.equal(ours(token_ids, None), theirs(token_ids))
