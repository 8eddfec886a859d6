"""A model family as a plug-in, and a config's model resolved once by it (pure: no torch).

A family is one folder under ``ppctl/model/`` whose ``__init__`` exports ``FAMILY``, a ``ModelFamily``;
``model.family`` names the folder. A family declares its own ``model.*`` keys as its subclass of the shared
``ModelConfig`` (``ModelFamily.settings``, its folder's ``settings.py``); ``settings_schema()`` is every installed
family's keys together (what composition accepts on the command line) and ``family_settings`` turns a config's
``model.*`` into the selected family's class, refusing in one line a key only other families read that was set.
``resolve_model(config)`` is the one place a config's model is resolved: it
looks the family up and makes one frozen ``ResolvedModel`` holding the family, the padded vocabulary (Megatron's
rule, ``padded_vocab_size``), the memory/FLOP shape (``ModelShape``) the memory model and the planner read, the
family's own shape its chunk is built from, the parameter rules, its Hugging Face format and that format's
capabilities, and the builder of a stage chunk. ``ResolvedConfig.model`` holds the one of a resolved config; the
rest of ppctl reads that object, asks it capabilities (never a family's name), and recomputes none of it.
A family's ``__init__`` imports no torch (validation and the planner read it); its shape and chunk classes are
imported when first read. Adding a family is a folder plus its tests and presets (``conf/model/``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ppctl.config.derived import padded_vocab_size
from ppctl.config.schema import ConfigError, ModelConfig

from ppctl.model.memory_shape import ModelShape, memory_shape_of

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

    ``shape_of(model)``: the family's frozen model shape of a ``ResolvedModel`` (its ``settings``, padded
    vocabulary and mixture); ``chunk_class()``: the stage chunk class (a ``ppctl.model.chunk.DecoderChunk``), built
    as ``cls(shape, stage, groups, seed=..., dtype=..., recompute=...)``: ``stage`` a
    ``ppctl.parallel.layout.StageLayers`` (its layer ids, whether it holds the embedding and the loss), ``groups``
    the ``ppctl.parallel.groups.RankGroups`` its layers communicate in, ``seed`` None leaving its parameters zero;
    ``rule_of_name(shape)``: a function from a global parameter name to its ``ParameterRule`` (for what holds names
    only: checkpoints); ``check(settings, config)``: the family's own config rules (``settings``: the run's
    ``model.*`` as the family's ``settings`` class), raising ``ConfigError`` in one line;
    ``hf()``: the family's Hugging Face format (its folder's ``hf.py``, imported when called; see
    ``ppctl.model.hf_format``), None for a family that reads and writes no HF checkpoints; ``architecture``: what
    the memory model and the FLOP count read of its layers; ``settings``: its ``model.*`` keys, a subclass of
    ``ModelConfig`` (its folder's ``settings.py``); ``memory_shape(settings, padded_vocab, architecture)``: its
    ``ModelShape`` (``memory_shape_of`` of the shared keys unless its own keys change it: grouped-query attention).
    """

    name: str
    shape_of: Callable[[Any], Any]
    chunk_class: Callable[[], type]
    rule_of_name: Callable[[Any], Callable[[str], Any]]
    check: Callable[[Any, Any], None] = lambda settings, config: None
    hf: Callable[[], Any] | None = None
    architecture: Architecture = Architecture()
    settings: type = ModelConfig
    memory_shape: Callable[[Any, int, Architecture], ModelShape] = memory_shape_of


@dataclass(frozen=True)
class ResolvedModel:
    """A config's model, resolved once by its family (``resolve_model``): what every reader of the model asks.

    ``settings``: the ``model.*`` section it was resolved from, an instance of the family's ``settings`` class
    (frozen with its config once that is resolved);
    ``tp``: the tensor-parallel size its vocabulary is padded for. What follows from them is built on first read
    and kept: the padded vocabulary and the memory shape are pure arithmetic; the family's ``shape`` imports its
    model module (torch), so that validation and the planner, which never read it, stay torch-free.
    """

    family: ModelFamily
    settings: Any
    tp: int

    @functools.cached_property
    def padded_vocab_size(self) -> int:
        """The embedding's and the output layer's rows: the vocabulary padded for TP (Megatron's rule)."""
        settings = self.settings
        return padded_vocab_size(settings.vocab_size, settings.make_vocab_size_divisible_by, self.tp)

    @functools.cached_property
    def memory_shape(self) -> ModelShape:
        """What the memory model, the FLOP count and the planner read of the model (``ppctl.model.memory_shape``)."""
        return self.family.memory_shape(self.settings, self.padded_vocab_size, self.family.architecture)

    @property
    def moe(self):
        """The mixture of experts (``MoEShape``), None for a dense model."""
        return self.memory_shape.moe

    @functools.cached_property
    def shape(self) -> Any:
        """The family's frozen model shape (``GPTConfig``, ``LlamaConfig``), which its chunks are built from."""
        return self.family.shape_of(self)

    @property
    def rules(self) -> Callable[[str], Any]:
        """The ``ParameterRule`` of each global parameter name (for what holds names only: checkpoints)."""
        return self.family.rule_of_name(self.shape)

    @functools.cached_property
    def hf(self) -> Any:
        """The family's Hugging Face format (``ppctl.model.hf_format``), None for a family that has none."""
        return None if self.family.hf is None else self.family.hf()

    @property
    def hf_moe_architecture(self) -> str | None:
        """The Hugging Face architecture a mixture of experts of this family is read and written as (Mixtral's),
        None where its format has none (or it has no format)."""
        return getattr(self.hf, "moe_architecture", None)

    def build_chunk(self, stage, groups, *, seed: int | None, dtype, recompute):
        """One stage chunk of the model: ``stage``'s layers (a ``StageLayers``, with the embedding and the output
        layer where it holds them) on this rank of ``groups`` (a ``RankGroups``); ``seed`` None leaves its
        parameters zero; ``recompute``: what it recomputes in the backward."""
        return self.family.chunk_class()(self.shape, stage, groups, seed=seed, dtype=dtype, recompute=recompute)


@functools.cache  # the installed folders do not change while ppctl runs; the planner asks per candidate
def family_names() -> tuple[str, ...]:
    """The families installed: the folders under ``ppctl/model/`` that export ``FAMILY``."""
    folder = Path(__file__).resolve().parent
    return tuple(sorted(info.name for info in pkgutil.iter_modules([str(folder)])
                        if info.ispkg and hasattr(importlib.import_module(f"{FAMILIES_PACKAGE}.{info.name}"),
                                                  "FAMILY")))


def installed_families() -> tuple[ModelFamily, ...]:
    """Every installed family, by name (for what asks all of them: which one reads a Hugging Face folder)."""
    return tuple(_family_named(name) for name in family_names())


def resolve_model(config) -> ResolvedModel:
    """The ``ResolvedModel`` of a ``PpctlConfig``: the one place its family is looked up (``ConfigError`` naming the
    installed ones for an unknown ``model.family``) and its model resolved."""
    family = family_of(config.model)
    return ResolvedModel(family=family, settings=family_settings(config.model), tp=config.parallel.tp)


def family_of(model) -> ModelFamily:
    """The installed family ``model.family`` names; ``ConfigError`` naming the installed ones for another name."""
    if model.family not in family_names():
        raise ConfigError(f"model.family={model.family!r} must be one of {', '.join(family_names())}")
    return _family_named(model.family)


@functools.cache  # the installed families do not change while ppctl runs
def settings_schema() -> type:
    """Every installed family's ``model.*`` keys in one class (a subclass of ``ModelConfig``): what composition
    accepts, before ``family_settings`` keeps the selected family's. A key two families declare has one type and
    one default (``TypeError`` otherwise: a family's mistake, caught by its tests)."""
    own: dict[str, tuple[Any, dataclasses.Field]] = {}
    for family in installed_families():
        hints = typing.get_type_hints(family.settings)  # the annotations are strings (``from __future__``)
        for item in _own_fields(family.settings):
            known_type, known = own.setdefault(item.name, (hints[item.name], item))
            if (known_type, known.default) != (hints[item.name], item.default):
                raise TypeError(f"model.{item.name} is declared by several families with other types or defaults")
    extra = [(name, kind, dataclasses.field(default=item.default, metadata=item.metadata))
             for name, (kind, item) in own.items()]
    return dataclasses.make_dataclass("ModelSettings", extra, bases=(ModelConfig,))


def family_settings(model) -> ModelConfig:
    """``model`` (the ``model.*`` section: any ``ModelConfig``) as an instance of its family's ``settings`` class;
    ``ConfigError`` in one line for a key only other families read that holds another value than its default (a
    key a family does not read keeps its meaning of "not used"). A family's own key ``model`` lacks takes its
    default."""
    family = family_of(model)
    if type(model) is family.settings:
        return model
    kept = {item.name for item in dataclasses.fields(family.settings)}
    for item in dataclasses.fields(model):
        if item.name not in kept and getattr(model, item.name) != item.default:
            home, others = _readers(item.name)
            also = f" (and {', '.join(others)})" if others else ""
            raise ConfigError(f"model.{item.name}={getattr(model, item.name)} is read by model.family={home}{also} "
                              f"only; this model is model.family={model.family} (drop the key, or set "
                              f"model.family={home})")
    values = {item.name: getattr(model, item.name) for item in dataclasses.fields(model) if item.name in kept}
    return family.settings(**values)


def _readers(key: str) -> tuple[str, list[str]]:
    """The family that declares ``key`` (its settings class is its own folder's), and the others that read it too."""
    readers = [family for family in installed_families()
               if key in {item.name for item in dataclasses.fields(family.settings)}]
    declaring = [family for family in readers if key in vars(family.settings).get("__annotations__", {})
                 and family.settings.__module__ == f"{FAMILIES_PACKAGE}.{family.name}.settings"]
    home = (declaring or readers)[0].name
    return home, [family.name for family in readers if family.name != home]


def family_own_keys() -> list[tuple[dataclasses.Field, tuple[str, ...]]]:
    """Each key a family adds to the shared ``ModelConfig``, once, with the families that read it (for the key
    reference of docs/configuration.md)."""
    readers: dict[str, tuple[dataclasses.Field, tuple[str, ...]]] = {}
    for family in installed_families():
        for item in _own_fields(family.settings):
            known, names = readers.get(item.name, (item, ()))
            readers[item.name] = known, (*names, family.name)
    return list(readers.values())


def _own_fields(settings: type) -> list[dataclasses.Field]:
    """The fields a family's ``settings`` class adds to the shared ``ModelConfig``."""
    shared = {item.name for item in dataclasses.fields(ModelConfig)}
    return [item for item in dataclasses.fields(settings) if item.name not in shared]


def hf_experts_formats() -> str:
    """The Hugging Face architectures a mixture of experts is read and written as, each with its family, for a
    message: ``MixtralForCausalLM (model.family=llama)``; ``none`` where no family's format has one."""
    formats = {family.name: family.hf() for family in installed_families() if family.hf is not None}
    found = [f"{hf.moe_architecture} (model.family={name})" for name, hf in formats.items()
             if getattr(hf, "moe_architecture", None)]
    return " or ".join(found) or "none"


def _family_named(name: str) -> ModelFamily:
    """The installed family ``name`` (one of ``family_names()``)."""
    return importlib.import_module(f"{FAMILIES_PACKAGE}.{name}").FAMILY
