"""The Gemma family in Hugging Face format: ``GemmaForCausalLM``, both ways; ``Gemma2ForCausalLM`` refused by name.

A Gemma's tensors have Llama's names (``ppctl.model.llama.hf``: ``model.embed_tokens``, ``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``...), its RMSNorm weights stored as transformers stores them (around 0: the
norm scales by ``1 + weight``), so the mapping is Llama's renames. ``config.json`` is read as transformers'
``GemmaConfig`` reads it: its defaults (a ``head_dim`` of 256 and 16 key/value heads when absent, tied embeddings,
``rms_norm_eps`` 1e-6), its strict types, and ``hidden_act`` the MLP's gate (``hidden_activation``, an older key,
is not read by transformers and not here); ``"gelu"`` is read as the tanh GELU, as ``GemmaConfig`` rewrites it.
Refused: another activation, ``attention_bias`` (a bias on every projection), bidirectional attention.

Gemma 2 is refused in one line: every one of its layers soft-caps its attention logits (``attn_logit_softcapping``,
``tanh(scores / cap) * cap`` inside the attention core, before the softmax), scales them by
``query_pre_attn_scalar`` and every other layer slides a window; ppctl's attention (PyTorch's SDPA, CP's
allgather, ring and all-to-all) computes a plain causal softmax. Checked against ``transformers`` in
``tests/unit/test_hf_gemma.py``. Pure: names and numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, architecture_of, check_keys
from ppctl.model.llama.hf import BOOL, FLOAT, INT, NONE, SIZES, STR, LlamaHuggingFace, llama_config, llama_shape

GEMMA, GEMMA2 = "GemmaForCausalLM", "Gemma2ForCausalLM"
# transformers' GemmaConfig defaults for the keys a config.json may leave out.
GEMMA_DEFAULTS = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
                  "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": True, "attention_bias": False, "use_bidirectional_attention": None,
                  "rope_theta": 10000.0, "rope_scaling": None}
# GemmaConfig's strict types of the keys ppctl reads (the head width and key/value heads are integers, never null).
GEMMA_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,), "num_hidden_layers": (INT,),
               "num_attention_heads": (INT,), "num_key_value_heads": (INT,), "head_dim": (INT,), "hidden_act": (STR,),
               "max_position_embeddings": (INT,), "rms_norm_eps": (FLOAT,), "tie_word_embeddings": (BOOL,),
               "attention_bias": (BOOL,), "use_bidirectional_attention": (BOOL, NONE)}
# transformers' names of the tanh GELU (ppctl's GeGLU gate): GemmaConfig rewrites "gelu" to gelu_pytorch_tanh.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu")
GEMMA2_REFUSAL = ("its model_type 'gemma2' is Gemma 2, which soft-caps every layer's attention logits "
                  "(attn_logit_softcapping: tanh(scores / cap) * cap before the softmax), scales them by "
                  "query_pre_attn_scalar and slides a window on every other layer: ppctl's attention computes a plain "
                  "causal softmax (Gemma 1 is model_type 'gemma')")


class GemmaHuggingFace(LlamaHuggingFace):
    """The Gemma family's HF format (see ``ppctl.model.hf_format``): Llama's tensors, Gemma's ``config.json``."""

    architectures = (GEMMA, GEMMA2)
    model_types = {"gemma": GEMMA, "gemma2": GEMMA2}
    base_model_prefixes = {GEMMA: "model", GEMMA2: "model"}
    word_embeddings = {GEMMA: "model.embed_tokens.weight", GEMMA2: "model.embed_tokens.weight"}
    moe_architecture = None  # a Gemma has no experts

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Gemma model (a ``LlamaConfig`` with Gemma's hooks): the tanh GELU, no biases."""
        return {"architectures": [GEMMA], "model_type": "gemma", **llama_config(model),
                "head_dim": model.head_dim, "hidden_act": "gelu_pytorch_tanh", "attention_bias": False}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Gemma ``config.json``; ``HFError`` for Gemma 2 and what ppctl's Gemma does
        not compute."""
        architecture = architecture_of(hf_config)
        _require(architecture != GEMMA2, GEMMA2_REFUSAL)
        _require(architecture == GEMMA, f"its {architecture} is no architecture model.family=gemma reads ({GEMMA})")
        hf = {**GEMMA_DEFAULTS, **hf_config}
        check_keys(hf, GEMMA_TYPES, SIZES)
        _require(hf["hidden_act"] in GELU_TANH, f"its hidden_act={hf['hidden_act']!r}: ppctl's gemma gates its MLP "
                                                f"with the tanh GELU only ({', '.join(GELU_TANH)})")
        _require(not hf["attention_bias"], "its attention_bias=true puts a bias on every attention projection: "
                                           "ppctl's gemma has none")
        _require(not hf["use_bidirectional_attention"], "its use_bidirectional_attention=true: ppctl's gemma "
                                                        "attends causally")
        return {**llama_shape(hf, "gemma"), "qkv_bias": False, "moe.num_experts": 0}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = GemmaHuggingFace()
