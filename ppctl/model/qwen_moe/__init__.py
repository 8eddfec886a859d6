"""The Qwen mixtures of experts: Qwen2-MoE and Qwen3-MoE, Llama's blocks whose routed layers' MLP is ppctl's MoE MLP.

Everything but the shape, the settings and the Hugging Face format is the Llama family's (``ppctl.model.llama``: its
checks, chunk, layers, parameter rules and memory shape). Qwen2-MoE: q/k/v biases (``model.qkv_bias``), a softmax
router whose top-k weights are renormalised or not (``model.moe.router_topk_norm``, its ``norm_topk_prob``), and a
shared expert (``model.moe.shared_experts`` experts' width) whose output each token scales by
``sigmoid(shared_expert_gate . x)`` (``model.moe.shared_expert_gate``). Qwen3-MoE: no biases, no shared expert, each
query and key head RMS-normalised before the rotation (``model.qk_norm``; ``ppctl.model.qwen3``'s norms). Its
Hugging Face format (``hf.py``) reads and writes ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``. Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError
from ppctl.model.llama import FAMILY as LLAMA
from ppctl.model.qwen_moe.settings import QwenMoeSettings


def _shape_of(resolved):
    """Llama's ``LlamaConfig`` of a ``ResolvedModel``, with the per-head q/k norms where the settings ask."""
    return dataclasses.replace(LLAMA.shape_of(resolved), qk_norm=resolved.settings.qk_norm)


def _check(model: QwenMoeSettings, config) -> None:
    """Llama's rules, a mixture of experts, and a shared-expert gate only with shared experts to gate."""
    LLAMA.check(model, config)
    moe = model.moe
    if moe.num_experts < 1:
        raise ConfigError(f"model.family={model.family} is a mixture of experts: set model.moe.num_experts >= 1 (got "
                          f"{moe.num_experts}; a dense Qwen is model.family=qwen3, or llama for Qwen2)")
    if moe.shared_expert_gate and moe.shared_experts < 1:
        raise ConfigError(f"model.moe.shared_expert_gate=true gates the shared experts' output, and "
                          f"model.moe.shared_experts={moe.shared_experts}: set model.moe.shared_experts >= 1, or drop "
                          f"the gate")


def _hf():
    from ppctl.model.qwen_moe.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="qwen_moe", shape_of=_shape_of, check=_check, hf=_hf,
                             settings=QwenMoeSettings)
