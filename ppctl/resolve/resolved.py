"""A config resolved once: its layout, schedule, split into stages, layer map, model and sizes, frozen.

``resolve(config)`` validates a composed config and builds, once, every object the rest of ppctl reads
from it: the ``ParallelLayout`` (with the schedule's stage placement), the built ``Schedule`` (a custom
one read from its file once), the layout string of the model's split (``parallel.balance=auto``'s choice,
fitted to ``parallel.balance_memory_gb`` by the memory model), the layer map, the model (its family's
``ResolvedModel``, made once by validation: shapes, padded vocabulary, rules, HF format) and the derived sizes.
The CLI resolves once per command and each worker once per process; the trainer, the reports and the planner
take the ``ResolvedConfig``. Its config is frozen (``schema.freeze``): a setting
assigned after resolution raises, so nothing downstream sees a config other than the one validated.
Where a run starts and what it resumes from belong to the launch (``ppctl.run.launch``), not the config.
Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

from ppctl.config.derived import (configured_schedule, interleaves_experts, layout_of, nproc_per_node,
                                  num_microbatches, pipeline_layout_of)
from ppctl.config.schema import ConfigError, PpctlConfig, freeze
from ppctl.resolve.validate import validate
from ppctl.model.family import ResolvedModel, resolve_model
from ppctl.parallel.layout import LayoutError, ParallelLayout, StageLayers
from ppctl.pipeline.schedules import CUSTOM, Schedule, ScheduleError
from ppctl.plan.balance import balanced_counts, model_part_costs, fitted_counts, layout_string


@dataclass(frozen=True)
class Sizes:
    """The numbers that follow from a resolved config (the padded vocabulary is the model's:
    ``ResolvedConfig.model.padded_vocab_size``)."""

    world_size: int
    num_microbatches: int      # per DP rank per step
    nproc_per_node: int


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config and what it describes, built once (see the module docstring)."""

    config: PpctlConfig
    layout: ParallelLayout
    pipeline_layout: str | None  # the split's layout string; None: the plain even split
    layer_map: Mapping[tuple[int, int], StageLayers]  # (pp_rank, chunk) -> the stage's layers
    model: ResolvedModel  # the model, resolved once by its family: every reader of the model asks it
    sizes: Sizes
    split_problem: str | None = None  # why the layers do not split into the stages (resolve(layer_split=False))

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The configured schedule, built on first use (the planner weighs thousands of layouts before building
        a few schedules): the kept one of the registry's, shared with validation's checker and the planner, or
        the custom file's, read once. ``ConfigError`` (one line) where it cannot be built."""
        return _built_schedule(self.config)

    def __reduce__(self):
        # Pickled as its config and resolved again where it is read (a worker pool's argument): the same config
        # gives the same objects, and the read-only layer map is not picklable as it is.
        return _resolved_again, (self.config, self.split_problem is None)

    def rank_stages(self, pp_rank: int) -> list[StageLayers]:
        """The stages ``pp_rank`` holds, in chunk order."""
        return [stage for (rank, _), stage in sorted(self.layer_map.items()) if rank == pp_rank]


def resolve(config: PpctlConfig, check: bool = True, data: bool = True, prove_schedule: bool = True,
            layer_split: bool = True) -> ResolvedConfig:
    """The ``ResolvedConfig`` of a composed config, which is frozen from here on; ``ConfigError`` (one line) where
    it is not valid.

    ``check=False`` builds without validating (a worker, whose launcher validated the same file; the planner's
    bounds on a layout before it is validated); ``data``, ``prove_schedule`` and ``layer_split`` are
    ``validate``'s (``inspect-schedule`` draws a schedule whatever the model: its layer map is then empty when
    the layers do not split).
    """
    model = (validate(config, layer_split=layer_split, data=data, prove_schedule=prove_schedule).model if check
             else resolve_model(config))  # the model, resolved once: by validation where it runs
    if config.model is not model.settings:  # a config built by hand holds the shared keys only: its family's class
        config.model = model.settings
    layout = layout_of(config)
    try:
        resolved = _assemble(config, layout, model, _split(config, layout, model))
    except ConfigError as error:
        if layer_split:
            raise
        resolved = _assemble(config, layout, model, None, {}, split_problem=str(error))
    freeze(config)
    return resolved


def _resolved_again(config: PpctlConfig, layer_split: bool) -> ResolvedConfig:
    """A pickled ``ResolvedConfig``, resolved again from its (validated) config."""
    return resolve(config, check=False, layer_split=layer_split)


def _assemble(config: PpctlConfig, layout: ParallelLayout, model: ResolvedModel, split: str | None,
              layers: dict | None = None, split_problem: str | None = None) -> ResolvedConfig:
    """The ``ResolvedConfig`` of parts already built, its layer map built unless given (the config is not frozen
    here); ``ConfigError`` where the layers do not split."""
    if layers is None:
        try:
            layers = layout.layer_map(config.model.num_layers, split)
        except LayoutError as error:
            raise ConfigError(str(error)) from None
    sizes = Sizes(world_size=layout.world_size, num_microbatches=num_microbatches(config),
                  nproc_per_node=nproc_per_node(config))
    return ResolvedConfig(config=config, layout=layout, pipeline_layout=split, layer_map=MappingProxyType(layers),
                          model=model, sizes=sizes, split_problem=split_problem)


def _built_schedule(config: PpctlConfig) -> Schedule:
    """The configured schedule (``ResolvedConfig.schedule``), with its weight fills where the expert all-to-alls
    are overlapped (``parallel.overlap_ep_comm`` at ep > 1: ``Schedule.with_weight_fills``)."""
    from ppctl.pipeline.kept import kept_schedule

    try:
        parallel = config.parallel
        schedule = (configured_schedule(config) if config.schedule.name == CUSTOM
                    else kept_schedule(config.schedule.name, parallel.pp, parallel.vpp, num_microbatches(config)))
    except ScheduleError as error:
        raise ConfigError(str(error)) from None
    return schedule.with_weight_fills() if interleaves_experts(config) and schedule.splits_backward else schedule


def _split(config: PpctlConfig, layout: ParallelLayout, model: ResolvedModel) -> str | None:
    """The layout string of the model's split: ``parallel.balance=auto``'s choice, or the configured one."""
    parallel = config.parallel
    if parallel.balance != "auto":
        return pipeline_layout_of(config)
    costs, placement = model_part_costs(model, config.trainer.seq_length), layout.placement
    if parallel.balance_memory_gb is None:
        return layout_string(balanced_counts(config.model.num_layers, placement, costs))
    memory_of = functools.partial(_split_memory, config, layout)
    return layout_string(fitted_counts(config.model.num_layers, placement, costs, parallel.balance_memory_gb,
                                       memory_of))


def _split_memory(config: PpctlConfig, layout: ParallelLayout, counts: tuple[int, ...]) -> list[int]:
    """Each pp rank's predicted bytes under the split ``counts`` (the config with that layout string instead, and
    as many layers as it holds; its schedule is the config's, kept or read again)."""
    from ppctl.plan.memory import config_memory

    split = layout_string(counts)
    candidate = replace(config, model=replace(config.model, num_layers=sum(counts)),
                        parallel=replace(config.parallel, balance="even", balance_memory_gb=None,
                                         pipeline_layout=split))
    return [parts.total for parts in config_memory(_assemble(candidate, layout, resolve_model(candidate), split))]


def stage_counts(resolved: ResolvedConfig) -> tuple[int, ...]:
    """Layers per model stage of a resolved config's split (the first model copy's stages, in model order)."""
    placement = resolved.layout.placement
    counts = [0] * placement.stages_per_copy
    for stage in resolved.layer_map.values():
        counts[placement.model_stage(stage.stage)] = len(stage.layers)
    return tuple(counts)
