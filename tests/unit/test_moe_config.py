"""``model.moe``'s rules, each refused in one line before anything starts; a dense run reads none of its keys.

The base config is composed once (Hydra's composition is the slow part) and each case changes a copy of it.
"""

import copy

import pytest

from ppctl.config import ConfigError, compose_config, validate
from ppctl.model.moe.shape import moe_shape_of


@pytest.fixture(scope="module")
def moe_config():
    return compose_config(["model=mixtral_tiny", "data=synthetic", "parallel=single"])


def changed(config, **settings):
    """A copy of ``config`` with ``section.key`` (``moe.topk``, ``parallel.tp``...) settings, as ``a__b`` names."""
    config = copy.deepcopy(config)
    for path, value in settings.items():
        *sections, key = path.split("__")
        target = config
        for section in sections:
            target = getattr(target, section)
        setattr(target, key, value)
    return config


RULES = [
    (dict(model__moe__topk=9), "model.moe.topk=9 must be between 1 and model.moe.num_experts=8"),
    (dict(model__moe__topk=0), "model.moe.topk=0 must be between 1 and model.moe.num_experts=8"),
    (dict(model__moe__num_experts=-1), "model.moe.num_experts=-1 must be >= 0"),
    (dict(model__moe__num_experts=0), "model.moe.router_topk_norm=True is read only with experts: set "
                                      "model.moe.num_experts > 0"),
    (dict(model__moe__expert_ffn_hidden_size=0), "model.moe.expert_ffn_hidden_size=0 must be a positive integer"),
    (dict(model__moe__layer_freq=0), "model.moe.layer_freq=0 must be a positive integer"),
    (dict(model__moe__first_dense_layers=4), "model.moe.first_dense_layers=4 must be in 0..model.num_layers-1=3"),
    (dict(model__moe__first_dense_layers=-1), "model.moe.first_dense_layers=-1 must be in 0..model.num_layers-1=3"),
    (dict(model__moe__shared_experts=-1), "model.moe.shared_experts=-1 must be >= 0"),
    (dict(model__moe__router_score="relu"), "model.moe.router_score='relu' must be one of softmax, sigmoid"),
    (dict(model__moe__aux_loss_coeff=-0.1), "model.moe.aux_loss_coeff=-0.1 must be >= 0"),
    (dict(model__moe__z_loss_coeff=-1.0), "model.moe.z_loss_coeff=-1.0 must be >= 0"),
    (dict(model__moe__expert_bias_update_rate=0.0), "model.moe.expert_bias_update_rate=0.0 must be positive"),
    (dict(model__moe__capacity_factor=0.0), "model.moe.capacity_factor=0.0 must be positive, or unset"),
    (dict(model__moe__drop_policy="random"), "model.moe.drop_policy='random' must be one of probs, position"),
    (dict(parallel__tp=2), "parallel.tp=2 with model.moe.num_experts=8: MoE runs at tp=1 cp=1 until expert "
                           "parallelism lands (issue 45)"),
    (dict(parallel__cp=2), "parallel.cp=2 with model.moe.num_experts=8: MoE runs at tp=1 cp=1"),
    (dict(model__init_from="/some/mixtral"), "model.init_from with model.moe.num_experts=8: ppctl reads dense"),
]


@pytest.mark.parametrize("settings, fragment", RULES, ids=[fragment.split(" ")[0] for _, fragment in RULES])
def test_each_moe_rule_refuses_in_one_line(moe_config, settings, fragment):
    with pytest.raises(ConfigError) as error:
        validate(changed(moe_config, **settings), data=False, prove_schedule=False)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_moe_refuses_sequence_parallelism_and_a_stream_of_steps(moe_config):
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=True with model.moe.num_experts=8"):
        validate(changed(moe_config, parallel__sequence_parallel=True), data=False, prove_schedule=False)
    stream = changed(moe_config, schedule__name="pipedream_2bw", parallel__pp=2, optimizer__gradient_delay=1,
                     optimizer__clip_grad=0.0)
    with pytest.raises(ConfigError, match="schedule pipedream_2bw streams steps with no barrier"):
        validate(stream, data=False, prove_schedule=False)


def test_the_layers_the_settings_route():
    config = compose_config(["model=deepseek_tiny", "model.num_layers=8", "model.moe.layer_freq=3"])
    shape = moe_shape_of(config.model)
    assert shape.layer_ids(8) == (1, 4, 7)
    assert shape.expert_ffn_hidden_size == 48 and shape.shared_ffn_hidden_size == 48
    assert moe_shape_of(compose_config(["model=llama_tiny"]).model) is None
