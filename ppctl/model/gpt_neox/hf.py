"""The GPT-NeoX family in Hugging Face format: ``GPTNeoXForCausalLM`` (Pythia), both ways.

What the mapping rests on (checked against ``transformers`` in ``tests/unit/test_hf_gpt_gqa_neox.py``):

* the layer: transformers' ``GPTNeoXLayer`` is ppctl's GPT layer (``ppctl.model.gpt_neox``) with
  ``use_parallel_residual`` (``model.parallel_residual``; false is GPT's sequential residual), LayerNorm with a
  shift (``layer_norm_eps``), a GELU MLP with biases (``hidden_act``, read as GPT reads StarCoder2's), and
  ``attention_bias`` on ``query_key_value`` and ``dense`` (``model.qkv_bias``; without it ppctl's output
  projection bias is zero, and a run writes it back with the bias).
* ``query_key_value``: its rows are ``[q, k, v]`` of head 0, then head 1, ... (transformers views its output as
  ``[heads, 3 * head_dim]`` and cuts each head's into q, k and v): ppctl's GPT-NeoX keeps that layout
  (``GPTConfig.qkv_per_head``), so the tensor is read and written as it is, a TP rank's rows being whole heads.
* rotary: transformers rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head (rotate-half
  over them) with ``rope_theta ** (-2i / rotary_dim)``, the rest passed unchanged: ppctl's partial rotary. It
  reads the two from ``rope_parameters`` (an older non-empty ``rope_scaling`` replaces it whole), each missing one
  from the older keys ``rotary_emb_base`` (10000) and ``rotary_pct`` (0.25); a top-level ``rope_theta`` or
  ``partial_rotary_factor`` is not read. Refused: another ``rope_type`` than ``default``, an odd number of rotated
  dims. Written with both spellings, so older transformers read the same.
* the output layer: checkpoints name it ``embed_out.weight``, the hub's Pythia and transformers' own saves alike
  (transformers 5 calls it ``lm_head`` inside the model and renames it both ways); ppctl reads and writes that name.
* config.json: each key type-checked as ``GPTNeoXConfig``'s strict fields check it, sizes above 0.

Pure: names and numbers only (``model`` holds the ``model.*`` settings by name).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ppctl.model.gpt.hf import BOOL, FLOAT, INT, STR, GPTHuggingFace, activation_of
from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys

GPT_NEOX = "GPTNeoXForCausalLM"
OUTPUT_LAYER = "embed_out.weight"  # GPT-NeoX's output layer as checkpoints name it (transformers 5's lm_head inside)
EXPORTED_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
# transformers' GPTNeoXConfig defaults for the keys a config.json may leave out; the older rotary keys' defaults.
GPT_NEOX_DEFAULTS = {"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                     "intermediate_size": 24576, "hidden_act": "gelu", "max_position_embeddings": 2048,
                     "layer_norm_eps": 1e-5, "tie_word_embeddings": False, "use_parallel_residual": True,
                     "attention_bias": True}
ROTARY_BASE, ROTARY_FRACTION = 10000.0, 0.25  # rotary_emb_base's and rotary_pct's defaults (GPTNeoXConfig)
GPT_NEOX_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "num_hidden_layers": (INT,),
                  "num_attention_heads": (INT,), "intermediate_size": (INT,), "hidden_act": (STR,),
                  "max_position_embeddings": (INT,), "layer_norm_eps": (FLOAT,), "tie_word_embeddings": (BOOL,),
                  "use_parallel_residual": (BOOL,), "attention_bias": (BOOL,)}
GPT_NEOX_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings")


class GPTNeoXHuggingFace:
    """The GPT-NeoX family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (GPT_NEOX,)
    model_types = {"gpt_neox": GPT_NEOX}
    base_model_prefixes = {GPT_NEOX: "gpt_neox"}
    word_embeddings = {GPT_NEOX: "gpt_neox.embed_in.weight"}

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a GPT-NeoX model (its settings, or its ``GPTConfig``): the rotary parameters in
        ``rope_parameters`` and in the older ``rotary_pct``/``rotary_emb_base``, the attention's biases always (a run
        without the QKV bias writes zeros)."""
        theta = float(model.rope_theta if hasattr(model, "rope_theta") else model.rope_base)
        factor = float(model.partial_rotary_factor)
        return {"architectures": [GPT_NEOX], "model_type": "gpt_neox", "vocab_size": model.vocab_size,
                "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
                "num_attention_heads": model.num_heads, "intermediate_size": model.ffn_hidden_size,
                "hidden_act": EXPORTED_ACTIVATIONS[model.activation], "max_position_embeddings": model.max_seq_length,
                "layer_norm_eps": model.norm_epsilon, "initializer_range": model.init_std,
                "tie_word_embeddings": model.tie_embeddings, "use_parallel_residual": model.parallel_residual,
                "attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                                            "partial_rotary_factor": factor},
                "rotary_pct": factor, "rotary_emb_base": theta, "attention_dropout": 0.0, "hidden_dropout": 0.0,
                "use_cache": True}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a GPT-NeoX ``config.json``; ``HFError`` for what ppctl cannot compute
        exactly."""
        architecture = architecture_of(hf_config)
        if architecture != GPT_NEOX:
            raise HFError(f"its {architecture} is no architecture model.family=gpt_neox reads ({GPT_NEOX})")
        hf = {**GPT_NEOX_DEFAULTS, **hf_config}
        check_keys(hf, GPT_NEOX_TYPES, GPT_NEOX_SIZES)
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        _require(hidden % heads == 0, f"its hidden_size={hidden} is not a multiple of its num_attention_heads={heads}")
        theta, factor = rotary_of(hf, hidden // heads)
        return {"family": "gpt_neox", "position_embedding": "rope",
                "activation": activation_of("hidden_act", hf["hidden_act"]), "num_layers": hf["num_hidden_layers"],
                "hidden_size": hidden, "num_heads": heads, "ffn_hidden_size": hf["intermediate_size"],
                "vocab_size": hf["vocab_size"], "max_seq_length": hf["max_position_embeddings"],
                "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_epsilon": hf["layer_norm_eps"],
                "rope_theta": theta, "partial_rotary_factor": factor,
                "parallel_residual": bool(hf["use_parallel_residual"]), "qkv_bias": bool(hf["attention_bias"])}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Every ppctl GPT-NeoX parameter (a tied output layer is the word embedding) -> its HF tensor: renames
        (the output projection's bias absent without ``attention_bias``: ppctl's is zero)."""
        attention_bias = {**GPT_NEOX_DEFAULTS, **hf_config}["attention_bias"]
        roles = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                 "mlp.fc_in": "mlp.dense_h_to_4h", "mlp.fc_out": "mlp.dense_4h_to_h"}
        tensors = {"embedding.word.weight": HFTensor(("gpt_neox.embed_in.weight",))}
        for layer in range(model.num_layers):
            ppctl, hf = f"layers.{layer}", f"gpt_neox.layers.{layer}"
            for role, name in roles.items():
                for kind in ("weight", "bias"):
                    tensors[f"{ppctl}.{role}.{kind}"] = HFTensor((f"{hf}.{name}.{kind}",))
            tensors[f"{ppctl}.attention.qkv.weight"] = HFTensor((f"{hf}.attention.query_key_value.weight",))
            if model.qkv_bias:
                tensors[f"{ppctl}.attention.qkv.bias"] = HFTensor((f"{hf}.attention.query_key_value.bias",))
            tensors[f"{ppctl}.attention.proj.weight"] = HFTensor((f"{hf}.attention.dense.weight",))
            tensors[f"{ppctl}.attention.proj.bias"] = HFTensor((f"{hf}.attention.dense.bias",) if attention_bias
                                                              else ())
        tensors["final_norm.weight"] = HFTensor(("gpt_neox.final_layer_norm.weight",))
        tensors["final_norm.bias"] = HFTensor(("gpt_neox.final_layer_norm.bias",))
        if not model.tie_embeddings:
            tensors["output_layer.weight"] = HFTensor((OUTPUT_LAYER,))
        return tensors

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """The dense shape of every ppctl GPT-NeoX parameter: GPT's (``model``: its settings by name)."""
        return GPTHuggingFace().dense_shapes(model)

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """The ``query_key_value`` biases ``attention_bias`` gives and a run without ``model.qkv_bias`` lacks: written
        as zeros (a folder with them gives ``qkv_bias=True``, so a run reading it has them)."""
        if model.qkv_bias or not {**GPT_NEOX_DEFAULTS, **hf_config}["attention_bias"]:
            return {}
        return {f"gpt_neox.layers.{layer}.attention.query_key_value.bias": (3 * model.hidden_size,)
                for layer in range(model.num_layers)}


def rotary_of(hf: dict[str, Any], head_dim: int) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` as ``GPTNeoXConfig`` reads them: from ``rope_scaling`` when non-empty,
    else ``rope_parameters``, each missing one from ``rotary_emb_base`` and ``rotary_pct`` (or their defaults);
    ``HFError`` for a kind other than ``default``, a base or fraction out of range, or an odd number of rotated
    dims."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise HFError(f"its {key}={json.dumps(rope)} is not a JSON object of rotary parameters")
    theta = rope.get("rope_theta", hf.get("rotary_emb_base", ROTARY_BASE))
    factor = rope.get("partial_rotary_factor", hf.get("rotary_pct", ROTARY_FRACTION))
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(kind == "default", f"its {key} gives rope_type={kind!r}: ppctl's gpt_neox has the plain rotary "
                                f"embedding ('default') only")
    _require(_number(theta) and theta > 0, f"its rotary base (rope_theta, or rotary_emb_base)={json.dumps(theta)}: a "
                                           f"rotary base is a positive finite number")
    _require(_number(factor) and 0 < factor <= 1, f"its rotary fraction (partial_rotary_factor, or rotary_pct)="
                                                  f"{json.dumps(factor)} is not a number in (0, 1]")
    rotary_dim = int(head_dim * factor)
    _require(rotary_dim >= 2 and rotary_dim % 2 == 0,
             f"its rotary fraction {factor} rotates {rotary_dim} of each head's {head_dim} dims: ppctl rotates an even "
             f"number of them, at least 2")
    return float(theta), float(factor)


def _number(value: Any) -> bool:
    """A JSON number (not true or false) that is finite."""
    return type(value) in (int, float) and math.isfinite(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = GPTNeoXHuggingFace()
