"""What a config describes, built: the model family and shape, its chunks, the parameter dtype and the dataset.

Below the training loop and the single-process reference, which both build their
model and data from here, so neither depends on the other.
"""

from __future__ import annotations

import torch

from ppctl.config import PpctlConfig
from ppctl.data.dataset import WindowDataset, build_dataset
from ppctl.data.corpus import CorpusSpec
from ppctl.model.family import ModelFamily, model_family
from ppctl.model.hf_format import hf_format_of
from ppctl.model.hf_weights import load_hf_weights
from ppctl.model.recompute import Recompute

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def family_of(config: PpctlConfig) -> ModelFamily:
    """The model family ``model.family`` names."""
    return model_family(config.model.family)


def model_shape(config: PpctlConfig):
    """The family's model shape: the tokenizer's vocabulary, with the embedding rows padded for TP."""
    return family_of(config).shape_of(config)


def build_chunk(config: PpctlConfig, layer_ids, pre_process: bool, post_process: bool, tp, cp=None,
                recompute: Recompute | None = None, load_init_from: bool = True, ep=None):
    """One stage chunk of the configured model on this TP (and CP, EP) rank, initialised from ``trainer.seed``, or
    from the Hugging Face folder ``model.init_from`` (this rank's slices only) unless ``load_init_from`` is False
    (a run that resumes reads its checkpoint instead); ``recompute``: what it recomputes (default: as
    configured)."""
    family = family_of(config)
    shape = family.shape_of(config)
    reads_hf = bool(config.model.init_from and load_init_from)
    seed = None if reads_hf else config.trainer.seed  # every parameter is read: no random dense values drawn
    chunk = family.chunk_class()(shape, layer_ids, pre_process, post_process, tp, seed, parameter_dtype(config), cp,
                                 recompute_of(config) if recompute is None else recompute, ep)
    if reads_hf:
        load_hf_weights(chunk, config.model.init_from, hf_format_of(family), shape, tp, chunk.ep)
    return chunk


def parameter_rules(config: PpctlConfig):
    """The rule of each global parameter name of the configured model (for what holds names only)."""
    family = family_of(config)
    return family.rule_of_name(family.shape_of(config))


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
