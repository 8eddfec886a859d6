"""The GPT-NeoX family's own settings: GPT's (``GPTSettings``) and the two ways its layers differ (pure).

``config.model`` is a ``GPTNeoXSettings`` when ``model.family=gpt_neox``. Both keys default to GPT's own layer (a
sequential residual, rotary positions over the whole head); ``conf/model/gpt_neox_tiny.yaml`` sets Pythia's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppctl.config.schema import setting
from ppctl.model.gpt.settings import GPTSettings


@dataclass
class GPTNeoXSettings(GPTSettings):
    """``model.*`` of a GPT-NeoX model: GPT's keys, the parallel residual and the rotary fraction."""

    parallel_residual: bool = setting(
        False, "attention and MLP both read the layer's input, x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX's "
        "`use_parallel_residual`, Pythia's); false: x + attn(norm1(x)), then + mlp(norm2(.)), as GPT's")
    partial_rotary_factor: float = setting(
        1.0, "the fraction of each head's dims rotary positions rotate, in (0, 1]: its first int(head_dim * factor), "
        "an even number, the rest passed unchanged (GPT-NeoX's `rotary_pct`, 0.25 in Pythia)")
