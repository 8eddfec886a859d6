"""The Llama family in Hugging Face format: ``LlamaForCausalLM``, and ``Qwen2ForCausalLM`` for q/k/v biases, both ways.

ppctl's Llama layers carry Hugging Face's names (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``...) under ``layers.<i>.``, so the mapping is a rename: ``embed_tokens`` is
``embedding.word``, ``norm`` is ``final_norm``, ``lm_head`` is ``output_layer``; every weight is
``nn.Linear``'s ``[out, in]`` on both sides. Both compute RMSNorm in float32, SwiGLU with SiLU and
rotate-half rotary over the whole head (``rope_type`` ``default``, or ``llama3``'s frequency scaling).
Refused, as not computed by ppctl: an activation other than SiLU, biases on the output projection or the
MLP (``attention_bias``, ``mlp_bias``), other rotary types, a sliding window. Checked against
``transformers`` in ``tests/unit/test_hf_llama.py``. Pure: names and numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of

LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
# transformers' defaults for the keys a config.json may leave out (LlamaConfig, Qwen2Config).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "rope_theta": 10000.0,
                  "rope_scaling": None}
QWEN2_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "use_sliding_window": False}


class LlamaHuggingFace:
    """The Llama family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (LLAMA, QWEN2)
    base_model_prefixes = {LLAMA: "model", QWEN2: "model"}  # transformers' base_model_prefix

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Llama model (a ``LlamaConfig``): Llama's, or Qwen2's when it has q/k/v biases."""
        rope = _rope_parameters(model)
        config = {"vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
                  "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
                  "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                  "head_dim": model.head_dim, "hidden_act": "silu", "max_position_embeddings": model.max_seq_length,
                  "rms_norm_eps": model.norm_epsilon, "initializer_range": model.init_std,
                  "tie_word_embeddings": model.tie_embeddings, "rope_theta": float(model.rope_theta),
                  "rope_parameters": rope, "attention_dropout": 0.0, "use_cache": True}
        if model.qkv_bias:
            return {"architectures": [QWEN2], "model_type": "qwen2", **config, "use_sliding_window": False}
        return {"architectures": [LLAMA], "model_type": "llama", **config, "attention_bias": False,
                "mlp_bias": False, "pretraining_tp": 1}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Llama or Qwen2 ``config.json``; ``HFError`` for what ppctl cannot compute."""
        architecture = architecture_of(hf_config)
        if architecture not in self.architectures:
            raise HFError(f"its {architecture} is no architecture model.family=llama reads ({LLAMA}, {QWEN2})")
        qwen2 = architecture == QWEN2
        hf = {**(QWEN2_DEFAULTS if qwen2 else LLAMA_DEFAULTS), **hf_config}
        _check_computable(hf, qwen2)
        heads = hf["num_attention_heads"]
        shape = {"family": "llama", "position_embedding": "rope", "num_layers": hf["num_hidden_layers"],
                 "hidden_size": hf["hidden_size"], "num_heads": heads,
                 "num_kv_heads": hf["num_key_value_heads"] or heads, "ffn_hidden_size": hf["intermediate_size"],
                 "vocab_size": hf["vocab_size"], "max_seq_length": hf["max_position_embeddings"],
                 "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_epsilon": hf["rms_norm_eps"],
                 "qkv_bias": qwen2}
        head_dim = hf["head_dim"] or hf["hidden_size"] // heads
        if head_dim != hf["hidden_size"] // heads or hf["hidden_size"] % heads:
            shape["head_dim"] = head_dim
        return {**shape, **_rope_settings(hf)}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Every ppctl Llama parameter (a tied output layer is the word embedding) -> its HF tensor: renames."""
        tensors = {"embedding.word.weight": HFTensor(("model.embed_tokens.weight",)),
                   "final_norm.weight": HFTensor(("model.norm.weight",))}
        roles = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        roles += [f"self_attn.{part}_proj.{kind}" for part in "qkv"
                  for kind in (("weight", "bias") if model.qkv_bias else ("weight",))]
        for layer in range(model.num_layers):
            for role in roles:
                tensors[f"layers.{layer}.{role}"] = HFTensor((f"model.layers.{layer}.{role}",))
        if not model.tie_embeddings:
            tensors["output_layer.weight"] = HFTensor(("lm_head.weight",))
        return tensors

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """No tensor HF has and ppctl's Llama lacks: biases it does not compute are refused by ``shape_from_hf``."""
        return {}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


def _check_computable(hf: dict[str, Any], qwen2: bool) -> None:
    """``HFError`` for what ppctl's Llama layers do not compute."""
    _require(hf["hidden_act"] == "silu", f"its hidden_act={hf['hidden_act']!r}: ppctl's llama computes SwiGLU with "
                                         f"SiLU only")
    _require(qwen2 or not hf["attention_bias"], "its attention_bias=true puts a bias on the output projection too: "
                                                "ppctl's llama has q/k/v biases only (Qwen2's)")
    _require(not hf.get("mlp_bias", False), "its mlp_bias=true: ppctl's llama MLP has no biases")
    _require(hf.get("pretraining_tp", 1) == 1, f"its pretraining_tp={hf.get('pretraining_tp')}: ppctl computes "
                                               f"the unsplit model only")
    _require(not hf.get("use_sliding_window", False), "its use_sliding_window=true: ppctl attends to the whole "
                                                      "sequence")


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.rope_*`` settings of a config's rotary parameters (``rope_parameters``, or the older
    ``rope_theta`` and ``rope_scaling``)."""
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta")}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if kind == "default":
        return {"rope_theta": theta}
    _require(kind == "llama3", f"its rope_type={kind!r}: ppctl computes the plain rotary embedding ('default') and "
                               f"Llama 3's scaling ('llama3') only")
    return {"rope_theta": theta, "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_position": int(rope["original_max_position_embeddings"])}


def _rope_parameters(model) -> dict[str, Any]:
    """``rope_parameters`` of a Llama model: the plain rotary embedding, or Llama 3's scaling."""
    scaling = model.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": float(model.rope_theta)}
    return {"rope_type": "llama3", "rope_theta": float(model.rope_theta), "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor), "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings)}


FORMAT = LlamaHuggingFace()
