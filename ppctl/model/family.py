"""A model family as a plug-in: one folder under ``ppctl/model/`` whose ``__init__`` exports ``FAMILY``.

``model.family`` names the folder; the rest of ppctl reads a family only through its ``ModelFamily``:
the shape a config describes, the stage chunk built from it, and each parameter's TP split and
initialisation. A family's ``__init__`` imports no torch (config validation and the planner read it),
its chunk is imported when one is built. Adding a family is a folder plus its tests and presets
(``conf/model/``): nothing else names it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FAMILIES_PACKAGE = "ppctl.model"


@dataclass(frozen=True)
class Architecture:
    """What the memory model, the FLOP count and the planner read of a family's layers (pure data).

    ``norm_has_bias``: LayerNorm (scale and shift) rather than RMSNorm (scale only, its unit-RMS input kept by
    PyTorch's ops for the backward); ``gated_mlp``: SwiGLU's gate and up projections; ``linear_biases``: biases on
    the attention output and the MLP (GPT); ``fused_qkv``: one query-key-value weight, whose output stays whole
    while attention reads its values, rather than q, k and v apart (keys and values repeated to the query heads).
    """

    norm_has_bias: bool = True
    gated_mlp: bool = False
    linear_biases: bool = True
    fused_qkv: bool = True


@dataclass(frozen=True)
class ModelFamily:
    """What ppctl reads of a model family.

    ``shape_of(config)``: the family's frozen model shape for a ``PpctlConfig`` (vocabulary padded for its tp);
    ``chunk_class()``: the stage chunk class, built as ``cls(shape, layer_ids, pre_process, post_process, tp,
    seed, dtype, cp, recompute)`` (``seed`` None: parameters left zero); ``rule_of_name(shape)``: a function from
    a global parameter name to its ``ParameterRule`` (for what holds names only: checkpoints); ``check(config)``:
    the family's own config rules, raising ``ConfigError`` in one line; ``hf()``: the family's Hugging Face format
    (its folder's ``hf.py``, imported when called; see ``ppctl.model.hf_format``), None for a family that reads
    and writes no HF checkpoints; ``architecture``: what the memory model and the FLOP count read of its layers.
    """

    name: str
    shape_of: Callable[[Any], Any]
    chunk_class: Callable[[], type]
    rule_of_name: Callable[[Any], Callable[[str], Any]]
    check: Callable[[Any], None] = lambda config: None
    hf: Callable[[], Any] | None = None
    architecture: Architecture = Architecture()


@functools.cache  # the installed folders do not change while ppctl runs; the planner asks per candidate
def family_names() -> tuple[str, ...]:
    """The families installed: the folders under ``ppctl/model/`` that export ``FAMILY``."""
    folder = Path(__file__).resolve().parent
    return tuple(sorted(info.name for info in pkgutil.iter_modules([str(folder)])
                        if info.ispkg and hasattr(importlib.import_module(f"{FAMILIES_PACKAGE}.{info.name}"),
                                                  "FAMILY")))


def model_family(name: str) -> ModelFamily:
    """The family named ``name`` (``model.family``); ``KeyError`` naming the installed ones otherwise."""
    if name not in family_names():
        raise KeyError(f"model.family={name!r} must be one of {', '.join(family_names())}")
    return importlib.import_module(f"{FAMILIES_PACKAGE}.{name}").FAMILY
