"""Training FLOPs per token and MFU against the published GPT-3 / Megatron-LM figures."""

import pytest

from ppctl.model.flops import (forward_flops_per_token, model_flops_utilisation, peak_flops,
                               training_flops_per_token)


def test_megatron_formula_for_a_4h_mlp():
    # Megatron-LM (Narayanan et al. 2021), without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per batch
    layers, hidden, seq, vocab = 24, 2048, 2048, 51200
    expected = 72 * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden)) / seq
    assert training_flops_per_token(layers, hidden, 4 * hidden, seq, vocab) == pytest.approx(expected)


def test_dominated_by_six_flops_per_parameter_for_a_wide_model():
    layers, hidden = 96, 12288  # GPT-3 175B: about 6 N FLOPs per token with N = 12 l h^2
    per_token = training_flops_per_token(layers, hidden, 4 * hidden, 2048, 50257)
    assert per_token == pytest.approx(6 * 12 * layers * hidden ** 2, rel=0.04)  # + attention 2.8%, logits 0.4%
    assert forward_flops_per_token(layers, hidden, 4 * hidden, 2048, 50257) * 3 == per_token


def test_mfu_and_peaks():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA GeForce GTX 1080") is None
    assert model_flops_utilisation(tokens_per_s=1000.0, flops_per_token=1e9, devices=2, peak=1e12) == 0.5


def test_an_moe_layer_counts_its_active_experts_and_router():
    """Top-2 of 8 experts of width f plus one shared expert cost a token a dense MLP of width 3f, plus the router's
    2hE; the other layers stay dense."""
    from ppctl.model.moe.shape import MoEShape

    layers, hidden, ffn, expert_ffn, seq, vocab = 4, 64, 256, 48, 128, 320
    moe = MoEShape(num_experts=8, topk=2, expert_ffn_hidden_size=expert_ffn, shared_experts=1)
    mixed = forward_flops_per_token(layers, hidden, ffn, seq, vocab, gated_mlp=True, moe=moe, moe_layers=3)
    dense_layer = forward_flops_per_token(1, hidden, ffn, seq, 0, gated_mlp=True)
    routed_layer = forward_flops_per_token(1, hidden, 3 * expert_ffn, seq, 0, gated_mlp=True) + 2 * hidden * 8
    assert mixed == dense_layer + 3 * routed_layer + 2 * hidden * vocab
    assert training_flops_per_token(layers, hidden, ffn, seq, vocab, gated_mlp=True, moe=moe, moe_layers=3) == 3 * mixed
