"""The Mistral family in Hugging Face format: ``MistralForCausalLM``, both ways.

A Mistral is a Llama (``ppctl.model.llama.hf``: the same tensor names, RMSNorm, SwiGLU, grouped-query attention,
rotary positions read from ``rope_parameters`` as Llama reads them) without biases, whose attention may slide: with
``sliding_window`` W, transformers' mask lets a query attend to the keys fewer than W positions back (a key at
distance W or more is hidden), so a window of at least the longest sequence (``max_position_embeddings``, the
run's ``model.max_seq_length``: no training or generated sequence is longer) hides nothing and the model computes
exactly what Llama computes. A shorter window is refused in one line: ppctl's attention paths (one process, TP/SP,
CP's allgather, ring and all-to-all) attend causally over the whole sequence. A window key absent from
``config.json`` is MistralConfig's default, 4096. Written back with ``sliding_window: null``. ``attention_bias``,
``mlp_bias`` and ``pretraining_tp`` are not MistralConfig's: a folder that holds them is read as transformers builds
it, without them. Checked against ``transformers`` in ``tests/unit/test_hf_mistral_phi3.py``. Pure: names and
numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, architecture_of, check_keys
from ppctl.model.llama.hf import (BOOL, FLOAT, INT, LLAMA_DEFAULTS, NONE, SILU, SIZES, STR, LlamaHuggingFace,
                                  llama_config, llama_shape)

MISTRAL = "MistralForCausalLM"
# transformers' MistralConfig defaults for the keys a config.json may leave out (a window of 4096 among them).
MISTRAL_DEFAULTS = {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                    "max_position_embeddings": 4096 * 32, "sliding_window": 4096}
# MistralConfig's strict types of the keys ppctl reads (num_key_value_heads is an integer, never null).
MISTRAL_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,),
                 "num_hidden_layers": (INT,), "num_attention_heads": (INT,), "num_key_value_heads": (INT,),
                 "head_dim": (INT, NONE), "hidden_act": (STR,), "max_position_embeddings": (INT,),
                 "rms_norm_eps": (FLOAT,), "tie_word_embeddings": (BOOL,), "sliding_window": (INT, NONE)}


class MistralHuggingFace(LlamaHuggingFace):
    """The Mistral family's HF format (see ``ppctl.model.hf_format``): Llama's tensors, Mistral's ``config.json``."""

    architectures = (MISTRAL,)
    model_types = {"mistral": MISTRAL}
    base_model_prefixes = {MISTRAL: "model"}
    word_embeddings = {MISTRAL: "model.embed_tokens.weight"}
    moe_architecture = None  # a Mistral has no experts (Mixtral is model.family=llama's)

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Mistral model (a ``LlamaConfig`` of the mistral family): no window."""
        return {"architectures": [MISTRAL], "model_type": "mistral", **llama_config(model), "sliding_window": None}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Mistral ``config.json``; ``HFError`` for a window shorter than its
        sequences or another activation than SiLU."""
        architecture = architecture_of(hf_config)
        if architecture not in self.architectures:
            raise HFError(f"its {architecture} is no architecture model.family=mistral reads ({MISTRAL})")
        hf = {**MISTRAL_DEFAULTS, **hf_config}
        check_keys(hf, MISTRAL_TYPES, (*SIZES, "sliding_window"))
        _require(hf["hidden_act"] in SILU, f"its hidden_act={hf['hidden_act']!r}: ppctl's mistral computes SwiGLU "
                                           f"with SiLU only ({', '.join(SILU)})")
        check_window(hf, "sliding_window", hf["sliding_window"])
        return {**llama_shape(hf, "mistral"), "qkv_bias": False, "moe.num_experts": 0}


def check_window(hf: dict[str, Any], key: str, window: int | None) -> None:
    """``HFError`` unless a sliding window of ``window`` keys (transformers' mask: a query sees the keys fewer than
    ``window`` positions back) hides nothing from sequences of up to ``max_position_embeddings`` positions."""
    longest = hf["max_position_embeddings"]
    _require(window is None or window >= longest,
             f"its {key}={window} is shorter than its max_position_embeddings={longest} (model.max_seq_length, the "
             f"run's longest sequence): the window hides keys {window} or more positions back, and ppctl attends "
             f"over the whole sequence (a window of at least {longest}, or null, computes the same)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


FORMAT = MistralHuggingFace()
