"""The OLMo 2 family in Hugging Face format: ``Olmo2ForCausalLM``, both ways; OLMo (v1) refused by name.

ppctl's OLMo 2 parameters carry transformers' names under ``layers.<i>.`` (``self_attn.q_norm``,
``post_attention_layernorm``, ``post_feedforward_layernorm``, the projections and the MLP as Llama's), ``embed_tokens``
is ``embedding.word``, ``norm`` is ``final_norm``, ``lm_head`` is ``output_layer``: renames. ``config.json`` is read
as transformers' ``Olmo2Config`` reads it (its defaults: ``rms_norm_eps`` 1e-5, untied, key/value heads unset meaning
``num_attention_heads``; its strict types; ``head_dim``, which ``Olmo2Config`` does not declare, read as its
attention reads it: when present). Refused: another activation than SiLU, ``attention_bias`` (biases on every
projection). Checked against ``transformers`` in ``tests/unit/test_hf_olmo2.py``. Pure: names and numbers only.

OLMo (v1, ``model_type`` ``olmo``) is refused in one line: its LayerNorm has neither scale nor shift and its
``clip_qkv`` clamps the projections, neither of which ppctl computes.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys
from ppctl.model.llama.heads import head_dim_of, kv_heads_of
from ppctl.model.llama.hf import BOOL, FLOAT, INT, NONE, SILU, SIZES, STR, LlamaHuggingFace, llama_config, llama_shape

OLMO2, OLMO = "Olmo2ForCausalLM", "OlmoForCausalLM"
# transformers' Olmo2Config defaults for the keys a config.json may leave out.
OLMO2_DEFAULTS = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "attention_bias": False, "rope_theta": 10000.0, "rope_scaling": None}
# Olmo2Config's strict types of the keys ppctl reads (head_dim is no field of it: an integer where present).
OLMO2_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,), "num_hidden_layers": (INT,),
               "num_attention_heads": (INT,), "num_key_value_heads": (INT, NONE), "head_dim": (INT,),
               "hidden_act": (STR,), "max_position_embeddings": (INT,), "rms_norm_eps": (FLOAT,),
               "tie_word_embeddings": (BOOL,), "attention_bias": (BOOL,)}
OLMO_REFUSAL = ("its model_type 'olmo' is OLMo (v1), whose LayerNorm has neither scale nor shift and whose clip_qkv "
                "clamps the q/k/v projections: ppctl computes neither (OLMo 2 is model_type 'olmo2')")
# Each layer's tensors by ppctl role, in the order an export writes them: norms and o_proj, MLP, q/k/v and q/k norms.
LAYER_ROLES = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "self_attn.o_proj.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_norm.weight",
               "self_attn.k_norm.weight")


class Olmo2HuggingFace(LlamaHuggingFace):
    """The OLMo 2 family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (OLMO2, OLMO)
    model_types = {"olmo2": OLMO2, "olmo": OLMO}
    base_model_prefixes = {OLMO2: "model", OLMO: "model"}
    word_embeddings = {OLMO2: "model.embed_tokens.weight", OLMO: "model.embed_tokens.weight"}
    moe_architecture = None  # an OLMo 2 has no experts

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of an OLMo 2 model (a ``LlamaConfig`` of the olmo2 family): SiLU, no biases."""
        return {"architectures": [OLMO2], "model_type": "olmo2", **llama_config(model), "attention_bias": False}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of an OLMo 2 ``config.json``; ``HFError`` for OLMo (v1) and what ppctl's OLMo 2
        does not compute."""
        architecture = architecture_of(hf_config)
        _require(architecture != OLMO, OLMO_REFUSAL)
        _require(architecture == OLMO2, f"its {architecture} is no architecture model.family=olmo2 reads ({OLMO2})")
        hf = {**OLMO2_DEFAULTS, **hf_config}
        check_keys(hf, OLMO2_TYPES, SIZES)
        _require(hf["hidden_act"] in SILU, f"its hidden_act={hf['hidden_act']!r}: ppctl's olmo2 computes SwiGLU with "
                                           f"SiLU only ({', '.join(SILU)})")
        _require(not hf["attention_bias"], "its attention_bias=true puts a bias on every attention projection: "
                                           "ppctl's olmo2 has none")
        return {**llama_shape(hf, "olmo2"), "qkv_bias": False, "moe.num_experts": 0}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Every ppctl OLMo 2 parameter (a tied output layer is the word embedding) -> its HF tensor: renames."""
        tensors = {"embedding.word.weight": HFTensor(("model.embed_tokens.weight",)),
                   "final_norm.weight": HFTensor(("model.norm.weight",))}
        for layer in range(model.num_layers):
            tensors.update({f"layers.{layer}.{role}": HFTensor((f"model.layers.{layer}.{role}",))
                            for role in LAYER_ROLES})
        if not model.tie_embeddings:
            tensors["output_layer.weight"] = HFTensor(("lm_head.weight",))
        return tensors

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """The dense shape of every ppctl OLMo 2 parameter (``model``: its settings by name; the vocabulary
        unpadded): grouped-query q/k/v of ``head_dim`` wide heads, the q/k norms as wide as q and k."""
        hidden, vocab, ffn = model.hidden_size, model.vocab_size, model.ffn_hidden_size
        queries, keys = model.num_heads * head_dim_of(model), kv_heads_of(model) * head_dim_of(model)
        roles = {"post_attention_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
                 "self_attn.o_proj.weight": (hidden, queries), "mlp.gate_proj.weight": (ffn, hidden),
                 "mlp.up_proj.weight": (ffn, hidden), "mlp.down_proj.weight": (hidden, ffn),
                 "self_attn.q_proj.weight": (queries, hidden), "self_attn.k_proj.weight": (keys, hidden),
                 "self_attn.v_proj.weight": (keys, hidden), "self_attn.q_norm.weight": (queries,),
                 "self_attn.k_norm.weight": (keys,)}
        shapes = {"embedding.word.weight": (vocab, hidden), "final_norm.weight": (hidden,),
                  "output_layer.weight": (vocab, hidden)}
        for layer in range(model.num_layers):
            shapes.update({f"layers.{layer}.{role}": shape for role, shape in roles.items()})
        return shapes


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = Olmo2HuggingFace()
