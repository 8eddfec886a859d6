"""What a config describes, built: its stage chunks, the parameter dtype and the dataset.

The model itself is resolved by its family (``ppctl.model.family.resolve_model``: the family, shapes, padded
vocabulary, rules, HF format); this module builds its chunks from that ``ResolvedModel`` with the run's seed,
dtype, recomputation and ``model.init_from``. Below the training loop and the single-process reference, which
both build their model and data from here, so neither depends on the other.
"""

from __future__ import annotations

import torch

from ppctl.config import PpctlConfig
from ppctl.data.blend import build_blended_dataset
from ppctl.data.corpus import INSTRUCTION_SOURCES, BlendSpec, CorpusSpec, data_spec_of
from ppctl.data.dataset import WindowDataset, build_dataset
from ppctl.data.instruction_dataset import build_instruction_dataset
from ppctl.model.family import ResolvedModel, resolve_model
from ppctl.model.hf_format import hf_format_of
from ppctl.model.hf_weights import load_hf_weights
from ppctl.model.recompute import Recompute
from ppctl.parallel.groups import RankGroups
from ppctl.parallel.layout import StageLayers

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_chunk(config: PpctlConfig, stage: StageLayers, groups: RankGroups = RankGroups.single(), *,
                recompute: Recompute | None = None, load_init_from: bool = True, model: ResolvedModel | None = None):
    """One stage chunk of the configured model (``stage``'s layers) on this rank of ``groups``, initialised from
    ``trainer.seed``, or from the Hugging Face folder ``model.init_from`` (this rank's slices only) unless
    ``load_init_from`` is False (a run that resumes reads its checkpoint instead); ``recompute``: what it recomputes
    (default: as configured); ``model``: the config's ``ResolvedModel`` (``ResolvedConfig.model``), resolved here if
    not given."""
    model = model or resolve_model(config)
    reads_hf = bool(config.model.init_from and load_init_from)
    seed = None if reads_hf else config.trainer.seed  # every parameter is read: no random dense values drawn
    chunk = model.build_chunk(stage, groups, seed=seed, dtype=parameter_dtype(config),
                              recompute=recompute_of(config) if recompute is None else recompute)
    if reads_hf:
        load_hf_weights(chunk, config.model.init_from, hf_format_of(model.family), model.shape, groups.tp, groups.ep)
    return chunk


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

    Token sources are prepared (or reused) in their cache; the windows are cut inside the split. A blend
    (``data.blend``) draws from its sources in its weights' proportions.
    """
    data, trainer = config.data, config.trainer
    separate = data.documents == "separate"
    if data.source in INSTRUCTION_SOURCES and not data.blend:
        return build_instruction_dataset(CorpusSpec.of(data), trainer.seq_length, config.model.vocab_size, split,
                                         data.eod_mask_loss, separate_documents=separate)
    spec = data_spec_of(data)
    if isinstance(spec, BlendSpec):
        return build_blended_dataset(spec, trainer.seq_length, config.model.vocab_size, trainer.seed, split,
                                     data.eod_mask_loss, separate_documents=separate)
    return build_dataset(spec, trainer.seq_length, config.model.vocab_size, trainer.seed, split, data.eod_mask_loss,
                         separate_documents=separate)
