"""The GPT family in Hugging Face format: ``GPT2LMHeadModel`` (learned positions) and ``Starcoder2ForCausalLM``
(rotary), both ways.

What the mapping rests on (checked against ``transformers`` in ``tests/unit/test_hf_gpt.py``):

* the activation: each ``model.activation`` is read from the HF names ``HF_ACTIVATIONS`` gives (GPT-2's
  ``activation_function``, StarCoder2's ``hidden_act``), each torch's GELU of that approximation to one rounding in
  float64: GPT-2's own checkpoints (``gelu_new``) and StarCoder2's default (``gelu_pytorch_tanh``) are
  ``gelu_tanh``. ``gelu_fast`` is refused: its constant, cut to 10 digits, moves it thousands of roundings away.
* learned positions: ppctl's GPT with ``model.qkv_bias=true`` is ``GPT2LMHeadModel``. GPT-2 keeps its linear
  weights as ``Conv1D``, ``[in, out]``: each is ppctl's transposed. ``c_attn``'s columns are ``[q; k; v]``, each
  head-major: ppctl's fused QKV rows, and ``c_attn.bias`` the QKV bias in the same order. Every GPT-2 has the
  bias, so a GPT-2 folder always gives ``qkv_bias=True`` (a zero bias read as a bias is exact too, and one rule
  that does not depend on the tensor's values keeps ``shape_from_hf`` a function of ``config.json``); a run
  without the bias exports zeros.
* rotary positions: ppctl's GPT is ``Starcoder2ForCausalLM`` (LayerNorm with biases, a sequential residual,
  rotate-half rotary over the whole head) whose ``sliding_window`` (if any) is no shorter than its
  ``max_position_embeddings`` (a shorter one is refused: ppctl attends over the whole sequence; written back as
  null); with ``num_key_value_heads = num_attention_heads`` ppctl's QKV rows are ``q_proj``, ``k_proj`` and
  ``v_proj`` one after the other (their biases, with ``use_bias``, the QKV bias likewise: ``qkv_bias`` is
  ``use_bias``); with fewer key/value heads (``model.num_kv_heads``, grouped-query attention) ppctl's
  ``attention.query``, ``key`` and ``value`` are those three one to one. Its weights are ``nn.Linear``'s
  ``[out, in]``.
* config.json: read by ``model_type`` (``gpt2``, ``starcoder2``), each key type-checked as transformers' strict
  fields check it (``"n_embd": "64"`` or ``64.0`` is refused, not read), sizes above 0; StarCoder2's rotary
  parameters where transformers finds them (``hf_format.rope_of``: an older ``rope_scaling`` replaces
  ``rope_parameters``), refused unless plain (``default``), as ppctl's GPT computes no scaling.
* names: each folder's tensors may also be stored without the base model's prefix (``BASE_MODEL_PREFIXES``), as
  ``GPT2Model`` and the hub's ``gpt2`` files store them (``ppctl.model.hf_format.stored_name``); GPT-2's causal
  mask buffers (``attn.bias``, ``attn.masked_bias``) are not parameters and are never read.

Pure: names and numbers only (``model`` holds the ``model.*`` settings by name).
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys, rope_of

GPT2 = "GPT2LMHeadModel"
STARCODER2 = "Starcoder2ForCausalLM"
# transformers' base_model_prefix of each architecture: what a folder saved from its base model leaves out.
BASE_MODEL_PREFIXES = {GPT2: "transformer", STARCODER2: "model"}
# model.activation -> the transformers activation names (ACT2FN) that compute it, each equal to torch's F.gelu of that
# approximation to one rounding in float64 (tests/unit/test_hf_gpt.py); and what export writes, each architecture's
# own name (GPT-2's default is gelu_new, StarCoder2's gelu_pytorch_tanh).
HF_ACTIVATIONS = {"gelu": ("gelu", "gelu_python"),
                  "gelu_tanh": ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate")}
EXPORTED_ACTIVATIONS = {GPT2: {"gelu": "gelu", "gelu_tanh": "gelu_new"},
                        STARCODER2: {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}}
# transformers' defaults for the keys a config.json may leave out (GPT2Config, Starcoder2Config).
GPT2_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                 "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
                 "tie_word_embeddings": True}
# The JSON types transformers' GPT2Config and Starcoder2Config take for the keys ppctl reads (``check_keys``), and the
# sizes that must be above 0.
INT, FLOAT, BOOL, STR, NONE = int, float, bool, str, type(None)
GPT2_TYPES = {"vocab_size": (INT,), "n_positions": (INT,), "n_embd": (INT,), "n_layer": (INT,), "n_head": (INT,),
              "n_inner": (INT, NONE), "activation_function": (STR,), "layer_norm_epsilon": (FLOAT,),
              "scale_attn_weights": (BOOL,), "scale_attn_by_inverse_layer_idx": (BOOL,),
              "add_cross_attention": (BOOL,), "tie_word_embeddings": (BOOL,)}
GPT2_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")
STARCODER2_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,),
                    "num_hidden_layers": (INT,), "num_attention_heads": (INT,), "num_key_value_heads": (INT,),
                    "head_dim": (INT, NONE), "hidden_act": (STR,), "max_position_embeddings": (INT,),
                    "norm_epsilon": (FLOAT,), "sliding_window": (INT, NONE), "use_bias": (BOOL,),
                    "tie_word_embeddings": (BOOL,), "partial_rotary_factor": (FLOAT, INT)}
STARCODER2_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
STARCODER2_DEFAULTS = {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
                       "num_attention_heads": 24, "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh",
                       "max_position_embeddings": 4096, "norm_epsilon": 1e-5, "sliding_window": None,
                       "use_bias": True, "tie_word_embeddings": True}
STARCODER2_DEFAULT_THETA = 10000.0  # Starcoder2Config.default_theta: without rope_theta anywhere


class GPTHuggingFace:
    """The GPT family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (GPT2, STARCODER2)
    model_types = {"gpt2": GPT2, "starcoder2": STARCODER2}  # config.json's model_type -> what transformers builds
    base_model_prefixes = BASE_MODEL_PREFIXES
    word_embeddings = {GPT2: "transformer.wte.weight", STARCODER2: "model.embed_tokens.weight"}

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a GPT model: GPT-2's for learned positions, StarCoder2's for rotary ones."""
        common = {"vocab_size": model.vocab_size, "initializer_range": model.init_std,
                  "tie_word_embeddings": model.tie_embeddings, "use_cache": True}
        if model.position_embedding == "learned":
            if _grouped(model):
                raise HFError(f"{GPT2} has as many key/value heads as heads, this model has model.num_kv_heads="
                              f"{kv_heads_of(model)} of model.num_heads={model.num_heads} (rotary positions write "
                              f"{STARCODER2}, which has grouped-query attention)")
            return {"architectures": [GPT2], "model_type": "gpt2", **common, "n_positions": model.max_seq_length,
                    "n_embd": model.hidden_size, "n_layer": model.num_layers, "n_head": model.num_heads,
                    "n_inner": model.ffn_hidden_size,
                    "activation_function": EXPORTED_ACTIVATIONS[GPT2][model.activation],
                    "layer_norm_epsilon": model.norm_epsilon, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                    "attn_pdrop": 0.0, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                    "reorder_and_upcast_attn": False}
        rope_theta = float(model.rope_theta if hasattr(model, "rope_theta") else model.rope_base)
        return {"architectures": [STARCODER2], "model_type": "starcoder2", **common,
                "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
                "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
                "num_key_value_heads": kv_heads_of(model),
                "hidden_act": EXPORTED_ACTIVATIONS[STARCODER2][model.activation],
                "max_position_embeddings": model.max_seq_length, "norm_epsilon": model.norm_epsilon,
                "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}, "rope_theta": rope_theta,
                "use_bias": True, "sliding_window": None, "attention_dropout": 0.0, "residual_dropout": 0.0,
                "embedding_dropout": 0.0}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a GPT-2 or StarCoder2 ``config.json``; ``HFError`` for what ppctl's GPT cannot
        compute exactly."""
        architecture = architecture_of(hf_config)
        if architecture == GPT2:
            return _gpt2_shape({**GPT2_DEFAULTS, **hf_config})
        if architecture == STARCODER2:
            return _starcoder2_shape({**STARCODER2_DEFAULTS, **hf_config})
        raise HFError(f"its {architecture} is no architecture model.family=gpt reads ({GPT2}: learned positions, "
                      f"{STARCODER2}: rotary)")

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Every ppctl GPT parameter (a tied output layer is the word embedding) -> its HF tensor."""
        if model.position_embedding == "learned":
            return _gpt2_tensors(model)
        return _starcoder2_tensors(model, {**STARCODER2_DEFAULTS, **hf_config}["use_bias"])

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """The dense shape of every ppctl GPT parameter (``model``: its settings by name; the vocabulary unpadded)."""
        hidden, ffn, vocab = model.hidden_size, model.ffn_hidden_size, model.vocab_size
        kv_width = kv_heads_of(model) * (hidden // model.num_heads)
        roles = {"attn_norm.weight": (hidden,), "attn_norm.bias": (hidden,), "mlp_norm.weight": (hidden,),
                 "mlp_norm.bias": (hidden,), "attention.qkv.weight": (3 * hidden, hidden),
                 "attention.qkv.bias": (3 * hidden,), "attention.query.weight": (hidden, hidden),
                 "attention.query.bias": (hidden,), "attention.key.weight": (kv_width, hidden),
                 "attention.key.bias": (kv_width,), "attention.value.weight": (kv_width, hidden),
                 "attention.value.bias": (kv_width,), "attention.proj.weight": (hidden, hidden),
                 "attention.proj.bias": (hidden,), "mlp.fc_in.weight": (ffn, hidden), "mlp.fc_in.bias": (ffn,),
                 "mlp.fc_out.weight": (hidden, ffn), "mlp.fc_out.bias": (hidden,)}
        shapes = {"embedding.word.weight": (vocab, hidden), "embedding.position.weight": (model.max_seq_length, hidden),
                  "final_norm.weight": (hidden,), "final_norm.bias": (hidden,), "output_layer.weight": (vocab, hidden)}
        shapes.update({f"layers.{layer}.{role}": shape for layer in range(model.num_layers)
                       for role, shape in roles.items()})
        return shapes

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """The QKV biases HF has and a run without ``model.qkv_bias`` lacks: written as zeros on export (a folder
        that has them gives ``qkv_bias=True``, so a run reading it has them)."""
        if model.qkv_bias:
            return {}
        if model.position_embedding == "learned":
            return {f"transformer.h.{layer}.attn.c_attn.bias": (3 * model.hidden_size,)
                    for layer in range(model.num_layers)}
        if not {**STARCODER2_DEFAULTS, **hf_config}["use_bias"]:
            return {}
        kv_width = kv_heads_of(model) * (model.hidden_size // model.num_heads)
        widths = {"q": model.hidden_size, "k": kv_width, "v": kv_width}
        return {f"model.layers.{layer}.self_attn.{part}_proj.bias": (width,)
                for layer in range(model.num_layers) for part, width in widths.items()}


def kv_heads_of(model) -> int:
    """The key/value heads of a GPT model (``model``: its settings by name, or its ``GPTConfig``): ``num_kv_heads``,
    or ``num_heads`` when unset (None)."""
    kv_heads = getattr(model, "num_kv_heads", None)
    return model.num_heads if kv_heads is None else kv_heads


def _grouped(model) -> bool:
    """Whether the model has fewer key/value heads than heads: q, k and v projected apart."""
    return kv_heads_of(model) != model.num_heads


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


def activation_of(key: str, name: str) -> str:
    """The ``model.activation`` of the HF activation ``name`` (read from ``key``); ``HFError`` for one ppctl's gpt
    does not compute."""
    for activation, names in HF_ACTIVATIONS.items():
        if name in names:
            return activation
    known = "; ".join(f"model.activation={activation}: {', '.join(names)}"
                      for activation, names in HF_ACTIVATIONS.items())
    raise HFError(f"its {key}={name!r} is no activation ppctl's gpt computes exactly ({known}), so this model cannot "
                  f"be expressed exactly")


def _gpt2_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """The GPT shape of a GPT-2 config (defaults filled in)."""
    check_keys(hf, GPT2_TYPES, GPT2_SIZES)
    activation = activation_of("activation_function", hf["activation_function"])
    _require(hf["scale_attn_weights"] and not hf["scale_attn_by_inverse_layer_idx"],
             "its attention scores are not scaled by 1/sqrt(head dim) alone (scale_attn_weights, "
             "scale_attn_by_inverse_layer_idx): ppctl's gpt cannot express it")
    _require(not hf["add_cross_attention"], "it has cross-attention (add_cross_attention): ppctl's gpt has none")
    return {"family": "gpt", "position_embedding": "learned", "activation": activation,
            "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"], "num_heads": hf["n_head"],
            "ffn_hidden_size": hf["n_inner"] if hf["n_inner"] is not None else 4 * hf["n_embd"],
            "vocab_size": hf["vocab_size"], "max_seq_length": hf["n_positions"],
            "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_epsilon": hf["layer_norm_epsilon"],
            "qkv_bias": True}


def _starcoder2_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary GPT shape of a StarCoder2 config (defaults filled in)."""
    check_keys(hf, STARCODER2_TYPES, STARCODER2_SIZES)
    heads, hidden, kv_heads = hf["num_attention_heads"], hf["hidden_size"], hf["num_key_value_heads"]
    activation = activation_of("hidden_act", hf["hidden_act"])
    _require(heads % kv_heads == 0, f"its num_attention_heads={heads} is not a multiple of its num_key_value_heads="
                                    f"{kv_heads}: each key/value head serves a whole group of query heads")
    _check_window(hf["sliding_window"], hf["max_position_embeddings"])
    _require(hf.get("head_dim", hidden // heads) == hidden // heads,
             f"its head_dim={hf.get('head_dim')} is not hidden_size / num_attention_heads: ppctl's gpt cannot "
             f"express it")
    _require(hf.get("partial_rotary_factor", 1.0) == 1.0, "its rotary covers part of each head "
                                                           "(partial_rotary_factor): ppctl's covers the whole head")
    key, rope = rope_of(hf, STARCODER2_DEFAULT_THETA)
    _require(rope["rope_type"] == "default",
             f"its {key} gives rope_type={rope['rope_type']!r}: ppctl's gpt has the plain rotary embedding "
             f"('default') only")
    # As many key/value heads as heads is ppctl's unset model.num_kv_heads: the key is given for fewer only.
    grouped = {"num_kv_heads": kv_heads} if kv_heads != heads else {}
    return {"family": "gpt", "position_embedding": "rope", "activation": activation,
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hidden, "num_heads": heads, **grouped, "ffn_hidden_size": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_seq_length": hf["max_position_embeddings"],
            "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_epsilon": hf["norm_epsilon"],
            "rope_theta": float(rope["rope_theta"]),
            "qkv_bias": bool(hf["use_bias"])}


def _check_window(window: int | None, longest: int) -> None:
    """``HFError`` unless StarCoder2's ``sliding_window`` (transformers' mask: a query sees the keys fewer than
    ``window`` positions back) hides nothing from sequences of up to ``max_position_embeddings`` positions (the run's
    ``model.max_seq_length``: no training or generated sequence is longer)."""
    _require(window is None or window >= longest,
             f"its sliding_window={window} is shorter than its max_position_embeddings={longest} "
             f"(model.max_seq_length, the run's longest sequence): the window hides keys {window} or more positions back, and ppctl's gpt "
             f"attends over the whole sequence (a window of at least {longest}, or null, computes the same)")


def _gpt2_tensors(model) -> dict[str, HFTensor]:
    """ppctl name -> GPT-2 tensor: renames, the Conv1D weights transposed (``c_attn.bias`` with ``qkv_bias``)."""
    tensors = {"embedding.word.weight": HFTensor(("transformer.wte.weight",)),
               "embedding.position.weight": HFTensor(("transformer.wpe.weight",))}
    for layer in range(model.num_layers):
        ppctl, hf = f"layers.{layer}", f"transformer.h.{layer}"
        for role, name, transpose in (("attn_norm.weight", "ln_1.weight", False),
                                      ("attn_norm.bias", "ln_1.bias", False),
                                      ("attention.qkv.weight", "attn.c_attn.weight", True),
                                      ("attention.proj.weight", "attn.c_proj.weight", True),
                                      ("attention.proj.bias", "attn.c_proj.bias", False),
                                      ("mlp_norm.weight", "ln_2.weight", False), ("mlp_norm.bias", "ln_2.bias", False),
                                      ("mlp.fc_in.weight", "mlp.c_fc.weight", True),
                                      ("mlp.fc_in.bias", "mlp.c_fc.bias", False),
                                      ("mlp.fc_out.weight", "mlp.c_proj.weight", True),
                                      ("mlp.fc_out.bias", "mlp.c_proj.bias", False)):
            tensors[f"{ppctl}.{role}"] = HFTensor((f"{hf}.{name}",), transpose)
        if model.qkv_bias:
            tensors[f"{ppctl}.attention.qkv.bias"] = HFTensor((f"{hf}.attn.c_attn.bias",))
    tensors["final_norm.weight"] = HFTensor(("transformer.ln_f.weight",))
    tensors["final_norm.bias"] = HFTensor(("transformer.ln_f.bias",))
    if not model.tie_embeddings:
        tensors["output_layer.weight"] = HFTensor(("lm_head.weight",))
    return tensors


def _starcoder2_tensors(model, use_bias: bool) -> dict[str, HFTensor]:
    """ppctl name -> StarCoder2 tensor: renames, the fused QKV (and its bias) split into q, k and v, or under
    grouped-query attention q, k and v one to one (biases absent without ``use_bias``: ppctl's are zero)."""
    tensors = {"embedding.word.weight": HFTensor(("model.embed_tokens.weight",))}
    for layer in range(model.num_layers):
        ppctl, hf = f"layers.{layer}", f"model.layers.{layer}"
        for kind in ("weight", "bias") if model.qkv_bias else ("weight",):
            tensors.update(_starcoder2_qkv(model, f"{ppctl}.attention", f"{hf}.self_attn", kind))
        for role, name in (("attn_norm.weight", "input_layernorm.weight"), ("attn_norm.bias", "input_layernorm.bias"),
                           ("attention.proj.weight", "self_attn.o_proj.weight"),
                           ("mlp_norm.weight", "post_attention_layernorm.weight"),
                           ("mlp_norm.bias", "post_attention_layernorm.bias"),
                           ("mlp.fc_in.weight", "mlp.c_fc.weight"), ("mlp.fc_out.weight", "mlp.c_proj.weight")):
            tensors[f"{ppctl}.{role}"] = HFTensor((f"{hf}.{name}",))
        for role, name in (("attention.proj.bias", "self_attn.o_proj.bias"), ("mlp.fc_in.bias", "mlp.c_fc.bias"),
                           ("mlp.fc_out.bias", "mlp.c_proj.bias")):
            tensors[f"{ppctl}.{role}"] = HFTensor((f"{hf}.{name}",) if use_bias else ())
    tensors["final_norm.weight"] = HFTensor(("model.norm.weight",))
    tensors["final_norm.bias"] = HFTensor(("model.norm.bias",))
    if not model.tie_embeddings:
        tensors["output_layer.weight"] = HFTensor(("lm_head.weight",))
    return tensors


def _starcoder2_qkv(model, ppctl: str, hf: str, kind: str) -> dict[str, HFTensor]:
    """ppctl's attention ``kind`` (weight or bias) tensors -> StarCoder2's q/k/v ones: split from the fused QKV,
    or one to one under grouped-query attention."""
    if _grouped(model):
        return {f"{ppctl}.{role}.{kind}": HFTensor((f"{hf}.{part}_proj.{kind}",))
                for role, part in (("query", "q"), ("key", "k"), ("value", "v"))}
    return {f"{ppctl}.qkv.{kind}": HFTensor(tuple(f"{hf}.{part}_proj.{kind}" for part in ("q", "k", "v")))}


FORMAT = GPTHuggingFace()
