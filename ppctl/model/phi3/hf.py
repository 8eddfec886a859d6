"""The Phi-3 family in Hugging Face format: ``Phi3ForCausalLM``, both ways.

A Phi-3 computes what a Llama computes (RMSNorm, SwiGLU with SiLU, grouped-query attention, rotate-half rotary over
the whole head) with two of its weights fused: ``self_attn.qkv_proj`` holds q, k and v one below the other
(``num_heads * head_dim``, then ``num_kv_heads * head_dim`` rows twice) and ``mlp.gate_up_proj`` holds the gate,
then the up projection (transformers' ``chunk(2)``: the first half is the gate). ppctl's Llama layers keep them
apart, so each is a part of its fused tensor (``HFTensor.fused``): a TP rank reads its own heads' rows of each part
and nothing else, and export joins the parts again. Refused in one line, as ppctl's Llama layers do not compute them:
a rotary type other than the plain one (``longrope``, which Phi-3 also reads from ``su`` and ``yarn``),
``partial_rotary_factor`` other than 1, a sliding window shorter than the longest sequence
(``ppctl.model.mistral.hf.check_window``), an activation other than SiLU. Dropout (``resid_pdrop``, ``embd_pdrop``,
``attention_dropout``) acts in transformers' training mode only: ppctl trains without it. ``head_dim``, not a field
of Phi3Config, is read where a folder gives it, as its attention reads it. Checked against ``transformers`` in
``tests/unit/test_hf_mistral_phi3.py``. Pure: names and numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys, rope_of
from ppctl.model.llama.heads import head_dim_of, kv_heads_of
from ppctl.model.llama.hf import (BOOL, FLOAT, INT, LLAMA_DEFAULTS, NONE, SILU, SIZES, STR, LlamaHuggingFace,
                                  llama_config, llama_shape)
from ppctl.model.mistral.hf import check_window

PHI3 = "Phi3ForCausalLM"
# transformers' Phi3Config defaults for the keys a config.json may leave out (head_dim has none: hidden / heads).
PHI3_DEFAULTS = {**{key: value for key, value in LLAMA_DEFAULTS.items() if key != "head_dim"},
                 "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
                 "rms_norm_eps": 1e-5, "sliding_window": None}
# Phi3Config's strict types of the keys ppctl reads; head_dim (no field) is an integer where it is given.
PHI3_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,), "num_hidden_layers": (INT,),
              "num_attention_heads": (INT,), "num_key_value_heads": (INT, NONE), "head_dim": (INT,),
              "hidden_act": (STR,), "max_position_embeddings": (INT,), "rms_norm_eps": (FLOAT,),
              "tie_word_embeddings": (BOOL,), "sliding_window": (INT, NONE)}
LONGROPE_NAMES = ("su", "yarn")  # what Phi3Config reads as longrope (its older names)


class Phi3HuggingFace(LlamaHuggingFace):
    """The Phi-3 family's HF format (see ``ppctl.model.hf_format``): Llama's tensors with q/k/v and gate/up fused."""

    architectures = (PHI3,)
    model_types = {"phi3": PHI3}
    base_model_prefixes = {PHI3: "model"}
    word_embeddings = {PHI3: "model.embed_tokens.weight"}
    moe_architecture = None

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Phi-3 model (a ``LlamaConfig`` of the phi3 family): no window, no padding id (ppctl
        trains every embedding row, where transformers' ``padding_idx`` would keep one at zero gradient)."""
        return {"architectures": [PHI3], "model_type": "phi3", **llama_config(model), "sliding_window": None,
                "original_max_position_embeddings": model.max_seq_length, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "pad_token_id": None}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Phi-3 ``config.json``; ``HFError`` for what ppctl cannot compute."""
        architecture = architecture_of(hf_config)
        if architecture not in self.architectures:
            raise HFError(f"its {architecture} is no architecture model.family=phi3 reads ({PHI3})")
        hf = {**PHI3_DEFAULTS, **hf_config}
        check_keys(hf, PHI3_TYPES, (*SIZES, "sliding_window"))
        _require(hf["hidden_act"] in SILU, f"its hidden_act={hf['hidden_act']!r}: ppctl's phi3 computes SwiGLU with "
                                           f"SiLU only ({', '.join(SILU)})")
        check_window(hf, "sliding_window", hf["sliding_window"])
        _check_plain_rotary(hf)
        return {**llama_shape(hf, "phi3"), "qkv_bias": False, "moe.num_experts": 0}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Llama's tensors, q/k/v parts of ``qkv_proj`` and gate/up parts of ``gate_up_proj``."""
        tensors = super().tensors(model, hf_config)
        queries, keys = model.num_heads * head_dim_of(model), kv_heads_of(model) * head_dim_of(model)
        fused_rows, ffn = queries + 2 * keys, model.ffn_hidden_size
        for layer in range(model.num_layers):
            attention = f"model.layers.{layer}.self_attn.qkv_proj.weight"
            mlp = f"model.layers.{layer}.mlp.gate_up_proj.weight"
            for part, offset in (("q", 0), ("k", queries), ("v", queries + keys)):
                tensors[f"layers.{layer}.self_attn.{part}_proj.weight"] = HFTensor((attention,),
                                                                                    fused=(offset, fused_rows))
            for part, offset in (("gate", 0), ("up", ffn)):
                tensors[f"layers.{layer}.mlp.{part}_proj.weight"] = HFTensor((mlp,), fused=(offset, 2 * ffn))
        return tensors


def _check_plain_rotary(hf: dict[str, Any]) -> None:
    """``HFError`` unless the rotary embedding is the plain one over the whole head, as Phi3Config reads it (its
    ``su`` and ``yarn`` are longrope; ``partial_rotary_factor`` from the rotary parameters, else the top level)."""
    key, rope = rope_of(hf, LLAMA_DEFAULTS["rope_theta"])
    kind = "longrope" if rope["rope_type"] in LONGROPE_NAMES else rope["rope_type"]
    _require(kind == "default", f"its {key} gives rope_type={rope['rope_type']!r} (Phi-3 computes it as {kind!r}): "
                                f"ppctl's phi3 computes the plain rotary embedding ('default') only")
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _require(factor == 1, f"its partial_rotary_factor={factor}: ppctl's phi3 rotates the whole head (1.0) only")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = Phi3HuggingFace()
