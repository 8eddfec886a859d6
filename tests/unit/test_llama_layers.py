"""Single-process tests of the Llama building blocks against Hugging Face transformers' own modules.

Weights go into the transformers layer and are loaded by name into ours (the names are
the same), so every test also proves the 1:1 parameter mapping. Hugging Face's RMS norm
always computes in float32, even for float64 inputs: the tight float64 comparisons give
the reference layer float64 norms of the same formula, and the norm itself is compared
with the unchanged transformers module in float32 and bfloat16, where both compute alike.
Its rotary tables are computed in float32 too: the layer comparisons hand it our tables,
and the tables are compared with its own separately, at float32's precision.
"""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from ppctl.model.layers import rotary_cos_sin
from ppctl.model.llama.layers import (
    GroupedQueryAttention,
    LlamaLayer,
    RMSNorm,
    RopeScaling,
    SwiGLUMLP,
    check_grouped_heads,
    llama_inverse_frequencies,
    llama_rotary_cos_sin,
)
from ppctl.parallel import tensor_parallel
from ppctl.parallel.tensor_parallel import TPGroup
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec

BATCH, SEQ = 2, 12
EPS = 1e-6
THETA = 10000.0
SIZES = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_size=48)
# head_dim 8, theta 1e4: wavelengths 2pi, 20pi, 200pi, 2000pi; originally 64 positions with these
# factors puts the first short of 64/4 (kept), the second between (blended), the last two beyond 64/1 (stretched).
LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
# Float64 all through, only the order of the sums differs between the two implementations.
TIGHT = dict(rtol=1e-10, atol=1e-10)


def hf_config(config_class=LlamaConfig, scaling: RopeScaling | None = None, **sizes):
    """A transformers config of one layer with ``SIZES`` (overridden by ``sizes``) and SDPA attention."""
    sizes = {**SIZES, **sizes}
    rope_scaling = None if scaling is None else {"rope_type": "llama3", "factor": scaling.factor,
                                                 "low_freq_factor": scaling.low_freq_factor,
                                                 "high_freq_factor": scaling.high_freq_factor,
                                                 "original_max_position_embeddings":
                                                     scaling.original_max_position_embeddings}
    return config_class(hidden_size=sizes["hidden_size"], intermediate_size=sizes["ffn_hidden_size"],
                        num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"],
                        head_dim=sizes["head_dim"], rms_norm_eps=EPS, rope_theta=THETA, rope_scaling=rope_scaling,
                        num_hidden_layers=1, vocab_size=16, max_position_embeddings=128,
                        attn_implementation="sdpa")


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Draw every parameter (norm scales around 1), so that no weight hides another's mistake."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            draw = torch.randn(param.shape, dtype=torch.float64, generator=generator)
            param.copy_(1 + 0.1 * draw if name.endswith("layernorm.weight") else 0.2 * draw)


def with_float64_norms(hf_layer: torch.nn.Module) -> torch.nn.Module:
    """Give the reference layer's RMS norms transformers' formula computed in float64, not float32."""
    for name, norm in hf_layer.named_modules():
        if name.endswith("layernorm"):
            def forward(hidden, norm=norm):
                unit = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return norm.weight * unit
            norm.forward = forward
    return hf_layer


def layer_pair(dtype=torch.float64, qkv_bias=False, recompute=False, seed=0, **sizes):
    """A transformers decoder layer (Qwen2's with ``qkv_bias``) with random weights, and ours loaded from it."""
    sizes = {**SIZES, **sizes}
    reference_class, config_class = (Qwen2DecoderLayer, Qwen2Config) if qkv_bias else (LlamaDecoderLayer, LlamaConfig)
    reference = reference_class(hf_config(config_class, **sizes), layer_idx=0).to(dtype)
    randomise(reference, seed)
    ours = llama_layer(dtype, qkv_bias, recompute, **sizes)
    ours.load_state_dict(reference.state_dict())  # strict: the same names, nothing missing or left over
    return reference, ours


def llama_layer(dtype=torch.float64, qkv_bias=False, recompute=False, seed=None, **sizes) -> LlamaLayer:
    """One of our layers at tp=1 (random weights with a ``seed``, else as built)."""
    layer = LlamaLayer(**{**SIZES, **sizes}, norm_epsilon=EPS, tp=TPGroup.single(), dtype=dtype, qkv_bias=qkv_bias,
                       recompute_attention_core=recompute)
    if seed is not None:
        randomise(layer, seed)
    return layer


def inputs(dtype=torch.float64, seed=1, hidden_size=SIZES["hidden_size"]):
    """Hidden states, an output gradient and position ids ``[BATCH, SEQ]`` (the batches at different offsets)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, hidden_size, dtype=torch.float64, generator=generator).to(dtype)
    grad_output = torch.randn(BATCH, SEQ, hidden_size, dtype=torch.float64, generator=generator).to(dtype)
    positions = torch.arange(SEQ) + torch.tensor([[0], [5]])
    return hidden, grad_output, positions


def run_hf(layer, hidden, grad_output, cos_sin):
    """Output and gradients (input, then parameters by name) of a transformers layer; ``cos_sin`` ours, squeezed."""
    hidden = hidden.clone().requires_grad_()
    output = layer(hidden, attention_mask=None, position_embeddings=tuple(t.squeeze(1) for t in cos_sin))
    output = output[0] if isinstance(output, tuple) else output  # before transformers 5: a tuple
    output.backward(grad_output)
    return output.detach(), hidden.grad, {name: param.grad for name, param in layer.named_parameters()}


def run_module(module, forward, hidden, grad_output):
    """Output and gradients (input, then parameters by name) of ``forward(hidden)`` through ``module``."""
    hidden = hidden.clone().requires_grad_()
    output = forward(hidden)
    output.backward(grad_output)
    return output.detach(), hidden.grad, {name: param.grad for name, param in module.named_parameters()}


def run_ours(layer, hidden, grad_output, cos_sin):
    """Output and gradients (input, then parameters by name) of one of our layers."""
    return run_module(layer, lambda x: layer(x, cos_sin), hidden, grad_output)


def assert_same_run(actual, expected, **tolerance):
    """Outputs, input gradients and every parameter gradient (by name) agree."""
    (output, grad_input, grads), (expected_output, expected_grad_input, expected_grads) = actual, expected
    torch.testing.assert_close(output, expected_output, **tolerance, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(grad_input, expected_grad_input, **tolerance, msg=lambda m: f"input grad: {m}")
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------
# Against transformers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default-rope", "llama3-rope"])
@pytest.mark.parametrize("head_dim", [8, 16], ids=["head_dim=hidden/heads", "head_dim=2*hidden/heads"])
def test_llama_layer_equals_transformers_decoder_layer(head_dim, scaling):
    reference, ours = layer_pair(head_dim=head_dim)
    hidden, grad_output, positions = inputs()
    cos_sin = llama_rotary_cos_sin(positions, head_dim, THETA, scaling, torch.float64)
    expected = run_hf(with_float64_norms(reference), hidden, grad_output, cos_sin)
    assert_same_run(run_ours(ours, hidden, grad_output, cos_sin), expected, **TIGHT)


def test_llama_layer_equals_unchanged_transformers_layer_at_its_float32_norms():
    """transformers' own float64 layer, whose norms round to float32: agreement to float32's precision
    (4e-6 seen; float32 rounds at 6e-8 relative, amplified by the layer's weights and sums)."""
    reference, ours = layer_pair()
    hidden, grad_output, positions = inputs()
    cos_sin = llama_rotary_cos_sin(positions, SIZES["head_dim"], THETA, None, torch.float64)
    assert_same_run(run_ours(ours, hidden, grad_output, cos_sin), run_hf(reference, hidden, grad_output, cos_sin),
                    rtol=3e-5, atol=3e-5)


def test_qkv_bias_layer_equals_transformers_qwen2_decoder_layer():
    reference, ours = layer_pair(qkv_bias=True)
    assert ours.self_attn.q_proj.bias is not None and ours.self_attn.o_proj.bias is None
    hidden, grad_output, positions = inputs()
    cos_sin = llama_rotary_cos_sin(positions, SIZES["head_dim"], THETA, None, torch.float64)
    expected = run_hf(with_float64_norms(reference), hidden, grad_output, cos_sin)
    assert_same_run(run_ours(ours, hidden, grad_output, cos_sin), expected, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_equals_transformers_rms_norm(dtype):
    """Where transformers computes as we do (float32 inside), outputs are bitwise equal; gradients close."""
    reference = LlamaRMSNorm(SIZES["hidden_size"], eps=EPS).to(dtype)
    randomise(reference, seed=4)  # no "layernorm" in the name: scale drawn around 0, signs mixed
    ours = RMSNorm(SIZES["hidden_size"], eps=EPS, dtype=dtype)
    ours.load_state_dict(reference.state_dict())
    hidden, grad_output, _ = inputs(dtype)
    (output, grad_input, grads), (expected_output, expected_grad_input, expected_grads) = (
        run_module(norm, norm, hidden, grad_output) for norm in (ours, reference))
    assert torch.equal(output, expected_output)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(grad_input, expected_grad_input, **tolerance)
    torch.testing.assert_close(grads["weight"], expected_grads["weight"], **tolerance)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default-rope", "llama3-rope"])
def test_rotary_tables_equal_transformers(scaling):
    """Inverse frequencies and cos/sin tables against transformers' (computed in float32 there)."""
    reference = LlamaRotaryEmbedding(config=hf_config(scaling=scaling))
    head_dim = SIZES["head_dim"]
    # transformers: theta ** (2i / d) and the Llama 3 blend each rounded to float32, a few ulps in all.
    torch.testing.assert_close(llama_inverse_frequencies(head_dim, THETA, scaling).float(), reference.inv_freq,
                               rtol=1e-6, atol=0)
    positions = torch.arange(64).expand(BATCH, 64)
    expected_cos, expected_sin = reference(torch.zeros((), dtype=torch.float32), positions)
    cos, sin = llama_rotary_cos_sin(positions, head_dim, THETA, scaling, torch.float32)
    # transformers rounds angles of up to 63 rad to float32: half an ulp of 63 is 2**-19, about 1.9e-6.
    torch.testing.assert_close(cos.squeeze(1), expected_cos, rtol=0, atol=4e-6)
    torch.testing.assert_close(sin.squeeze(1), expected_sin, rtol=0, atol=4e-6)


def test_llama3_scaling_covers_all_three_bands():
    """The configuration above tests each branch: a kept, a blended and a stretched frequency at least."""
    unscaled = llama_inverse_frequencies(SIZES["head_dim"], THETA, None)
    ratio = unscaled / llama_inverse_frequencies(SIZES["head_dim"], THETA, LLAMA3)
    kept, stretched = ratio == 1, torch.isclose(ratio, torch.tensor(LLAMA3.factor, dtype=torch.float64))
    assert kept.any() and stretched.any() and (~kept & ~stretched).any()


def test_unscaled_llama_tables_are_the_gpt_tables():
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    for ours, gpt in zip(llama_rotary_cos_sin(positions, 16, THETA, None, torch.float32),
                         rotary_cos_sin(positions, 16, THETA, torch.float32)):
        assert torch.equal(ours, gpt)


# ---------------------------------------------------------------------------
# Tensor parallelism, recomputation and the B/W split, in one process
# ---------------------------------------------------------------------------

def tp_shard(name: str, full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank ``tp.rank``'s piece of a full parameter: rows of column-parallel, columns of row-parallel layers."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return tp.shard(full, dim=1)
    return full.clone() if "layernorm" in name else tp.shard(full, dim=0)


def build_block(block: str, tp: TPGroup, positions: torch.Tensor):
    """The attention (4 heads, 2 key/value heads) or the MLP at ``tp``, and how to call it on hidden states."""
    if block == "attention":
        attention = GroupedQueryAttention(32, 4, 2, 8, tp, torch.float64)
        rotary = llama_rotary_cos_sin(positions, 8, THETA, None, torch.float64)
        return attention, lambda x: attention(x, rotary)
    mlp = SwiGLUMLP(32, 48, tp, torch.float64)
    return mlp, mlp


@pytest.mark.parametrize("block", ["attention", "mlp"])
def test_tp_ranks_own_whole_kv_groups(block, monkeypatch):
    """tp=2 without communication: each rank's partial output and input gradient summed over the ranks (what
    the all-reduces do) give the tp=1 block's, and each rank's weight gradients are its shard of tp=1's."""
    monkeypatch.setattr(tensor_parallel, "copy_to_tp_region", lambda tensor, tp: tensor)
    monkeypatch.setattr(tensor_parallel, "reduce_from_tp_region", lambda tensor, tp: tensor)
    hidden, grad_output, positions = inputs()
    full, forward = build_block(block, TPGroup.single(), positions)
    randomise(full, seed=5)
    expected_output, expected_grad_input, expected_grads = run_module(full, forward, hidden, grad_output)
    outputs, grad_inputs = [], []
    for rank in range(2):
        tp = TPGroup(group=None, size=2, rank=rank)
        shard, forward = build_block(block, tp, positions)
        shard.load_state_dict({name: tp_shard(name, param, tp) for name, param in full.state_dict().items()})
        output, grad_input, grads = run_module(shard, forward, hidden, grad_output)
        outputs.append(output)
        grad_inputs.append(grad_input)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, tp_shard(name, expected_grads[name], tp), **TIGHT,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    torch.testing.assert_close(sum(outputs), expected_output, **TIGHT)
    torch.testing.assert_close(sum(grad_inputs), expected_grad_input, **TIGHT)


def test_recomputed_attention_core_gives_the_same_gradients_bitwise():
    plain, recomputing = llama_layer(seed=0), llama_layer(recompute=True, seed=0)
    hidden, grad_output, positions = inputs()
    cos_sin = llama_rotary_cos_sin(positions, SIZES["head_dim"], THETA, None, torch.float64)
    output, grad_input, grads = run_ours(recomputing, hidden, grad_output, cos_sin)
    expected_output, expected_grad_input, expected_grads = run_ours(plain, hidden, grad_output, cos_sin)
    assert torch.equal(output, expected_output) and torch.equal(grad_input, expected_grad_input)
    assert all(torch.equal(grads[name], grad) for name, grad in expected_grads.items())


def layer_stage(recompute: bool, dtype: torch.dtype) -> PipelineStage:
    """A middle pipeline stage of two Llama layers whose backward a schedule may split into B and W."""
    layers = torch.nn.ModuleList([llama_layer(dtype, recompute=recompute, seed=seed) for seed in range(2)])
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    cos_sin = llama_rotary_cos_sin(positions, SIZES["head_dim"], THETA, LLAMA3, dtype)

    def forward(module, hidden, microbatch):
        for layer in module:
            hidden = layer(hidden, cos_sin)
        return hidden

    spec = TensorSpec((BATCH, SEQ, SIZES["hidden_size"]), dtype)
    return PipelineStage(1, layers, StageIO(input=spec, output=spec, fields=()), forward, is_last=False,
                         split_backward=True)


def run_stage(stage: PipelineStage, actions) -> dict[int, torch.Tensor]:
    """``F``, ``BW``, ``B`` and ``W`` of microbatches 0 and 1; the input gradients by microbatch."""
    grad_inputs = {}
    for kind, microbatch in actions:
        hidden, grad_output, _ = inputs(stage.io.input.dtype, seed=10 + microbatch)
        if kind == "F":
            stage.forward(microbatch, {}, hidden.requires_grad_(), None)
        elif kind == "BW":
            grad_inputs[microbatch] = stage.backward(microbatch, grad_output)
        elif kind == "B":
            grad_inputs[microbatch] = stage.backward_input(microbatch, grad_output)
        else:
            stage.backward_weight(microbatch)
    return grad_inputs


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute-core"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_split_backward_equals_whole_backward_bitwise(dtype, recompute):
    whole, split = layer_stage(recompute, dtype), layer_stage(recompute, dtype)
    whole_inputs = run_stage(whole, [("F", 0), ("F", 1), ("BW", 0), ("BW", 1)])
    split_inputs = run_stage(split, [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1), ("W", 0)])
    assert all(torch.equal(split_inputs[key], grad) for key, grad in whole_inputs.items())
    split_grads = dict(split.module.named_parameters())
    for name, param in whole.module.named_parameters():
        assert param.grad is not None and torch.equal(split_grads[name].grad, param.grad), name


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size, says", [
    (4, 3, 1, "num_heads=4 must be a multiple of num_kv_heads=3"),
    (4, 0, 1, "num_kv_heads=0"),
    (8, 2, 4, "num_kv_heads=2 must be divisible by tp=4"),
])
def test_grouped_heads_that_do_not_divide_are_refused_in_one_line(num_heads, num_kv_heads, tp_size, says):
    with pytest.raises(ValueError) as refused:
        GroupedQueryAttention(32, num_heads, num_kv_heads, 8, TPGroup(group=None, size=tp_size, rank=0),
                              torch.float32)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_grouped_heads_that_divide_are_accepted():
    check_grouped_heads(num_heads=8, num_kv_heads=2, tp_size=2)
    check_grouped_heads(num_heads=8, num_kv_heads=8, tp_size=4)  # multi-head attention: one group per head


@pytest.mark.parametrize("fields, says", [
    (dict(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=64),
     "0 < low_freq_factor < high_freq_factor"),
    (dict(factor=0.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
     "must be positive"),
])
def test_bad_rope_scaling_is_refused_in_one_line(fields, says):
    with pytest.raises(ValueError, match=says) as refused:
        RopeScaling(**fields)
    assert "\n" not in str(refused.value)
