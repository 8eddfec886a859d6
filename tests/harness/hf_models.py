"""Tiny random ``transformers`` models for the Hugging Face tests, made locally (no hub), and what to compare them by.

``save_tiny(folder, architecture, tie, activation=..., rope_scaling=...)`` writes a GPT-2 or StarCoder2 (every
bias random, the QKV biases included, as in real checkpoints; the exact ``gelu`` unless ``activation`` names
another transformers activation), Llama, Qwen2 or Mixtral (grouped-query attention, 4 query heads on 2 key/value
heads; Qwen2's q/k/v biases drawn; optionally Llama 3's rotary scaling; Mixtral's ``EXPERTS`` experts, top-``TOPK``)
model of the shape ``OVERRIDES`` gives ppctl, its weights drawn wide enough that a wrong mapping moves the logits by
far more than rounding; ``overrides(folder, architecture, tie)`` is the ppctl config that starts from it with every
model key written out (``model.qkv_bias=true`` for GPT-2 and StarCoder2: both have the bias), and
``folder_overrides(folder)`` the one that names the folder alone. ``hf_model`` loads one in float64 with what
transformers computes in float32 whatever the model's dtype computed in float64 too: the rotary angles (alone
~1e-8 in the logits), Llama's RMSNorm and Mixtral's router softmax (its experts in transformers' plain loop: its
grouped kernels take no float64).
"""

from __future__ import annotations

from pathlib import Path

import torch

GPT2, STARCODER2, LLAMA, QWEN2, MIXTRAL = "gpt2", "starcoder2", "llama", "qwen2", "mixtral"
# StarCoder2 with grouped key/value heads (model.family=gpt) and GPT-NeoX (its own family, on GPT's layers: a parallel
# residual, rotary over NEOX_ROTARY of each head); tests/unit/test_hf_gpt_gqa_neox.py.
STARCODER2_GQA, GPT_NEOX = "starcoder2_gqa", "gpt_neox"
NEOX_ROTARY = 0.5  # 4 of a head's 8 dims: two frequencies, so the rotary base's exponent over 4 (not 8) is checked
MISTRAL, PHI3 = "mistral", "phi3"  # Llama's math, each its own family (tests/unit/test_hf_mistral_phi3.py)
# Qwen3 and the Qwen mixtures, each its own family (tests/unit/test_hf_qwen3.py, test_hf_qwen_moe.py): Qwen's head
# width (not hidden / heads), its experts' and its shared expert's (two experts' worth) widths.
QWEN3, QWEN2_MOE, QWEN3_MOE = "qwen3", "qwen2_moe", "qwen3_moe"
QWEN_HEAD_DIM, QWEN_EXPERT_FFN, QWEN_SHARED_FFN = 16, 24, 48
GEMMA, OLMO2 = "gemma", "olmo2"  # Llama-shaped, each its own family (tests/unit/test_hf_gemma.py, test_hf_olmo2.py)
GEMMA_HEAD_DIM = 16  # Gemma's head width, not hidden / heads (8): as real Gemmas (256 beside 3072 / 16)
# Qwen3 and the Qwen mixtures, each its own family (tests/unit/test_hf_qwen3.py, test_hf_qwen_moe.py): Qwen's head
# width (not hidden / heads), its experts' and its shared expert's (two experts' worth) widths.
QWEN3, QWEN2_MOE, QWEN3_MOE = "qwen3", "qwen2_moe", "qwen3_moe"
QWEN_HEAD_DIM, QWEN_EXPERT_FFN, QWEN_SHARED_FFN = 16, 24, 48
LLAMA_FAMILY = (LLAMA, QWEN2, MIXTRAL)
EXPERTS, TOPK = 4, 2
VOCAB, LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, POSITIONS, NORM_EPSILON = 50, 4, 32, 4, 2, 64, 16, 1e-5
# What a run of the tiny models sets besides the model: synthetic data, the folder's sequence length, 8 microbatches.
RUN_OVERRIDES = ["data=synthetic", f"trainer.seq_length={POSITIONS}", "trainer.global_batch_size=8",
                 "trainer.micro_batch_size=1", "trainer.tensorboard=false"]
OVERRIDES = [*RUN_OVERRIDES, f"model.vocab_size={VOCAB}", f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}",
             f"model.num_heads={HEADS}", f"model.ffn_hidden_size={FFN}", f"model.max_seq_length={POSITIONS}"]


def hf_config(architecture: str, tie: bool, activation: str = "gelu", rope_scaling: dict | None = None):
    """The transformers config of the tiny model (``activation``: transformers' name, for GPT-2 and StarCoder2;
    ``rope_scaling``: Llama 3's ``rope_parameters`` keys)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config, Starcoder2Config

    if architecture == GPT2:
        return GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                          n_inner=FFN, activation_function=activation, tie_word_embeddings=tie, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, max_position_embeddings=POSITIONS, tie_word_embeddings=tie,
                 bos_token_id=None, eos_token_id=None)
    if architecture == STARCODER2:
        return Starcoder2Config(**shape, num_key_value_heads=HEADS, hidden_act=activation)
    if architecture == STARCODER2_GQA:
        return Starcoder2Config(**shape, num_key_value_heads=KV_HEADS, hidden_act=activation)
    if architecture == GPT_NEOX:
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(**shape, hidden_act=activation, rotary_pct=NEOX_ROTARY, use_parallel_residual=True)
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    if architecture in (MISTRAL, PHI3):
        return _mistral_phi3_config(architecture, shape, rope)
    if architecture in (QWEN3, QWEN2_MOE, QWEN3_MOE):
        return _qwen_config(architecture, shape, rope)
    if architecture in (GEMMA, OLMO2):
        return _gemma_olmo2_config(architecture, shape, rope)
    if architecture in (QWEN3, QWEN2_MOE, QWEN3_MOE):
        return _qwen_config(architecture, shape, rope)
    if architecture == MIXTRAL:
        return MixtralConfig(**shape, num_key_value_heads=KV_HEADS, rms_norm_eps=NORM_EPSILON, rope_parameters=rope,
                             num_local_experts=EXPERTS, num_experts_per_tok=TOPK)
    return (LlamaConfig if architecture == LLAMA else Qwen2Config)(**shape, num_key_value_heads=KV_HEADS,
                                                                   rms_norm_eps=NORM_EPSILON, rope_parameters=rope)


def _mistral_phi3_config(architecture: str, shape: dict, rope: dict):
    """Mistral with a window as long as the sequence (it hides nothing), or Phi-3 (fused q/k/v and gate/up; no padding
    id: its default 32000 is beyond the tiny vocabulary)."""
    from transformers import MistralConfig, Phi3Config

    common = dict(**shape, num_key_value_heads=KV_HEADS, rms_norm_eps=NORM_EPSILON, rope_parameters=rope)
    if architecture == MISTRAL:
        return MistralConfig(**common, sliding_window=POSITIONS)
    return Phi3Config(**common, pad_token_id=None)


def _qwen_config(architecture: str, shape: dict, rope: dict):
    """Qwen3 (q/k norms, heads of ``QWEN_HEAD_DIM``), Qwen2-MoE (its first layer dense, the others routed, a gated
    shared expert, q/k/v biases, the top-k weights not renormalised) or Qwen3-MoE (q/k norms, every other layer from
    the second routed, the top-k renormalised)."""
    from transformers import Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(**shape, num_key_value_heads=KV_HEADS, rms_norm_eps=NORM_EPSILON, rope_parameters=rope)
    if architecture == QWEN3:
        return Qwen3Config(**common, head_dim=QWEN_HEAD_DIM)
    experts = dict(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=QWEN_EXPERT_FFN)
    if architecture == QWEN2_MOE:
        return Qwen2MoeConfig(**common, **experts, shared_expert_intermediate_size=QWEN_SHARED_FFN, mlp_only_layers=[0])
    return Qwen3MoeConfig(**common, **experts, head_dim=QWEN_HEAD_DIM, decoder_sparse_step=2, norm_topk_prob=True)


def _gemma_olmo2_config(architecture: str, shape: dict, rope: dict):
    """Gemma (heads of ``GEMMA_HEAD_DIM``) or OLMo 2; no padding id (Gemma's default 0 would only freeze a row's
    gradient in transformers, OLMo 2's 1 too)."""
    from transformers import GemmaConfig, Olmo2Config

    common = dict(**shape, num_key_value_heads=KV_HEADS, rms_norm_eps=NORM_EPSILON, rope_parameters=rope,
                  pad_token_id=None)
    if architecture == GEMMA:
        return GemmaConfig(**common, head_dim=GEMMA_HEAD_DIM)
    return Olmo2Config(**common)


def save_tiny(folder: Path, architecture: str = GPT2, tie: bool = False, seed: int = 0, activation: str = "gelu",
              rope_scaling: dict | None = None) -> Path:
    """Write a tiny random model into ``folder`` with ``save_pretrained``; return the folder."""
    return save_random(folder, hf_config(architecture, tie, activation, rope_scaling), seed)


def save_random(folder: Path, config, seed: int = 0) -> Path:
    """Write a random model of transformers config ``config`` into ``folder`` (norms around 1, the rest wide)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return Path(folder)


def folder_overrides(folder: Path) -> list[str]:
    """The ppctl overrides of a run that starts from the tiny model in ``folder`` with no model key but
    ``model.init_from``: the folder gives the rest (``ppctl.resolve.init_from``)."""
    return [*RUN_OVERRIDES, f"model.init_from={folder}"]


def save_numbered_tokenizer(path: Path, prefix: str, size: int = VOCAB) -> Path:
    """A WordLevel ``tokenizers`` file of ``size`` ids: ``<prefix><i>`` words, ``<unk>`` and ``<|endoftext|>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"{prefix}{index}" for index in range(size - 2)] + ["<unk>", "<|endoftext|>"]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def overrides(folder: Path, architecture: str = GPT2, tie: bool = False, rope_scaling: dict | None = None) -> list[str]:
    """The ppctl overrides of a run that starts from the tiny model in ``folder`` (saved with ``rope_scaling``)."""
    common = [f"model.tie_embeddings={str(tie).lower()}", f"model.init_from={folder}"]
    if architecture == STARCODER2_GQA:
        return [*OVERRIDES, "model.position_embedding=rope", "model.qkv_bias=true", f"model.num_kv_heads={KV_HEADS}",
                *common]
    if architecture == GPT_NEOX:
        return ["model=gpt_neox_tiny", *OVERRIDES, f"model.partial_rotary_factor={NEOX_ROTARY}", *common]
    if architecture not in LLAMA_FAMILY:
        position = "learned" if architecture == GPT2 else "rope"
        return [*OVERRIDES, f"model.position_embedding={position}", "model.qkv_bias=true", *common]
    llama = ["model=llama_tiny", *OVERRIDES, f"model.num_kv_heads={KV_HEADS}", f"model.norm_epsilon={NORM_EPSILON}",
             f"model.qkv_bias={str(architecture == QWEN2).lower()}", *common]
    if architecture == MIXTRAL:
        llama += [f"model.moe.num_experts={EXPERTS}", f"model.moe.topk={TOPK}", "model.moe.router_topk_norm=true"]
    if rope_scaling:
        llama += [f"model.rope_scaling_factor={rope_scaling['factor']}",
                  f"model.rope_low_freq_factor={rope_scaling['low_freq_factor']}",
                  f"model.rope_high_freq_factor={rope_scaling['high_freq_factor']}",
                  f"model.rope_original_max_position={rope_scaling['original_max_position_embeddings']}"]
    return llama


def _in_float64(model) -> None:
    """transformers' RMSNorm and rotary angles in float64: its norms' math as written, its inverse frequencies as its
    config gives them (Llama 3's scaling by ppctl's formula), each computed in float64."""
    from ppctl.model.llama.layers import RopeScaling, llama_inverse_frequencies

    for module in model.modules():
        if type(module).__name__ == "GemmaRMSNorm":  # its scale is 1 + weight, its epsilon named eps
            module.forward = (lambda norm: lambda hidden: (1 + norm.weight) * hidden * torch.rsqrt(
                hidden.pow(2).mean(-1, keepdim=True) + norm.eps))(module)
        elif type(module).__name__.endswith("RMSNorm"):
            module.forward = (lambda norm: lambda hidden: norm.weight * hidden * torch.rsqrt(
                hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))(module)
        if type(module).__name__ == "MixtralTopKRouter":
            module.forward = (lambda router: lambda hidden: _route_in_float64(router, hidden))(module)
        if type(module).__name__ in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter"):
            module.forward = (lambda router: lambda hidden: _qwen_route_in_float64(router, hidden))(module)
    config, rotary = model.config, model.base_model.rotary_emb
    rope = config.rope_parameters
    scaling = None
    if rope.get("rope_type") == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))  # GPT-NeoX rotates part of each head
    inverse, attention = llama_inverse_frequencies(rotary_dim, rope["rope_theta"], scaling), 1.0
    if rope.get("rope_type") in ("linear", "yarn"):  # transformers' own formula, run in float64
        inverse, attention = transformers_rope_in_float64(config)

    def forward(hidden, position_ids):
        angles = position_ids.to(torch.float64)[..., None] * inverse
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * attention).to(hidden.dtype), (angles.sin() * attention).to(hidden.dtype)

    rotary.forward = forward


class _Float64Torch:
    """``torch`` with its float32 names meaning float64: transformers' rotary formulas, run under it, compute in
    float64 (they name ``torch.float`` and ``torch.float32`` for their tables)."""

    float = float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def transformers_rope_in_float64(config) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies, attention factor)`` of a transformers config's scaled rotary embedding (``linear``,
    ``yarn``...), by transformers' own ``ROPE_INIT_FUNCTIONS`` run in float64 instead of float32."""
    from transformers import modeling_rope_utils

    saved, modeling_rope_utils.torch = modeling_rope_utils.torch, _Float64Torch()
    try:
        return modeling_rope_utils.ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
    finally:
        modeling_rope_utils.torch = saved


def _route_in_float64(router, hidden: torch.Tensor):
    """Mixtral's router as transformers computes it (logits, softmax, top-k, the top-k renormalised), the softmax in
    the logits' dtype rather than float32."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    top, experts = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), experts


def _qwen_route_in_float64(router, hidden: torch.Tensor):
    """Qwen-MoE's router as transformers computes it (logits, softmax, top-k, renormalised with ``norm_topk_prob``),
    the softmax in the logits' dtype rather than float32."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    top, experts = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True) if router.norm_topk_prob else top, experts


def hf_model(folder: Path, exact: bool = True):
    """The model in ``folder`` loaded by ``AutoModelForCausalLM``, in float64, eval mode; ``exact``: its float32
    parts (rotary angles, RMSNorm) in float64 too."""
    from transformers import AutoModelForCausalLM

    text = (folder / "config.json").read_text()
    mixture = any(name in text for name in ("Mixtral", "Qwen2Moe", "Qwen3Moe"))
    experts = {"experts_implementation": "eager"} if mixture else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **experts).eval()
    if exact and hasattr(model.base_model, "rotary_emb"):
        _in_float64(model)
    return model


def folder_run_config(folder: Path, *extra: str):
    """The validated float64 single-process config of a run that names ``folder`` alone (and ``extra``)."""
    from ppctl.resolve import compose_config, validate

    config = compose_config([*folder_overrides(folder), "parallel=single", "trainer.precision=fp64", *extra])
    validate(config)
    return config


def random_tokens(seed: int = 7) -> torch.Tensor:
    """Two rows of ``POSITIONS`` ids below ``VOCAB``, drawn from ``seed``."""
    return torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(seed))


def reference_logits(config, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ``tokens`` of ``config``'s single-process reference model, its real vocabulary's columns."""
    from ppctl.run.reference import reference_model

    with torch.no_grad():
        return reference_model(config)(tokens)[..., :VOCAB]


def transformers_logits(folder: Path, tokens: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """The logits of ``tokens`` of transformers' model of ``folder`` (``hf_model``)."""
    with torch.no_grad():
        return hf_model(folder, exact)(tokens).logits


def greedy_matches_transformers(folder: Path, prompt: list[int], steps: int, logits_bound: float) -> None:
    """Assert that the model read from ``folder`` decodes ``prompt`` through its KV cache (``ppctl generate``'s
    ``generate_ids``) to transformers' greedy tokens for ``steps`` steps, its step logits within ``logits_bound``."""
    from ppctl.run.reference import reference_model
    from tests.unit.test_generate import _hf_greedy, _ppctl_greedy

    chunk = reference_model(folder_run_config(folder)).eval()
    with torch.no_grad():
        ids, logits = _ppctl_greedy(chunk, prompt, steps)
        expected_ids, expected_logits = _hf_greedy(hf_model(folder), prompt, steps)
    assert ids == expected_ids
    assert relative_error(logits, expected_logits) < logits_bound


def written_back_equals_the_folder(hf_format, folder: Path, out: Path, exact: float) -> None:
    """Assert that the dense model read from ``folder`` writes back (``hf_format``: the tensors and the
    ``config.json``, into ``out``) the folder's tensors bit for bit, which transformers reads to the folder's logits
    (relative ``exact``), and a ``config.json`` that reads back to the folder's shape."""
    import json

    from safetensors.torch import load_file, save_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.rules import rule_of
    from ppctl.run.reference import reference_model

    config = folder_run_config(folder)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in reference_model(config).named_parameters()}
    shape = resolve_model(config).shape
    written = to_hf_tensors(hf_format, shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved) and all(torch.equal(written[key], saved[key].double()) for key in saved)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_format.hf_config(shape)))
    save_file({key: tensor.contiguous() for key, tensor in written.items()}, str(out / "model.safetensors"))
    tokens = random_tokens()
    assert relative_error(transformers_logits(out, tokens), transformers_logits(folder, tokens)) < exact
    assert hf_format.shape_from_hf(hf_format.hf_config(shape)) == hf_format.shape_from_hf(read_hf_config(folder))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest element difference over the largest element of ``expected``."""
    return float((actual - expected).abs().max() / expected.abs().max())


def batch_loss(model, batch) -> float:
    """The mean token loss of a ppctl microbatch (``tokens``, ``position_ids``, ``labels``, ``loss_mask``) under an HF
    model, from its float64 logits (transformers' own ``loss`` is float32 even for a float64 model)."""
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, position_ids=batch.position_ids).logits
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    mask = batch.loss_mask.flatten().to(losses.dtype)
    return float((losses * mask).sum() / mask.sum())


def step_batch(config, step: int, split: str = "train"):
    """Global batch ``step`` of a ppctl config's data split, whole (as the single-process reference builds it)."""
    from ppctl.data.dataset import build_microbatch, global_batch_sample_ids
    from ppctl.model.from_config import dataset_of

    dataset = dataset_of(config, split)
    trainer = config.trainer
    return build_microbatch(dataset, global_batch_sample_ids(trainer.seed, step, trainer.global_batch_size,
                                                             len(dataset)))
