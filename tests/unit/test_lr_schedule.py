"""The learning-rate schedule equals its formulas at chosen steps; weight decay skips norms, biases, embeddings."""

import math

import pytest
import torch

from ppctl.resolve import compose_config
from ppctl.optim.grads import build_optimizer, decays
from ppctl.optim.lr import LRSchedule, learning_rate, lr_schedule_of, set_learning_rate
from ppctl.run.reference import reference_model

PEAK, MINIMUM, WARMUP, DECAY = 0.01, 0.001, 10, 110


def schedule(style: str, warmup: int = WARMUP, decay: int = DECAY) -> LRSchedule:
    return LRSchedule(peak=PEAK, minimum=MINIMUM, warmup_steps=warmup, decay_steps=decay, style=style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_starts_above_zero_and_reaches_the_peak(style):
    assert learning_rate(0, schedule(style)) == pytest.approx(PEAK / WARMUP)  # the first step: not lr 0
    assert learning_rate(4, schedule(style)) == pytest.approx(PEAK * 5 / WARMUP)
    assert learning_rate(WARMUP - 1, schedule(style)) == pytest.approx(PEAK)  # the last warm-up step
    assert learning_rate(WARMUP, schedule(style)) == pytest.approx(PEAK)  # the decay starts from the peak


def test_linear_decay_follows_its_formula():
    linear = schedule("linear")
    assert learning_rate(60, linear) == pytest.approx(MINIMUM + 0.5 * (PEAK - MINIMUM))  # ratio (60-10)/100
    assert learning_rate(35, linear) == pytest.approx(MINIMUM + 0.75 * (PEAK - MINIMUM))
    assert learning_rate(DECAY - 1, linear) == pytest.approx(MINIMUM + 0.01 * (PEAK - MINIMUM))
    assert learning_rate(DECAY, linear) == pytest.approx(MINIMUM)


def test_cosine_decay_follows_its_formula():
    cosine = schedule("cosine")
    assert learning_rate(60, cosine) == pytest.approx(MINIMUM + 0.5 * (PEAK - MINIMUM))
    quarter = 0.5 * (math.cos(math.pi * 0.25) + 1)
    assert learning_rate(35, cosine) == pytest.approx(MINIMUM + quarter * (PEAK - MINIMUM))
    last = 0.5 * (math.cos(math.pi * 0.99) + 1)
    assert learning_rate(DECAY - 1, cosine) == pytest.approx(MINIMUM + last * (PEAK - MINIMUM))
    assert learning_rate(DECAY, cosine) == pytest.approx(MINIMUM)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_after_the_decay_the_minimum_stays(style):
    for step in (DECAY, DECAY + 1, 10 * DECAY):
        assert learning_rate(step, schedule(style)) == MINIMUM
    # A run of DECAY steps (decay_steps defaults to max_steps) never wastes its last step at the minimum.
    assert learning_rate(DECAY - 1, schedule(style)) > MINIMUM


def test_constant_keeps_the_peak_after_warmup():
    constant = schedule("constant")
    assert [learning_rate(step, constant) for step in (WARMUP, 60, DECAY, 10 * DECAY)] == [PEAK] * 4


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_without_warmup_the_first_step_uses_the_peak(style):
    assert learning_rate(0, schedule(style, warmup=0)) == pytest.approx(PEAK)


def test_decay_is_monotonic_between_warmup_and_decay_steps():
    for style in ("linear", "cosine"):
        values = [learning_rate(step, schedule(style)) for step in range(WARMUP, DECAY + 1)]
        assert all(later <= earlier for earlier, later in zip(values, values[1:]))


@pytest.mark.parametrize("fields, fragment", [
    ({"style": "step"}, "style='step' must be one of constant, linear, cosine"),
    ({"peak": 0.0}, "peak=0.0 must be positive"),
    ({"minimum": -1.0}, "minimum=-1.0 must be in 0..peak"),
    ({"minimum": 1.0}, "minimum=1.0 must be in 0..peak"),
    ({"warmup_steps": -1}, "warmup_steps=-1 must be >= 0"),
    ({"decay_steps": WARMUP}, f"decay_steps={WARMUP} must be greater than warmup_steps={WARMUP}"),
])
def test_schedule_refuses_bad_fields(fields, fragment):
    values = {"peak": PEAK, "minimum": MINIMUM, "warmup_steps": WARMUP, "decay_steps": DECAY, "style": "linear"}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        LRSchedule(**{**values, **fields})


def test_negative_step_refused():
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        learning_rate(-1, schedule("linear"))


def test_schedule_of_config_defaults_decay_to_max_steps():
    config = compose_config(["optimizer.lr=0.02", "optimizer.min_lr=0.002", "optimizer.warmup_steps=5",
                             "optimizer.lr_decay_style=cosine", "trainer.max_steps=50"])
    assert lr_schedule_of(config) == LRSchedule(0.02, 0.002, 5, 50, "cosine")
    explicit = compose_config(["optimizer.decay_steps=30", "optimizer.lr_decay_style=linear"])
    assert lr_schedule_of(explicit).decay_steps == 30 and lr_schedule_of(explicit).style == "linear"


def test_default_config_keeps_a_constant_lr():
    config = compose_config([])
    assert {learning_rate(step, lr_schedule_of(config)) for step in range(config.trainer.max_steps + 5)} == {
        config.optimizer.lr}


def test_set_learning_rate_reaches_every_group():
    optimizer = build_optimizer([reference_model(compose_config(["parallel=single"]))],
                                compose_config([]).optimizer)
    set_learning_rate(optimizer, 0.123)
    assert [group["lr"] for group in optimizer.param_groups] == [0.123] * len(optimizer.param_groups)


# ---------------------------------------------------------------------------
# Weight decay
# ---------------------------------------------------------------------------


def optimizer_settings(*overrides):
    return compose_config(list(overrides)).optimizer


MATRIX, VECTOR = torch.zeros(4, 4), torch.zeros(4)


def _with_rule(name: str, param: torch.Tensor) -> torch.Tensor:
    """``param`` (a fresh copy) carrying the GPT rule of ``name``, as a chunk attaches it."""
    from ppctl.model.gpt.rules import gpt_rule
    from ppctl.model.rules import RULE_ATTRIBUTE

    param = torch.nn.Parameter(param.clone())
    setattr(param, RULE_ATTRIBUTE, gpt_rule(name))
    return param


@pytest.mark.parametrize("name, param, expected", [
    ("layers.0.attention.qkv.weight", MATRIX, True),
    ("layers.3.mlp.fc_out.weight", MATRIX, True),
    ("layers.0.attention.proj.bias", VECTOR, False),
    ("layers.0.attn_norm.weight", VECTOR, False),
    ("final_norm.bias", VECTOR, False),
    ("embedding.word.weight", MATRIX, False),
    ("embedding.position.weight", MATRIX, False),
    ("output_layer.weight", MATRIX, False),
])
def test_decays_matrices_but_not_norms_biases_or_embeddings(name, param, expected):
    assert decays(name, _with_rule(name, param), optimizer_settings()) is expected


@pytest.mark.parametrize("name, param, expected", [
    ("embedding.word.weight", MATRIX, True),
    ("embedding.position.weight", MATRIX, True),
    ("output_layer.weight", MATRIX, True),
    ("layers.0.mlp_norm.weight", VECTOR, False),  # norms and biases never decay
    ("layers.0.mlp.fc_in.bias", VECTOR, False),
])
def test_decay_embeddings_includes_the_embeddings_only(name, param, expected):
    assert decays(name, _with_rule(name, param), optimizer_settings("optimizer.decay_embeddings=true")) is expected


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_build_optimizer_groups_follow_decays(decay_embeddings):
    config = compose_config(["parallel=single", "model.tie_embeddings=false",
                             f"optimizer.decay_embeddings={str(decay_embeddings).lower()}"])
    model = reference_model(config)
    decayed, plain = build_optimizer([model], config.optimizer).param_groups
    assert decayed["weight_decay"] == config.optimizer.weight_decay and plain["weight_decay"] == 0.0
    names_of = {id(param): name for name, param in model.named_parameters()}
    embeddings = {"embedding.word.weight", "embedding.position.weight", "output_layer.weight"}
    decayed_names = {names_of[id(param)] for param in decayed["params"]}
    assert decayed_names == {name for name, param in model.named_parameters()
                             if param.dim() >= 2 and (decay_embeddings or name not in embeddings)}
    assert (embeddings <= decayed_names) is decay_embeddings
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
