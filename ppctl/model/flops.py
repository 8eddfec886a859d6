"""Floating-point operations of training the GPT, and model FLOPs utilisation (MFU).

Counted as Megatron-LM and PaLM count them: multiply-adds of the matrix products only
(2 FLOPs each), a backward pass twice the forward, no activation recomputation (MFU
counts the model's work, not the work a run chose to repeat). Per token of a
sequence of ``s`` tokens, with ``l`` layers of width ``h`` and MLP width ``f``:

- each layer: the query, key, value and output projections ``2 * 4h^2``, the MLP
  ``2 * 2hf``, and attention's two products with the keys and the values ``2 * 2sh``
  (the full ``s x s`` score matrix, as Megatron-LM counts it); with grouped-query attention
  of query width ``a`` and key/value width ``k`` the projections are ``2 * (h(a + 2k) + ah)``
  and attention ``2 * 2sa``, with a gated MLP (SwiGLU) ``2 * 3hf``;
- the output layer ``2hV`` (``V`` the padded vocabulary); embeddings are lookups;
- a mixture-of-experts layer (``ppctl.model.moe``) in place of its MLP: the router ``2hE`` and the MLPs a token
  goes through, its ``topk`` experts and the shared experts, each of the expert width ``f_e`` (FLOPs a token
  does, not the experts' parameters: a token's compute is that of its active experts).

Training is three times the forward. The peak figures are the vendors' dense (no
sparsity) bf16 tensor-core throughput.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ppctl.model.moe.shape import MoEShape

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def forward_flops_per_token(num_layers: int, hidden_size: int, ffn_hidden_size: int, seq_length: int,
                            vocab_size: int, attention_width: int | None = None, kv_width: int | None = None,
                            gated_mlp: bool = False, moe: "MoEShape | None" = None, moe_layers: int = 0) -> float:
    """FLOPs of one token's forward pass through the whole model (see the module docstring); ``attention_width``
    (heads x head width) and ``kv_width`` (key/value heads x head width) default to ``hidden_size``; ``moe_layers``
    of the ``num_layers`` are mixtures of ``moe``'s experts."""
    h, a = hidden_size, attention_width or hidden_size
    k = kv_width or a
    attention = 2 * (h * (a + 2 * k) + a * h) + 2 * 2 * seq_length * a
    dense = num_layers - moe_layers
    layers = dense * (attention + mlp_flops_per_token(h, ffn_hidden_size, gated_mlp))
    if moe_layers:
        layers += moe_layers * (attention + moe_mlp_flops_per_token(h, moe, gated_mlp))
    return layers + 2 * hidden_size * vocab_size


def mlp_flops_per_token(hidden_size: int, ffn_hidden_size: int, gated_mlp: bool) -> float:
    """One token through a dense MLP: ``2 * 2hf``, or ``2 * 3hf`` gated."""
    return 2 * (3 if gated_mlp else 2) * hidden_size * ffn_hidden_size


def moe_mlp_flops_per_token(hidden_size: int, moe: "MoEShape", gated_mlp: bool) -> float:
    """One token through an MoE MLP: the router and the MLPs of its ``topk`` experts and the shared experts."""
    active = moe.topk + moe.shared_experts
    return 2 * hidden_size * moe.num_experts + active * mlp_flops_per_token(hidden_size, moe.expert_ffn_hidden_size,
                                                                              gated_mlp)


def training_flops_per_token(num_layers: int, hidden_size: int, ffn_hidden_size: int, seq_length: int,
                             vocab_size: int, **widths) -> float:
    """FLOPs of one token's forward and backward (three forwards' worth); ``widths`` (and ``moe``, ``moe_layers``) as
    ``forward_flops_per_token``."""
    return 3 * forward_flops_per_token(num_layers, hidden_size, ffn_hidden_size, seq_length, vocab_size, **widths)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name()``), None if unknown."""
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), None)


def model_flops_utilisation(tokens_per_s: float, flops_per_token: float, devices: int, peak: float) -> float:
    """Achieved training FLOP/s over the peak of ``devices`` devices."""
    return tokens_per_s * flops_per_token / (devices * peak)
