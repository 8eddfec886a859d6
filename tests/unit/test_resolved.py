"""The config resolved once (``ppctl.resolve.resolved``): what it holds, that it is frozen, and that it travels.

A ``ResolvedConfig`` is built once per command and once per worker and passed down; these tests check that its
parts are those of the config (layout and schedule placement, the split into stages, sizes), that its config can
no longer be assigned to, and that it pickles (the worker pools' arguments) to the same objects.
"""

import dataclasses
import pickle

import pytest

from ppctl.config import ConfigError, PpctlConfig
from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve, stage_counts
from ppctl.config.schema import FrozenConfigError, Section

LAYOUTS = [
    ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "model.num_layers=4"],
    ["schedule=interleaved_1f1b", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=8"],
    ["schedule=dualpipev", "parallel.pp=2", "model.num_layers=8", "parallel.balance=auto"],
    ["schedule=dualpipe", "parallel.pp=4", "model.num_layers=8", "trainer.global_batch_size=16"],
    ["parallel.pp=2", "parallel.pipeline_layout=Et|tttL", "model.num_layers=4"],
]


@pytest.mark.parametrize("overrides", LAYOUTS, ids=lambda overrides: " ".join(overrides))
def test_the_parts_are_the_configs(overrides):
    run = resolve(compose_config(["data=synthetic", *overrides]))
    config, layout = run.config, run.layout
    assert (layout.tp, layout.pp, layout.dp, layout.vpp) == (config.parallel.tp, config.parallel.pp,
                                                             config.parallel.dp, config.parallel.vpp)
    assert run.schedule.placement == layout.placement and run.schedule.name == config.schedule.name
    assert run.schedule.num_microbatches == run.sizes.num_microbatches
    held = sorted(layer for stage in run.layer_map.values() for layer in stage.layers)
    assert held == sorted(list(range(config.model.num_layers)) * layout.placement.copies)
    assert sum(stage_counts(run)) == config.model.num_layers
    for pp_rank in range(layout.pp):
        assert [stage.stage for stage in run.rank_stages(pp_rank)] == sorted(layout.placement.stages_of(pp_rank))
    assert run.sizes.world_size == layout.world_size and run.model.padded_vocab_size >= config.model.vocab_size


def test_the_split_is_the_configured_one_or_balance_autos():
    assert resolve(compose_config(["parallel.pp=2", "parallel.pipeline_layout=Et|tttL",
                                   "model.num_layers=4"])).pipeline_layout == "Et|tttL"
    auto = resolve(compose_config(["parallel.pp=2", "model.num_layers=8", "parallel.balance=auto",
                                   "model.vocab_size=50257"]))
    assert auto.pipeline_layout.count("t") == 8 and stage_counts(auto)[0] > stage_counts(auto)[1]  # the loss's


def test_a_resolved_config_is_read_only_and_a_changed_copy_is_resolved_anew():
    config = compose_config(["data=synthetic", "parallel.pp=2"])
    config.trainer.max_steps = 7  # composing: still a draft
    run = resolve(config)
    with pytest.raises(FrozenConfigError, match=r"TrainerConfig.out_dir: the config was resolved and is read-only"):
        run.config.trainer.out_dir = "elsewhere"
    with pytest.raises(FrozenConfigError):
        run.config.parallel = run.config.parallel
    changed = dataclasses.replace(run.config, trainer=dataclasses.replace(run.config.trainer, max_steps=9))
    changed.trainer.seed = 3  # a copy is a new draft
    assert resolve(changed).config.trainer.max_steps == 9 and run.config.trainer.max_steps == 7


def test_every_section_of_the_schema_is_frozen_with_its_config():
    def sections(kind):
        yield kind
        for field in dataclasses.fields(kind):
            if isinstance(field.type, type) and dataclasses.is_dataclass(field.type):
                yield from sections(field.type)

    config = resolve(compose_config(["data=synthetic"])).config
    for name in ("model", "parallel", "schedule", "data", "optimizer", "trainer", "launcher"):
        assert isinstance(getattr(config, name), Section)
        with pytest.raises(FrozenConfigError):
            setattr(getattr(config, name), "marker", 1)
    with pytest.raises(FrozenConfigError):
        config.launcher.slurm.partition = "gpu"
    assert issubclass(PpctlConfig, Section)


def test_it_pickles_to_the_same_objects():
    run = resolve(compose_config(["data=synthetic", "schedule=dualpipev", "parallel.pp=2", "model.num_layers=8",
                                  "parallel.balance=auto"]))
    copy = pickle.loads(pickle.dumps(run))
    assert copy.layout == run.layout and dict(copy.layer_map) == dict(run.layer_map)
    assert copy.pipeline_layout == run.pipeline_layout and copy.sizes == run.sizes
    assert copy.schedule.actions == run.schedule.actions
    with pytest.raises(FrozenConfigError):
        copy.config.trainer.seed = 1


def test_layers_that_do_not_split_are_refused_unless_only_the_schedule_is_asked_for():
    with pytest.raises(ConfigError, match="model.num_layers=4 must be divisible"):
        resolve(compose_config(["schedule=dualpipev", "parallel.pp=4"]))
    drawn = resolve(compose_config(["schedule=dualpipev", "parallel.pp=4"]), layer_split=False)
    assert not drawn.layer_map and "model.num_layers=4" in drawn.split_problem
    assert drawn.schedule.pp == 4
    assert not pickle.loads(pickle.dumps(drawn)).layer_map
