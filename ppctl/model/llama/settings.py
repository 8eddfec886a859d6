"""The Llama family's own settings: the shared ``model.*`` keys (``ModelConfig``), grouped-query attention's widths,
the rotary scaling (Llama 3's, linear, YaRN) and Llama's output bias (pure).

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
        None, "the rotary frequency scaling's factor, > 0 (its kind: `rope_scaling_type`); unset: no scaling")
    rope_low_freq_factor: float = setting(
        1.0, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's low_freq_factor")
    rope_high_freq_factor: float = setting(
        4.0, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's high_freq_factor")
    rope_original_max_position: int = setting(
        8192, "with `rope_scaling_factor` (a changed value without it is refused): Llama 3's or YaRN's "
        "original_max_position_embeddings")
    rope_scaling_type: str = setting(
        "llama3", "with `rope_scaling_factor` (a changed value without it is refused): the scaling, as Hugging "
        "Face's `rope_type`: `llama3` (Llama 3's bands, `rope_low_freq_factor`, `rope_high_freq_factor`), `linear` "
        "(every frequency divided by the factor) or `yarn` (YaRN: the `rope_yarn_*` keys and "
        "`rope_attention_factor`); each key of another kind is refused when changed")
    rope_yarn_beta_fast: float = setting(
        32.0, "with `rope_scaling_type=yarn`, > 0: the frequencies turning more than this many times over "
        "`rope_original_max_position` positions are kept")
    rope_yarn_beta_slow: float = setting(
        1.0, "with `rope_scaling_type=yarn`, > 0: those turning fewer times than this are divided by the factor, "
        "those between blended along a linear ramp")
    rope_yarn_truncate: bool = setting(
        True, "with `rope_scaling_type=yarn`: the ramp's ends rounded out to whole frequency pairs")
    rope_attention_factor: Optional[float] = setting(
        None, "with `rope_scaling_type=yarn`, > 0: the rotary cos and sin times this; unset: YaRN's "
        "0.1 * ln(factor) + 1")
    attention_output_bias: bool = setting(
        False, "a bias on the attention's output projection (`o_proj`) too: with `qkv_bias`, Llama's "
        "`attention_bias` (written as LlamaForCausalLM; `qkv_bias` alone is Qwen2's)")
