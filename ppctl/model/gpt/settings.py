"""The GPT family's own settings: the shared ``model.*`` keys (``ModelConfig``), the MLP's GELU and grouped-query
attention's key/value heads (pure).

``config.model`` is a ``GPTSettings`` when ``model.family=gpt``; a family built on GPT's blocks subclasses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppctl.config.schema import ModelConfig, setting

ACTIVATIONS = ("gelu", "gelu_tanh")  # the MLP's GELU: torch's F.gelu, approximate "none" or "tanh"


@dataclass
class GPTSettings(ModelConfig):
    """``model.*`` of a GPT-2-shaped model: the shared keys, the MLP's GELU and the key/value heads."""

    activation: str = setting(
        "gelu", "the MLP's GELU, `gelu` (exact, erf) or `gelu_tanh` (the tanh approximation GPT-2 was trained with: "
        "Hugging Face's `gelu_new` and `gelu_pytorch_tanh`, Megatron-LM's `--openai-gelu`); a `model.init_from` "
        "folder gives its own, and one set must be the same")
    num_kv_heads: Optional[int] = setting(
        None, "key/value heads of grouped-query attention (StarCoder2's; a multiple of `parallel.tp`, dividing "
        "`num_heads`): q, k and v are then projected apart; unset (null, not 0): `num_heads`, one fused QKV")
