"""The Qwen mixtures in Hugging Face format: ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``, both ways.

Each is the Llama the Llama format reads and writes (``ppctl.model.llama.hf``: the sizes, the head width, RMSNorm's
epsilon, the tie, the rotary parameters, the attention's and the dense layers' tensor names), whose routed layers'
``mlp`` is, as the hub's files and ``save_pretrained`` store it (``from_pretrained`` fuses the experts itself):
``gate`` (ppctl's ``mlp.router``), ``experts.<j>.gate_proj``/``up_proj``/``down_proj`` (slice j of ppctl's stacked
``mlp.experts.*``) and, for Qwen2-MoE, ``shared_expert.*`` (ppctl's ``mlp.shared_experts.*``, a SwiGLU MLP of
``shared_expert_intermediate_size`` features: ``model.moe.shared_experts`` experts' width) and
``shared_expert_gate`` (``[1, hidden]``, ppctl's ``mlp.shared_expert_gate``). Qwen3-MoE adds Qwen3's per-head q/k
norms (``model.qk_norm``).

How transformers computes them (``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``): the router's softmax over the
experts (in float32 there, in ppctl's router dtype here), the top-k of it, divided by their sum with
``norm_topk_prob`` (``model.moe.router_topk_norm``), dropless; Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)``. Layer i routes when it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``:
read as ppctl's ``model.moe.layer_freq`` and ``first_dense_layers`` where they give the same layers (refused
otherwise), written back as the step and the dense layers they make. The dense layers' MLP is ``intermediate_size``
wide, the experts ``moe_intermediate_size``. The router's auxiliary loss (``router_aux_loss_coef``) is a training
choice (``model.moe.aux_loss_coeff``), not read; it is written. Refused, as not computed: a windowed layer
(Qwen2-MoE's ``layer_types`` or ``use_sliding_window``; Qwen3-MoE's ``use_sliding_window`` windows every layer), an
activation other than SiLU, Qwen3-MoE's ``attention_bias`` (the output projection's too), a shared expert whose
width is no multiple of the experts'; and on export what neither expresses (a sigmoid router, the expert bias, a
capacity, Qwen2-MoE without its gated shared expert, Qwen3-MoE with shared experts or q/k/v biases). Checked against
``transformers`` in ``tests/unit/test_hf_qwen_moe.py``. Pure: names and numbers only.
"""

from __future__ import annotations

from typing import Any

from ppctl.model.hf_format import HFError, HFTensor, architecture_of, check_keys
from ppctl.model.llama.heads import head_dim_of
from ppctl.model.llama.hf import FORMAT as LLAMA_FORMAT
from ppctl.model.llama.hf import FLOAT, INT, LLAMA_DEFAULTS, LLAMA_TYPES, NONE, SIZES, llama_config, llama_shape
from ppctl.model.moe.shape import MoEShape, moe_shape_of
from ppctl.model.qwen3.hf import FULL_ATTENTION, check_qwen_attention, qk_norm_shapes, qk_norm_tensors

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # the same names for ppctl's stacked experts and the hub's
# transformers' Qwen2MoeConfig and Qwen3MoeConfig defaults for the keys a config.json may leave out (neither has a
# head_dim field: one in config.json is read, else hidden_size / num_heads).
MOE_DEFAULTS = {**{key: value for key, value in LLAMA_DEFAULTS.items() if key != "head_dim"},
                "vocab_size": 151936, "max_position_embeddings": 32768, "use_sliding_window": False,
                "sliding_window": 4096, "decoder_sparse_step": 1, "norm_topk_prob": False,
                "router_aux_loss_coef": 0.001, "mlp_only_layers": None}
QWEN2_MOE_DEFAULTS = {**MOE_DEFAULTS, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "num_key_value_heads": 16, "max_window_layers": 28,
                      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                      "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True, "layer_types": None}
QWEN3_MOE_DEFAULTS = {**MOE_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "moe_intermediate_size": 768,
                      "num_experts_per_tok": 8, "num_experts": 128, "attention_bias": False}
# The JSON types both configs take for the keys ppctl reads (``check_keys``); Llama's keys neither has (mlp_bias,
# pretraining_tp) are not read, as transformers reads none of them.
MOE_TYPES = {**{key: types for key, types in LLAMA_TYPES.items() if key not in ("mlp_bias", "pretraining_tp")},
             "head_dim": (INT,), "num_key_value_heads": (INT,), "decoder_sparse_step": (INT,),
             "moe_intermediate_size": (INT,), "shared_expert_intermediate_size": (INT,), "num_experts_per_tok": (INT,),
             "num_experts": (INT,), "num_local_experts": (INT,), "norm_topk_prob": (bool,),
             "router_aux_loss_coef": (FLOAT,), "mlp_only_layers": (list, NONE), "qkv_bias": (bool,),
             "max_window_layers": (INT,), "layer_types": (list, NONE)}
MOE_SIZES = (*SIZES, "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_local_experts",
             "decoder_sparse_step")
# The model.moe settings of every Qwen mixture (what else ppctl's mixture can be, neither computes), and why.
QWEN_MOE = {"router_score": ("softmax", "its router scores by a softmax over the experts"),
            "expert_bias": (False, "its top-k choice has no expert bias"),
            "capacity_factor": (None, "it drops no tokens")}


class QwenMoeHuggingFace:
    """The Qwen mixtures' HF format (see ``ppctl.model.hf_format``)."""

    architectures = (QWEN2_MOE, QWEN3_MOE)
    model_types = {"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}
    base_model_prefixes = {QWEN2_MOE: "model", QWEN3_MOE: "model"}
    word_embeddings = {QWEN2_MOE: "model.embed_tokens.weight", QWEN3_MOE: "model.embed_tokens.weight"}
    moe_architecture = f"{QWEN2_MOE}/{QWEN3_MOE}"  # Qwen3-MoE's with model.qk_norm, else Qwen2-MoE's

    def hf_config(self, model) -> dict[str, Any]:
        """``config.json`` of a Qwen mixture (a ``LlamaConfig`` with ``moe``): Qwen3-MoE's with q/k norms, else
        Qwen2-MoE's; ``HFError`` naming the first setting the architecture does not compute."""
        moe = _moe_of(model)
        _require(moe is not None, f"model.moe.num_experts=0: {self.moe_architecture} is a mixture of experts")
        for key, (value, reason) in QWEN_MOE.items():
            _require(getattr(moe, key) == value, f"model.moe.{key}={getattr(moe, key)}: {self.moe_architecture} cannot "
                                                 f"express it ({reason}: model.moe.{key}={value})")
        config = {**llama_config(model), "head_dim": head_dim_of(model), "num_experts_per_tok": moe.topk,
                  "moe_intermediate_size": moe.expert_ffn_hidden_size, "norm_topk_prob": moe.router_topk_norm,
                  "router_aux_loss_coef": float(moe.aux_loss_coeff), "output_router_logits": False,
                  "use_sliding_window": False, "sliding_window": None, **_sparse_layers(moe, model.num_layers)}
        return _qwen3_moe_config(model, moe, config) if model.qk_norm else _qwen2_moe_config(model, moe, config)

    def shape_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.*`` settings of a Qwen2-MoE or Qwen3-MoE ``config.json`` (its mixture as dotted ``moe.*``
        keys); ``HFError`` for what ppctl cannot compute."""
        architecture = architecture_of(hf_config)
        _require(architecture in self.architectures, f"its {architecture} is no architecture model.family=qwen_moe "
                                                     f"reads ({', '.join(self.architectures)})")
        qwen3 = architecture == QWEN3_MOE
        hf = {**(QWEN3_MOE_DEFAULTS if qwen3 else QWEN2_MOE_DEFAULTS), **hf_config}
        check_keys(hf, MOE_TYPES, MOE_SIZES)
        if qwen3 and "num_local_experts" in hf:  # Qwen3MoeConfig's own name of num_experts, read over it
            hf["num_experts"] = hf["num_local_experts"]
        windowed = _qwen3_moe_window(hf) if qwen3 else _qwen2_moe_window(hf)
        check_qwen_attention(hf, "qwen_moe", windowed, qwen3 and hf["attention_bias"])  # Qwen2-MoE has no such key
        shape = {**llama_shape(hf, "qwen_moe"), "qkv_bias": not qwen3 and hf["qkv_bias"], "qk_norm": qwen3}
        return {**shape, **_moe_settings(hf, qwen3)}

    def tensors(self, model, hf_config: dict[str, Any]) -> dict[str, HFTensor]:
        """Llama's tensors with each routed layer's MLP named as Qwen's, and Qwen3-MoE's q/k norms."""
        tensors = LLAMA_FORMAT.tensors(model, hf_config)  # a routed layer's router and experts: renamed below
        moe = _moe_of(model)
        for layer in moe.layer_ids(model.num_layers):
            tensors.update(_routed_mlp(layer, moe))
        return {**tensors, **(qk_norm_tensors(model.num_layers) if model.qk_norm else {})}

    def dense_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """Llama's dense shapes, each routed layer's shared experts and gate, and the q/k norms."""
        shapes = LLAMA_FORMAT.dense_shapes(model)
        moe, hidden = _moe_of(model), model.hidden_size
        width = moe.shared_ffn_hidden_size
        for layer in moe.layer_ids(model.num_layers) if moe.shared_experts else ():
            shared = f"layers.{layer}.mlp.shared_experts"
            shapes.update({f"{shared}.gate_proj.weight": (width, hidden), f"{shared}.up_proj.weight": (width, hidden),
                           f"{shared}.down_proj.weight": (hidden, width),
                           f"layers.{layer}.mlp.shared_expert_gate.weight": (1, hidden)})
        return {**shapes, **qk_norm_shapes(model)}

    def zero_tensors(self, model, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """None: what a Qwen mixture holds and ppctl's lacks is refused by ``shape_from_hf``."""
        return {}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HFError(message)


def _moe_of(model) -> MoEShape | None:
    """The mixture of ``model`` (a ``LlamaConfig``, its ``moe`` resolved, or the ``model.*`` settings)."""
    moe = getattr(model, "moe", None)
    return moe if moe is None or isinstance(moe, MoEShape) else moe_shape_of(model)


def _routed_mlp(layer: int, moe: MoEShape) -> dict[str, HFTensor]:
    """A routed layer's MLP as the hub stores it: the router ``gate``, one tensor per expert and part, and with shared
    experts Qwen2-MoE's ``shared_expert`` and its ``shared_expert_gate``."""
    ours, theirs = f"layers.{layer}.mlp", f"model.layers.{layer}.mlp"
    tensors = {f"{ours}.router.weight": HFTensor((f"{theirs}.gate.weight",))}
    for part in EXPERT_PARTS:
        names = tuple(f"{theirs}.experts.{expert}.{part}.weight" for expert in range(moe.num_experts))
        tensors[f"{ours}.experts.{part}.weight"] = HFTensor(names, stacked=True)
    if moe.shared_experts:
        tensors.update({f"{ours}.shared_experts.{part}.weight": HFTensor((f"{theirs}.shared_expert.{part}.weight",))
                        for part in EXPERT_PARTS})
        tensors[f"{ours}.shared_expert_gate.weight"] = HFTensor((f"{theirs}.shared_expert_gate.weight",))
    return tensors


# --- which layers route ----------------------------------------------------------------------------------------

def hf_routed_layers(num_layers: int, step: int, mlp_only_layers, num_experts: int) -> tuple[int, ...]:
    """The layers transformers builds a sparse MoE block for: not in ``mlp_only_layers``, ``(i + 1) % step == 0``."""
    if num_experts < 1:
        return ()
    return tuple(layer for layer in range(num_layers) if layer not in mlp_only_layers and (layer + 1) % step == 0)


def _layer_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """``moe.layer_freq`` and ``moe.first_dense_layers`` routing the layers the config routes; ``HFError`` where no
    pair does (every ``layer_freq``-th layer from the first routed one)."""
    num_layers, step, dense = hf["num_hidden_layers"], hf["decoder_sparse_step"], hf["mlp_only_layers"] or []
    routed = hf_routed_layers(num_layers, step, dense, hf["num_experts"])
    _require(bool(routed), f"its decoder_sparse_step={step} and mlp_only_layers={dense} route no layer: a dense "
                           f"Qwen is read as Qwen2 or Qwen3")
    first = routed[0]
    frequency = routed[1] - routed[0] if len(routed) > 1 else 1
    ours = MoEShape(num_experts=1, topk=1, expert_ffn_hidden_size=1, layer_freq=frequency, first_dense_layers=first)
    _require(ours.layer_ids(num_layers) == routed,
             f"its decoder_sparse_step={step} and mlp_only_layers={dense} route layers {list(routed)}, which no "
             f"model.moe.layer_freq and model.moe.first_dense_layers give (every layer_freq-th layer from the first "
             f"routed one)")
    return {"moe.layer_freq": frequency, "moe.first_dense_layers": first}


def _sparse_layers(moe: MoEShape, num_layers: int) -> dict[str, Any]:
    """``decoder_sparse_step`` and ``mlp_only_layers`` routing ppctl's MoE layers: the step is ``layer_freq`` where its
    multiples line up with the first routed layer (else 1), and the layers it would route beside them are dense."""
    step = moe.layer_freq if (moe.first_dense_layers + 1) % moe.layer_freq == 0 else 1
    routed = moe.layer_ids(num_layers)
    dense = [layer for layer in hf_routed_layers(num_layers, step, [], moe.num_experts) if layer not in routed]
    return {"decoder_sparse_step": step, "mlp_only_layers": dense}


# --- reading ---------------------------------------------------------------------------------------------------

def _moe_settings(hf: dict[str, Any], qwen3: bool) -> dict[str, Any]:
    """The ``model.moe`` settings of a Qwen mixture's ``config.json`` (dotted keys)."""
    width = hf["moe_intermediate_size"]
    shared = 0
    if not qwen3:  # Qwen2-MoE's shared expert, a whole number of experts wide
        shared, rest = divmod(hf["shared_expert_intermediate_size"], width)
        _require(not rest, f"its shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} is no "
                           f"multiple of its moe_intermediate_size={width}: ppctl's shared experts are "
                           f"model.moe.shared_experts experts of the experts' width")
    return {"moe.num_experts": hf["num_experts"], "moe.topk": hf["num_experts_per_tok"],
            "moe.expert_ffn_hidden_size": width, "moe.router_topk_norm": hf["norm_topk_prob"],
            "moe.shared_experts": shared, "moe.shared_expert_gate": not qwen3, **_layer_settings(hf),
            **{f"moe.{key}": value for key, (value, _reason) in QWEN_MOE.items()}}


def _qwen2_moe_window(hf: dict[str, Any]) -> str:
    """What windows a layer of a Qwen2-MoE ('' for none): a ``layer_types`` entry other than ``full_attention``, or,
    without ``layer_types``, ``use_sliding_window`` (every other layer below ``max_window_layers``)."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        other = next(((index, kind) for index, kind in enumerate(layer_types) if kind != FULL_ATTENTION), None)
        return "" if other is None else f"layer_types[{other[0]}]={other[1]!r}"
    windowed = hf.get("use_sliding_window") and hf.get("max_window_layers", 0) > 0
    return f"use_sliding_window=true (below max_window_layers={hf.get('max_window_layers')})" if windowed else ""


def _qwen3_moe_window(hf: dict[str, Any]) -> str:
    """What windows a Qwen3-MoE ('' for none): ``use_sliding_window`` with a window windows every layer."""
    windowed = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
    return f"use_sliding_window=true (sliding_window={hf.get('sliding_window')} on every layer)" if windowed else ""


# --- writing ---------------------------------------------------------------------------------------------------

def _qwen2_moe_config(model, moe: MoEShape, config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a Qwen2-MoE: its gated shared expert, q/k/v biases or none."""
    _require(moe.shared_experts >= 1 and moe.shared_expert_gate,
             f"model.moe.shared_experts={moe.shared_experts} and model.moe.shared_expert_gate="
             f"{moe.shared_expert_gate}: {QWEN2_MOE} has one shared expert with its sigmoid gate (set both, or "
             f"model.qk_norm=true for {QWEN3_MOE})")
    return {"architectures": [QWEN2_MOE], "model_type": "qwen2_moe", **config, "num_experts": moe.num_experts,
            "shared_expert_intermediate_size": moe.shared_ffn_hidden_size, "qkv_bias": model.qkv_bias,
            "max_window_layers": model.num_layers, "layer_types": [FULL_ATTENTION] * model.num_layers}


def _qwen3_moe_config(model, moe: MoEShape, config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a Qwen3-MoE: no shared expert, no biases."""
    _require(not moe.shared_experts, f"model.moe.shared_experts={moe.shared_experts}: {QWEN3_MOE} has no shared "
                                     f"experts (model.qk_norm=false writes {QWEN2_MOE}, which has one)")
    _require(not model.qkv_bias, f"model.qkv_bias=true: {QWEN3_MOE} has no q/k/v biases alone (its attention_bias "
                                 f"puts one on the output projection too)")
    return {"architectures": [QWEN3_MOE], "model_type": "qwen3_moe", **config, "num_experts": moe.num_experts,
            "attention_bias": False}


FORMAT = QwenMoeHuggingFace()
