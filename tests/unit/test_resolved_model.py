"""The model resolved once, by its family (``ppctl.model.family.resolve_model``), and read from the resolved config.

For every preset in ``conf/model/`` at a few tp sizes, ``ResolvedConfig.model`` holds the family ``model.family``
names, the vocabulary padded by Megatron's rule, the memory shape the memory model and the planner read (as the
planner computed it from the raw config before the family resolved it), and the family's own shape with the same
padded vocabulary; the resolution runs once per ``resolve`` and its readers share the one object. Validation asks
the family's Hugging Face capabilities, not its name.
"""

import math
from pathlib import Path

import pytest

from ppctl.config import ConfigError, ModelConfig, PpctlConfig
from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.model import family as family_module
from ppctl.model.family import ModelFamily, ResolvedModel, installed_families, resolve_model
from ppctl.model.memory_shape import ModelShape
from ppctl.model.moe.shape import moe_shape_of

PRESETS = sorted(path.stem for path in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml"))
ARCHITECTURES = {family.name: family.architecture for family in installed_families()}


def preset_config(preset: str, tp: int):
    """A single-stage config of ``preset`` at ``tp`` (sequence-parallel at tp > 1, as experts need)."""
    return compose_config([f"model={preset}", "data=synthetic", "parallel=single", f"parallel.tp={tp}",
                           f"parallel.sequence_parallel={str(tp > 1).lower()}"])


def expected_memory_shape(config) -> ModelShape:
    """The memory shape as ``ppctl.plan.memory.model_shape`` built it from the raw config before issue 55."""
    model, architecture = config.model, ARCHITECTURES[config.model.family]
    multiple = model.make_vocab_size_divisible_by * config.parallel.tp
    return ModelShape(hidden=model.hidden_size, heads=model.num_heads, ffn=model.ffn_hidden_size,
                      padded_vocab=math.ceil(model.vocab_size / multiple) * multiple,
                      max_seq_length=model.max_seq_length, learned_positions=model.position_embedding == "learned",
                      rotary=model.position_embedding == "rope", tie_embeddings=model.tie_embeddings,
                      kv_heads=getattr(model, "num_kv_heads", None), head_dim=getattr(model, "head_dim", None),
                      norm_has_bias=architecture.norm_has_bias, gated_mlp=architecture.gated_mlp,
                      linear_biases=architecture.linear_biases, fused_qkv=architecture.fused_qkv,
                      qkv_bias=model.qkv_bias, vocab=model.vocab_size, moe=moe_shape_of(model))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_resolves_to_its_family_shapes_and_padded_vocabulary(preset, tp):
    run = resolve(preset_config(preset, tp), data=False, prove_schedule=False)
    model, config = run.model, run.config
    assert isinstance(model, ResolvedModel) and model.family.name == config.model.family
    assert model.memory_shape == expected_memory_shape(config)
    padded = model.memory_shape.padded_vocab
    assert model.padded_vocab_size == padded and not hasattr(run.sizes, "padded_vocab_size")  # the model's alone
    assert padded % (config.model.make_vocab_size_divisible_by * tp) == 0 and padded >= config.model.vocab_size
    assert model.moe == moe_shape_of(config.model)


@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny", "mixtral_tiny"])
def test_the_family_shape_and_rules_follow_the_resolved_model(preset):
    run = resolve(preset_config(preset, 2), data=False, prove_schedule=False)
    shape, settings = run.model.shape, run.config.model
    assert shape.padded_vocab_size == run.model.padded_vocab_size and shape.vocab_size == settings.vocab_size
    assert (shape.num_layers, shape.hidden_size, shape.moe) == (settings.num_layers, settings.hidden_size,
                                                                  run.model.moe)
    assert run.model.shape is shape  # built once, then kept
    assert run.model.rules("embedding.word.weight").vocab_rows  # the family's rules, of its resolved shape
    assert run.model.hf is not None and (run.model.hf_moe_architecture is not None) == (preset != "gpt_tiny")


def test_resolve_resolves_the_model_once(monkeypatch):
    calls = []
    original = family_module.ResolvedModel

    def counted(*args, **kwargs):
        calls.append(kwargs.get("settings"))
        return original(*args, **kwargs)

    monkeypatch.setattr(family_module, "ResolvedModel", counted)
    run = resolve(compose_config(["data=synthetic", "parallel.pp=2", "model.num_layers=4"]), data=False)
    assert len(calls) == 1 and run.model.settings is run.config.model
    assert resolve(run.config, check=False).model == run.model  # an equal one, from the same settings


def test_an_unknown_family_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="model.family='bert' must be one of .*gpt, .*llama"):
        compose_config(["data=synthetic", "model.family=bert"])  # composing picks the family's settings
    config = PpctlConfig(model=ModelConfig(family="bert"))
    with pytest.raises(ConfigError, match="model.family='bert' must be one of .*gpt, .*llama"):
        resolve_model(config)


def test_validation_asks_the_formats_capability_not_the_family_name(monkeypatch):
    """A family whose format reads a mixture of experts may start one from a folder whatever its name; one whose
    format has none is refused, naming the formats that have one."""
    from ppctl.resolve.validate import _check_moe_layout

    config = compose_config(["model=mixtral_tiny", "data=synthetic", "parallel=single", "model.init_from=/folder"])
    llama = resolve_model(config)
    renamed = ResolvedModel(ModelFamily("renamed", llama.family.shape_of, llama.family.chunk_class,
                                        llama.family.rule_of_name, hf=llama.family.hf), llama.settings, 1)
    _check_moe_layout(config, renamed)  # not refused: its format reads Mixtral
    no_format = ResolvedModel(ModelFamily("plain", llama.family.shape_of, llama.family.chunk_class,
                                          llama.family.rule_of_name), llama.settings, 1)
    with pytest.raises(ConfigError, match=r"this family's Hugging Face format reads no mixture of experts \(ppctl "
                                          r"reads them as MixtralForCausalLM \(model.family=llama\) or "
                                          r"Qwen2MoeForCausalLM/Qwen3MoeForCausalLM \(model.family=qwen_moe\)\)"):
        _check_moe_layout(config, no_format)
