"""The Qwen3 family in Hugging Face format: ``Qwen3ForCausalLM``, both ways.

A Qwen3 is the Llama the Llama format reads and writes (``ppctl.model.llama.hf``: the sizes, the head width, RMSNorm's
epsilon, the tie, the rotary parameters, the tensor names), plus each layer's ``self_attn.q_norm.weight`` and
``self_attn.k_norm.weight`` (``head_dim`` scales each, the same names on both sides). ``config.json`` is read over
transformers' own ``Qwen3Config`` defaults (``head_dim`` 128 when absent, not ``hidden_size / num_heads``), each key
type-checked as its strict fields check it. Refused, as not computed by ppctl's Qwen3: ``attention_bias`` (a bias on
q, k, v and the output projection), an activation other than SiLU, and any windowed layer (``layer_types`` other
than ``full_attention``, or ``use_sliding_window`` windowing the layers from ``max_window_layers`` on). Keys Qwen3 does
not read (``mlp_bias``, ``pretraining_tp``) are not read. Checked against ``transformers`` in
``tests/unit/test_hf_qwen3.py``. Pure: names and numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys
from ppctl.model.llama.heads import head_dim_of
from ppctl.model.llama.hf import FORMAT as LLAMA_FORMAT
from ppctl.model.llama.hf import LLAMA_DEFAULTS, LLAMA_TYPES, NONE, SILU, SIZES, llama_config, llama_shape

QWEN3 = "Qwen3ForCausalLM"
FULL_ATTENTION = "full_attention"
# transformers' Qwen3Config defaults for the keys a config.json may leave out.
QWEN3_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28, "layer_types": None}
# The JSON types Qwen3Config takes for the keys ppctl reads (``check_keys``); Llama's keys Qwen3 has no field for
# (mlp_bias, pretraining_tp) are not read, as transformers' Qwen3 reads none of them.
QWEN3_TYPES = {**{key: types for key, types in LLAMA_TYPES.items() if key not in ("mlp_bias", "pretraining_tp")},
               "head_dim": (int,), "max_window_layers": (int,), "layer_types": (list, NONE)}


class Qwen3HuggingFace:
    """The Qwen3 family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (QWEN3,)
    model_types = {"qwen3": QWEN3}
    base_model_prefixes = {QWEN3: "model"}
    word_embeddings = {QWEN3: "model.embed_tokens.weight"}
    moe_architecture = None  # a Qwen3 has no experts (Qwen3-MoE is model.family=qwen_moe's)

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Qwen3 model (a ``LlamaConfig`` with ``qk_norm``); ``HFError`` for what Qwen3 does not
        compute."""
        _require(not model.qkv_bias, f"model.qkv_bias=true: {QWEN3} has no q/k/v biases alone (its attention_bias "
                                     f"puts one on the output projection too)")
        return {"architectures": [QWEN3], "model_type": "qwen3", **llama_config(model),
                "head_dim": head_dim_of(model), "attention_bias": False, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": model.num_layers,
                "layer_types": [FULL_ATTENTION] * model.num_layers}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Qwen3 ``config.json``; ``HFError`` for what ppctl cannot compute."""
        architecture = architecture_of(hf_config)
        _require(architecture == QWEN3, f"its {architecture} is no architecture model.family=qwen3 reads ({QWEN3})")
        hf = {**QWEN3_DEFAULTS, **hf_config}
        check_keys(hf, QWEN3_TYPES, SIZES)
        check_qwen_attention(hf, "qwen3", layer_windows(hf), hf["attention_bias"])
        return {**llama_shape(hf, "qwen3"), "qkv_bias": False, "moe.num_experts": 0}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Llama's tensors, and each layer's q/k norms."""
        return {**LLAMA_FORMAT.tensors(model, hf_config), **qk_norm_tensors(model.num_layers)}

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """Llama's dense shapes, and each layer's q/k norms (``head_dim`` each)."""
        return {**LLAMA_FORMAT.dense_shapes(model), **qk_norm_shapes(model)}

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """None: everything Qwen3 holds, ppctl's Qwen3 holds."""
        return {}


def qk_norm_tensors(num_layers: int) -> dict[str, HFTensor]:
    """Every layer's ``self_attn.q_norm`` and ``k_norm`` scales: renames."""
    return {f"layers.{layer}.self_attn.{norm}.weight": HFTensor((f"model.layers.{layer}.self_attn.{norm}.weight",))
            for layer in range(num_layers) for norm in ("q_norm", "k_norm")}


def qk_norm_shapes(model) -> dict[str, tuple[int, ...]]:
    """The dense shape of every layer's q/k norm scales: ``head_dim`` each."""
    return {f"layers.{layer}.self_attn.{norm}.weight": (head_dim_of(model),)
            for layer in range(model.num_layers) for norm in ("q_norm", "k_norm")}


def check_qwen_attention(hf: dict[str, Any], family: str, windowed: str, attention_bias: bool) -> None:
    """``HFError`` for what ppctl's ``family`` does not compute of a Qwen config: an activation other than SiLU, a
    windowed layer (``windowed``: what windows it, '' for none), ``attention_bias`` (Qwen3's: on the output projection
    too)."""
    _require(hf["hidden_act"] in SILU, f"its hidden_act={hf['hidden_act']!r}: ppctl's {family} computes SwiGLU with "
                                       f"SiLU only ({', '.join(SILU)})")
    _require(not attention_bias, f"its attention_bias=true puts a bias on q, k, v and the output projection: ppctl's "
                                 f"{family} has none there")
    _require(not windowed, f"its {windowed}: ppctl's {family} attends to the whole sequence in every layer")


def layer_windows(hf: dict[str, Any]) -> str:
    """What windows a layer of a Qwen3 config, as transformers reads it ('' for none): a ``layer_types`` entry other
    than ``full_attention``, or, without ``layer_types``, ``use_sliding_window`` with a window on the layers from
    ``max_window_layers`` on (Qwen3Config's rule)."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        other = next(((index, kind) for index, kind in enumerate(layer_types) if kind != FULL_ATTENTION), None)
        return "" if other is None else f"layer_types[{other[0]}]={other[1]!r}"
    windowed = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
    if windowed and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]:
        return (f"use_sliding_window=true (sliding_window={hf['sliding_window']} on the layers from "
                f"max_window_layers={hf.get('max_window_layers')} on)")
    return ""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = Qwen3HuggingFace()
