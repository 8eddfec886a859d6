"""The Llama family's own settings: the shared ``model.*`` keys (``ModelConfig``), grouped-query attention's widths
and Llama 3's rotary scaling (pure).

``config.model`` is a ``LlamaSettings`` when ``model.family=llama``; a family built on Llama's blocks subclasses it
and adds only its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppctl.config.schema import ModelConfig, setting


@dataclass
class LlamaSettings(ModelConfig):
    """``model.*`` of a Llama-shaped model: the shared keys, the attention's widths and the rotary scaling."""

    num_kv_heads: Optional[int] = setting(
        None, "key/value heads of grouped-query attention (a multiple of `parallel.tp`, dividing `num_heads`); "
        "unset (null, not 0): `num_heads`")
    head_dim: Optional[int] = setting(
        None, "width of one head, a positive even number; unset (null, not 0): `hidden_size / num_heads`")
    rope_scaling_factor: Optional[float] = setting(
        None, "Llama 3's rotary frequency scaling factor; unset: no scaling")
    rope_low_freq_factor: float = setting(
        1.0, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's low_freq_factor")
    rope_high_freq_factor: float = setting(
        4.0, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's high_freq_factor")
    rope_original_max_position: int = setting(
        8192, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's "
        "original_max_position_embeddings")
