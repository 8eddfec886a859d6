"""Tiny random ``transformers`` models for the Hugging Face tests, made locally (no hub), and what to compare them by.

``save_tiny(folder, architecture, tie, activation=...)`` writes a GPT-2 or StarCoder2 model (every bias random, the
QKV biases included, as in real checkpoints) of the shape ``OVERRIDES`` gives ppctl, with the exact ``gelu`` unless
``activation`` names another transformers activation, its weights drawn wide enough that a wrong mapping moves the
logits by far more than rounding; ``overrides(folder, architecture, tie)`` is the ppctl config that starts from it
(``model.qkv_bias=true``: both architectures have the bias). ``hf_model``
loads one in float64, its rotary angles computed in float64 too (transformers computes them in float32 whatever the
model's dtype, which alone puts ~1e-8 into the logits).
"""

from __future__ import annotations

from pathlib import Path

import torch

GPT2, STARCODER2 = "gpt2", "starcoder2"
VOCAB, LAYERS, HIDDEN, HEADS, FFN, POSITIONS = 50, 4, 32, 4, 64, 16
OVERRIDES = ["data=synthetic", f"model.vocab_size={VOCAB}", f"model.num_layers={LAYERS}",
             f"model.hidden_size={HIDDEN}", f"model.num_heads={HEADS}", f"model.ffn_hidden_size={FFN}",
             f"model.max_seq_length={POSITIONS}", f"trainer.seq_length={POSITIONS}", "trainer.global_batch_size=8",
             "trainer.micro_batch_size=1", "trainer.tensorboard=false"]


def hf_config(architecture: str, tie: bool, activation: str = "gelu"):
    """The transformers config of the tiny model (``activation``: transformers' name)."""
    from transformers import GPT2Config, Starcoder2Config

    if architecture == GPT2:
        return GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                          n_inner=FFN, activation_function=activation, tie_word_embeddings=tie, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return Starcoder2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=HEADS, hidden_act=activation,
                            max_position_embeddings=POSITIONS, tie_word_embeddings=tie, bos_token_id=None,
                            eos_token_id=None)


def save_tiny(folder: Path, architecture: str = GPT2, tie: bool = False, seed: int = 0,
              activation: str = "gelu") -> Path:
    """Write a tiny random model into ``folder`` with ``save_pretrained``; return the folder."""
    from transformers import GPT2LMHeadModel, Starcoder2ForCausalLM

    torch.manual_seed(seed)
    config = hf_config(architecture, tie, activation)
    model = (GPT2LMHeadModel if architecture == GPT2 else Starcoder2ForCausalLM)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return Path(folder)


def overrides(folder: Path, architecture: str = GPT2, tie: bool = False) -> list[str]:
    """The ppctl overrides of a run that starts from the tiny model in ``folder``."""
    position = "learned" if architecture == GPT2 else "rope"
    return [*OVERRIDES, f"model.position_embedding={position}", f"model.tie_embeddings={str(tie).lower()}",
            "model.qkv_bias=true", f"model.init_from={folder}"]


def _float64_rotary(rotary_module):
    """A forward for StarCoder2's rotary module that computes its angles in float64."""
    theta = rotary_module.config.rope_parameters["rope_theta"]

    def forward(hidden, position_ids):
        head_dim = HIDDEN // HEADS
        inverse = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = position_ids.to(torch.float64)[..., None] * inverse
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)

    return forward


def hf_model(folder: Path, exact_rotary: bool = True):
    """The model in ``folder`` loaded by ``AutoModelForCausalLM``, in float64, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    if exact_rotary and hasattr(model, "model") and hasattr(model.model, "rotary_emb"):
        model.model.rotary_emb.forward = _float64_rotary(model.model.rotary_emb)
    return model


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
