"""The Llama family in Hugging Face format: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` for q/k/v biases and
``MixtralForCausalLM`` for experts, both ways.

ppctl's Llama layers carry Hugging Face's names (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``...) under ``layers.<i>.``, so the mapping is a rename: ``embed_tokens`` is
``embedding.word``, ``norm`` is ``final_norm``, ``lm_head`` is ``output_layer``; every weight is
``nn.Linear``'s ``[out, in]`` on both sides. Both compute RMSNorm in float32, SwiGLU with SiLU and
rotate-half rotary over the whole head (``rope_type`` ``default``, or the ``llama3``, ``linear`` or ``yarn``
frequency scaling, YaRN's attention factor on cos and sin; each read as transformers' ``modeling_rope_utils`` reads
it, ``partial_rotary_factor`` other than 1 refused).
Refused, as not computed by ppctl: an activation other than SiLU (``silu``, or ``swish``, transformers' other
name for it), biases on the MLP (``mlp_bias``; Llama's ``attention_bias``, on q, k, v and ``o_proj``, is read as
``model.qkv_bias`` and ``model.attention_output_bias``), other rotary types
(read where transformers reads them: ``hf_format.rope_of``, an older ``rope_scaling`` replacing
``rope_parameters``), a sliding window. ``config.json`` is read by ``model_type``, each key type-checked as
transformers' strict fields check it, and a size of 0 (``head_dim``, ``num_key_value_heads``) is refused: transformers
reads it as 0, not as unset.

Mixtral (a model with ``model.moe``): each layer's MLP is ``block_sparse_moe``, as the hub's files and
``save_pretrained`` store it (``from_pretrained`` fuses the experts itself): ``gate`` is ``mlp.router``, and
expert j's ``w1``, ``w3``, ``w2`` are slice j of the stacked ``mlp.experts.gate_proj``, ``up_proj``,
``down_proj``. Its router is ppctl's softmax router renormalised over the top-k (``router_topk_norm``; with
top-1 the weight is 1), every layer routed, dropless. Refused both ways, as Mixtral does not compute them:
shared experts, a sigmoid router, ``router_topk_norm=false``, the expert bias, dense layers
(``layer_freq``, ``first_dense_layers``), a capacity, q/k/v biases. Checked against ``transformers`` in
``tests/unit/test_hf_llama.py`` and ``tests/unit/test_hf_mixtral.py``. Pure: names and numbers only.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys, rope_of
from ppctl.model.llama.heads import head_dim_of, kv_heads_of
from ppctl.model.moe.shape import MoEShape, moe_shape_of

LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
MIXTRAL = "MixtralForCausalLM"
# Mixtral's expert weights, by ppctl's role: w1 (gate), w3 (up), w2 (down).
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# transformers' defaults for the keys a config.json may leave out (LlamaConfig, Qwen2Config, MixtralConfig).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "rope_theta": 10000.0,
                  "rope_scaling": None}
QWEN2_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "use_sliding_window": False}
MIXTRAL_DEFAULTS = {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                    "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                    "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2}
# The JSON types transformers' LlamaConfig, Qwen2Config and MixtralConfig take for the keys ppctl reads
# (``check_keys``), and the sizes that must be above 0.
INT, FLOAT, BOOL, STR, NONE = int, float, bool, str, type(None)
LLAMA_TYPES = {"vocab_size": (INT,), "hidden_size": (INT,), "intermediate_size": (INT,), "num_hidden_layers": (INT,),
               "num_attention_heads": (INT,), "num_key_value_heads": (INT, NONE), "head_dim": (INT, NONE),
               "hidden_act": (STR,), "max_position_embeddings": (INT,), "rms_norm_eps": (FLOAT,),
               "tie_word_embeddings": (BOOL,), "attention_bias": (BOOL,), "mlp_bias": (BOOL,),
               "pretraining_tp": (INT, NONE), "use_sliding_window": (BOOL,), "sliding_window": (INT, NONE)}
MIXTRAL_TYPES = {**LLAMA_TYPES, "num_key_value_heads": (INT,), "num_local_experts": (INT,),
                 "num_experts_per_tok": (INT,)}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "num_local_experts", "num_experts_per_tok")
SILU = ("silu", "swish")  # transformers' ACT2FN names of SiLU (tests/unit/test_hf_folder_inputs.py)
# Llama 3's rotary scaling keys (original_max_position_embeddings defaults to max_position_embeddings).
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
# The model.moe settings of every Mixtral (what else ppctl's mixture can be, Mixtral does not compute), and why.
MIXTRAL_MOE = {"layer_freq": (1, "every layer of a Mixtral routes"),
               "first_dense_layers": (0, "every layer of a Mixtral routes"),
               "shared_experts": (0, "Mixtral has no shared experts"),
               "router_score": ("softmax", "Mixtral's router scores by a softmax over the experts"),
               "router_topk_norm": (True, "Mixtral divides each token's top-k weights by their sum (with top-1: 1)"),
               "expert_bias": (False, "Mixtral's top-k choice has no expert bias"),
               "capacity_factor": (None, "Mixtral drops no tokens")}


class LlamaHuggingFace:
    """The Llama family's HF format (see ``ppctl.model.hf_format``)."""

    architectures = (LLAMA, QWEN2, MIXTRAL)
    model_types = {"llama": LLAMA, "qwen2": QWEN2, "mixtral": MIXTRAL}  # config.json's model_type -> what it builds
    base_model_prefixes = {LLAMA: "model", QWEN2: "model", MIXTRAL: "model"}  # transformers' base_model_prefix
    word_embeddings = {LLAMA: "model.embed_tokens.weight", QWEN2: "model.embed_tokens.weight",
                       MIXTRAL: "model.embed_tokens.weight"}
    moe_architecture = MIXTRAL  # what a model with experts is written as

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Llama model (a ``LlamaConfig``): Llama's (with ``attention_bias`` when it has q/k/v
        and output biases), Qwen2's when it has q/k/v biases alone, Mixtral's when it has experts (``HFError`` for a
        mixture Mixtral does not compute, or an output bias without q/k/v biases)."""
        config, output_bias = llama_config(model), model.attention_output_bias
        if model.moe is not None:
            return _mixtral_config(model, config)
        _require(model.qkv_bias or not output_bias, "model.attention_output_bias=true without model.qkv_bias: "
                                                    "Llama's attention_bias puts biases on q, k, v and o_proj together "
                                                    "(set model.qkv_bias=true too)")
        if model.qkv_bias and not output_bias:
            return {"architectures": [QWEN2], "model_type": "qwen2", **config, "use_sliding_window": False}
        return {"architectures": [LLAMA], "model_type": "llama", **config, "attention_bias": output_bias,
                "mlp_bias": False, "pretraining_tp": 1}

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Llama, Qwen2 or Mixtral ``config.json`` (Mixtral's mixture as dotted
        ``moe.*`` keys; the others' ``moe.num_experts=0``); ``HFError`` for what ppctl cannot compute."""
        architecture = architecture_of(hf_config)
        if architecture not in self.architectures:
            raise HFError(f"its {architecture} is no architecture model.family=llama reads "
                          f"({', '.join(self.architectures)})")
        qwen2, mixtral = architecture == QWEN2, architecture == MIXTRAL
        defaults = QWEN2_DEFAULTS if qwen2 else MIXTRAL_DEFAULTS if mixtral else LLAMA_DEFAULTS
        hf = {**defaults, **hf_config}
        check_keys(hf, MIXTRAL_TYPES if mixtral else LLAMA_TYPES, SIZES)
        _check_computable(hf, qwen2, mixtral)
        biases = qwen2 or (architecture == LLAMA and hf["attention_bias"])  # Llama's: on q, k, v and o_proj
        shape = {**llama_shape(hf, "llama"), "qkv_bias": biases,
                 "attention_output_bias": architecture == LLAMA and hf["attention_bias"]}
        if mixtral:  # every layer routes: its intermediate_size is the experts' (model.ffn_hidden_size by default)
            del shape["ffn_hidden_size"]
        return {**shape, **(_mixtral_moe(hf) if mixtral else {"moe.num_experts": 0})}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Every ppctl Llama parameter (a tied output layer is the word embedding) -> its HF tensor: renames, and
        each MoE layer's experts one HF tensor per expert (Mixtral's)."""
        tensors = {"embedding.word.weight": HFTensor(("model.embed_tokens.weight",)),
                   "final_norm.weight": HFTensor(("model.norm.weight",))}
        around = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                  *(["self_attn.o_proj.bias"] if model.attention_output_bias else [])]
        qkv = [f"self_attn.{part}_proj.{kind}" for part in "qkv"
               for kind in (("weight", "bias") if model.qkv_bias else ("weight",))]
        moe = _moe_of(model)
        for layer in range(model.num_layers):
            # In this order (a dense export's shards, hence its bytes, follow it): norms and o_proj, MLP, q/k/v.
            tensors.update({f"layers.{layer}.{role}": HFTensor((f"model.layers.{layer}.{role}",)) for role in around})
            routed = moe is not None and moe.is_moe_layer(layer)
            tensors.update(_mixtral_mlp(layer, moe.num_experts) if routed else _dense_mlp(layer))
            tensors.update({f"layers.{layer}.{role}": HFTensor((f"model.layers.{layer}.{role}",)) for role in qkv})
        if not model.tie_embeddings:
            tensors["output_layer.weight"] = HFTensor(("lm_head.weight",))
        return tensors

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """The dense shape of every ppctl Llama parameter (``model``: its settings by name; the vocabulary
        unpadded): grouped-query q/k/v of ``head_dim`` wide heads, stacked experts ``[experts, out, in]``."""
        hidden, vocab, moe = model.hidden_size, model.vocab_size, _moe_of(model)
        queries, keys = model.num_heads * head_dim_of(model), kv_heads_of(model) * head_dim_of(model)
        shapes = {"embedding.word.weight": (vocab, hidden), "final_norm.weight": (hidden,),
                  "output_layer.weight": (vocab, hidden)}
        for layer in range(model.num_layers):
            roles = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                     "self_attn.o_proj.weight": (hidden, queries), "self_attn.o_proj.bias": (hidden,),
                     "self_attn.q_proj.weight": (queries, hidden),
                     "self_attn.q_proj.bias": (queries,), "self_attn.k_proj.weight": (keys, hidden),
                     "self_attn.k_proj.bias": (keys,), "self_attn.v_proj.weight": (keys, hidden),
                     "self_attn.v_proj.bias": (keys,)}
            if moe is not None and moe.is_moe_layer(layer):
                experts, width = moe.num_experts, moe.expert_ffn_hidden_size
                roles.update({"mlp.router.weight": (experts, hidden),
                              "mlp.experts.gate_proj.weight": (experts, width, hidden),
                              "mlp.experts.up_proj.weight": (experts, width, hidden),
                              "mlp.experts.down_proj.weight": (experts, hidden, width)})
            else:
                ffn = model.ffn_hidden_size
                roles.update({"mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
                              "mlp.down_proj.weight": (hidden, ffn)})
            shapes.update({f"layers.{layer}.{role}": shape for role, shape in roles.items()})
        return shapes

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """No tensor HF has and ppctl's Llama lacks: biases it does not compute are refused by ``shape_from_hf``."""
        return {}


def llama_config(model) -> dict[str, Any]:
    """The ``config.json`` keys every Llama-shaped architecture writes alike (``model``: a ``LlamaConfig``, or the
    ``model.*`` settings by name): the sizes, SiLU, RMSNorm's epsilon, the embeddings' tie and the rotary
    parameters."""
    return {"vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
            "head_dim": model.head_dim, "hidden_act": "silu", "max_position_embeddings": model.max_seq_length,
            "rms_norm_eps": model.norm_epsilon, "initializer_range": model.init_std,
            "tie_word_embeddings": model.tie_embeddings, "rope_theta": float(model.rope_theta),
            "rope_parameters": _rope_parameters(model), "attention_dropout": 0.0, "use_cache": True}


def llama_shape(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ``model.*`` settings every Llama-shaped ``config.json`` gives alike (``hf``: its keys over its
    architecture's defaults, type-checked), as model family ``family``: the sizes, the head width where it is not
    ``hidden_size / num_heads``, RMSNorm's epsilon, the embeddings' tie and the rotary settings (``_rope_settings``)."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    shape = {"family": family, "position_embedding": "rope", "num_layers": hf["num_hidden_layers"],
             "hidden_size": hf["hidden_size"], "num_heads": heads,
             "num_kv_heads": heads if kv_heads is None else kv_heads, "ffn_hidden_size": hf["intermediate_size"],
             "vocab_size": hf["vocab_size"], "max_seq_length": hf["max_position_embeddings"],
             "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_epsilon": hf["rms_norm_eps"]}
    head_dim = hf["hidden_size"] // heads if hf.get("head_dim") is None else hf["head_dim"]
    if head_dim != hf["hidden_size"] // heads or hf["hidden_size"] % heads:
        shape["head_dim"] = head_dim
    return {**shape, **_rope_settings(hf)}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


def _moe_of(model) -> MoEShape | None:
    """The mixture of ``model`` (a ``LlamaConfig``, its ``moe`` resolved, or a ``ModelConfig``); None: dense."""
    moe = getattr(model, "moe", None)
    return moe if moe is None or isinstance(moe, MoEShape) else moe_shape_of(model)


def _dense_mlp(layer: int) -> dict[str, HFTensor]:
    """A dense layer's MLP: renames."""
    return {f"layers.{layer}.mlp.{part}.weight": HFTensor((f"model.layers.{layer}.mlp.{part}.weight",))
            for part in ("gate_proj", "up_proj", "down_proj")}


def _mixtral_mlp(layer: int, num_experts: int) -> dict[str, HFTensor]:
    """An MoE layer's MLP as Mixtral stores it: the router is ``gate``; each stacked expert weight is one tensor per
    expert, in expert order."""
    moe = f"model.layers.{layer}.block_sparse_moe"
    tensors = {f"layers.{layer}.mlp.router.weight": HFTensor((f"{moe}.gate.weight",))}
    for part, mixtral in MIXTRAL_EXPERTS.items():
        names = tuple(f"{moe}.experts.{expert}.{mixtral}.weight" for expert in range(num_experts))
        tensors[f"layers.{layer}.mlp.experts.{part}.weight"] = HFTensor(names, stacked=True)
    return tensors


def _mixtral_config(model, config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a Llama model with experts (a ``MixtralConfig``); ``HFError`` naming the first setting of
    its mixture Mixtral does not compute."""
    moe = model.moe
    for key, (mixtral, reason) in MIXTRAL_MOE.items():
        _require(getattr(moe, key) == mixtral, f"model.moe.{key}={getattr(moe, key)}: {MIXTRAL} cannot express it "
                                               f"({reason}: model.moe.{key}={mixtral})")
    _require(not model.qkv_bias, f"model.qkv_bias=true: {MIXTRAL} has no q/k/v biases")
    _require(not model.attention_output_bias, f"model.attention_output_bias=true: {MIXTRAL} has no output bias")
    return {"architectures": [MIXTRAL], "model_type": "mixtral", **config,
            "intermediate_size": moe.expert_ffn_hidden_size, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.topk, "router_aux_loss_coef": moe.aux_loss_coeff,
            "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}


def _mixtral_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.moe`` settings of a Mixtral ``config.json`` (dotted keys); its FFN width is the experts'."""
    return {"moe.num_experts": hf["num_local_experts"], "moe.topk": hf["num_experts_per_tok"],
            "moe.expert_ffn_hidden_size": hf["intermediate_size"],
            **{f"moe.{key}": value for key, (value, _reason) in MIXTRAL_MOE.items()}}


def _check_computable(hf: dict[str, Any], qwen2: bool, mixtral: bool) -> None:
    """``HFError`` for what ppctl's Llama layers do not compute."""
    _require(hf["hidden_act"] in SILU, f"its hidden_act={hf['hidden_act']!r}: ppctl's llama computes SwiGLU with "
                                       f"SiLU only ({', '.join(SILU)})")
    _require(not (mixtral and hf["attention_bias"]), "its attention_bias=true: ppctl's llama reads Llama's "
                                                     "attention_bias only (not a Mixtral's)")
    _require(not hf.get("mlp_bias", False), "its mlp_bias=true: ppctl's llama MLP has no biases")
    _require(hf.get("pretraining_tp", 1) == 1, f"its pretraining_tp={hf.get('pretraining_tp')}: ppctl computes "
                                               f"the unsplit model only")
    _require(not hf.get("use_sliding_window", False), "its use_sliding_window=true: ppctl attends to the whole "
                                                      "sequence")
    # Mixtral's window applies whenever set (Qwen2's only with use_sliding_window): none, or one no sequence passes.
    window = hf.get("sliding_window") if mixtral else None
    _require(window is None or window >= hf["max_position_embeddings"],
             f"its sliding_window={window} is shorter than its max_position_embeddings="
             f"{hf['max_position_embeddings']}: ppctl attends to the whole sequence")


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.rope_*`` settings of a config's rotary parameters, read where transformers reads them
    (``rope_of``: ``rope_parameters``, or an older ``rope_scaling`` over it, ``rope_theta`` beside them; ``hf``
    holds the architecture's default ``rope_theta``): the plain rotary embedding, or Llama 3's, linear or YaRN
    scaling (``ROPE_SCALING_READERS``) over the whole head."""
    key, rope = rope_of(hf, LLAMA_DEFAULTS["rope_theta"])  # hf holds its architecture's own rope_theta default
    kind, theta = rope["rope_type"], float(rope["rope_theta"])
    if kind == "default":  # Llama's plain rotary embedding reads no partial_rotary_factor
        return {"rope_theta": theta}
    _require(kind in ROPE_SCALING_READERS, f"its {key} gives rope_type={kind!r}: ppctl computes the plain rotary "
                                           f"embedding ('default') and the {', '.join(map(repr, ROPE_SCALING_READERS))}"
                                           f" scalings only")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _require(partial == 1, f"its {key} ({kind}) has partial_rotary_factor={partial}: ppctl's llama rotates the whole "
                           f"head (1.0) only")
    return {"rope_theta": theta, "rope_scaling_type": kind, **ROPE_SCALING_READERS[kind](key, rope, hf)}


def _number(key: str, rope: dict[str, Any], name: str, default: Any = None) -> float | None:
    """Rotary parameter ``name`` as a float (``default`` when it is absent or null); ``HFError`` for another type."""
    value = rope.get(name)
    if value is None:
        return default
    _require(type(value) in (int, float) and math.isfinite(value), f"its {key}.{name}={json.dumps(value)} is not a "
                                                                   f"finite number")
    return float(value)


def _original_positions(key: str, rope: dict[str, Any], hf: dict[str, Any]) -> int:
    """``original_max_position_embeddings`` of the scaling: its own, else ``max_position_embeddings`` (as
    transformers standardises it)."""
    original = rope.get("original_max_position_embeddings", hf["max_position_embeddings"])
    _require(type(original) is int and original > 0, f"its {key}.original_max_position_embeddings={original!r} is not "
                                                     f"a positive integer")
    return original


def _llama3_settings(key: str, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Llama 3's scaling: its three factors and original context, each required."""
    missing = [name for name in LLAMA3_KEYS if type(rope.get(name)) not in (int, float)]
    _require(not missing, f"its {key} (llama3) has no number {missing[0] if missing else ''}: Llama 3's scaling needs "
                          f"{', '.join(LLAMA3_KEYS)}")
    return {"rope_scaling_factor": float(rope["factor"]), "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_position": _original_positions(key, rope, hf)}


def _linear_settings(key: str, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Linear scaling: every frequency divided by ``factor`` (required)."""
    factor = _number(key, rope, "factor")
    _require(factor is not None and factor > 0, f"its {key} (linear) has no positive factor ({rope.get('factor')!r})")
    return {"rope_scaling_factor": factor}


def _yarn_settings(key: str, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """YaRN as transformers reads it: ``factor`` (null: ``max_position_embeddings`` over the original context),
    ``beta_fast``/``beta_slow`` (absent, null or 0: 32 and 1, its ``or``), ``truncate`` (absent: true; null: false,
    as its ``if`` reads it) and the attention factor: its own, else from ``mscale`` and ``mscale_all_dim`` when both
    are non-zero, else YaRN's default (left unset)."""
    original = _original_positions(key, rope, hf)
    factor = _number(key, rope, "factor", hf["max_position_embeddings"] / original)
    _require(factor > 0, f"its {key}.factor={factor} (yarn) must be positive")
    truncate = rope.get("truncate", True)
    _require(truncate in (True, False, None), f"its {key}.truncate={json.dumps(truncate)} is not true, false or null")
    attention = _number(key, rope, "attention_factor")
    mscale, mscale_all_dim = _number(key, rope, "mscale"), _number(key, rope, "mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return {"rope_scaling_factor": factor, "rope_original_max_position": original,
            "rope_yarn_beta_fast": _number(key, rope, "beta_fast") or 32.0,
            "rope_yarn_beta_slow": _number(key, rope, "beta_slow") or 1.0,
            "rope_yarn_truncate": bool(truncate), "rope_attention_factor": attention}


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for a factor of at most 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# How each rotary scaling's parameters are read (``_rope_settings``).
ROPE_SCALING_READERS = {"llama3": _llama3_settings, "linear": _linear_settings, "yarn": _yarn_settings}


def _rope_parameters(model) -> dict[str, Any]:
    """``rope_parameters`` of a Llama model (a ``LlamaConfig``): the plain rotary embedding, or its scaling."""
    scaling, theta = model.rope_scaling, float(model.rope_theta)
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    common = {"rope_type": scaling.kind, "rope_theta": theta, "factor": float(scaling.factor)}
    if scaling.kind == "linear":
        return common
    original = int(scaling.original_max_position_embeddings)
    if scaling.kind == "yarn":
        attention = {} if scaling.attention_factor is None else {"attention_factor": float(scaling.attention_factor)}
        return {**common, "original_max_position_embeddings": original, "beta_fast": float(scaling.beta_fast),
                "beta_slow": float(scaling.beta_slow), "truncate": bool(scaling.truncate), **attention}
    return {**common, "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor), "original_max_position_embeddings": original}


FORMAT = LlamaHuggingFace()
