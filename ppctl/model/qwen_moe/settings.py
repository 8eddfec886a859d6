"""The Qwen mixtures' own settings: Llama's (``LlamaSettings``) and whether the attention normalises each query and
key head (Qwen3-MoE) or not (Qwen2-MoE) (pure).

``config.model`` is a ``QwenMoeSettings`` when ``model.family=qwen_moe``. The mixture itself is ``model.moe``'s
(the shared expert's sigmoid gate is ``model.moe.shared_expert_gate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppctl.config.schema import setting
from ppctl.model.llama.settings import LlamaSettings


@dataclass
class QwenMoeSettings(LlamaSettings):
    """``model.*`` of a Qwen mixture of experts: Llama's keys and the per-head q/k norms."""

    qk_norm: bool = setting(
        False, "each query and key head RMS-normalised over its head_dim before the rotation (Qwen3-MoE's q_norm and "
        "k_norm); false: Qwen2-MoE's attention")
