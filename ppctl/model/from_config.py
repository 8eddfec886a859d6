"""What a config describes, built: the GPT shape, the parameter dtype and the dataset.

Below the training loop and the single-process reference, which both build their
model and data from here, so neither depends on the other.
"""

from __future__ import annotations

import torch

from ppctl.config import PpctlConfig, padded_vocab_size
from ppctl.data.dataset import WindowDataset, build_dataset
from ppctl.data.corpus import CorpusSpec
from ppctl.model.gpt import GPTConfig
from ppctl.model.recompute import Recompute

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt_config(config: PpctlConfig) -> GPTConfig:
    """The model shape: the tokenizer's vocabulary, with the embedding rows padded for TP."""
    model = config.model
    return GPTConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size, vocab_size=model.vocab_size,
        padded_vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, config.parallel.tp),
        max_seq_length=model.max_seq_length, position_embedding=model.position_embedding,
        tie_embeddings=model.tie_embeddings, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
    )


def recompute_of(config: PpctlConfig) -> Recompute:
    """What the model chunks recompute in the backward (``model.recompute``, ``recompute_method``, ``_num_layers``)."""
    model = config.model
    return Recompute(model.recompute, model.recompute_method, model.recompute_num_layers)


def parameter_dtype(config: PpctlConfig) -> torch.dtype:
    """The dtype of the model's parameters, activations and pipeline messages (``trainer.precision``).

    With bf16 or fp16 the optimizer keeps fp32 main parameters and gradients (``ppctl.optim``).
    """
    return DTYPES[config.trainer.precision]


def dataset_of(config: PpctlConfig, split: str = "train") -> WindowDataset:
    """Split ``split`` (``train`` or ``validation``) of the configured dataset of ``trainer.seq_length``-token windows.

    Token sources are prepared (or reused) in their cache; the windows are cut inside the split.
    """
    data, trainer = config.data, config.trainer
    return build_dataset(CorpusSpec.of(data), trainer.seq_length, config.model.vocab_size, trainer.seed, split,
                         data.eod_mask_loss)
