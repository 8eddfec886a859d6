"""Each family's own ``model.*`` keys in its own class (``ppctl.model.family``): composition accepts every installed
family's keys, keeps the selected family's, refuses another family's key that is set, and reads a run directory's
``config.yaml`` written before the keys moved (one flat section holding every family's keys) into the same
classes, so that an old run resumes."""

import dataclasses
from pathlib import Path

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, load_config_file, to_yaml
from ppctl.resolve.resolved import resolve
from ppctl.model import family as family_module
from ppctl.model.family import ModelFamily, family_settings, installed_families, settings_schema
from ppctl.model.gpt.settings import GPTSettings
from ppctl.model.llama.settings import LlamaSettings

OLD_CONFIGS = Path(__file__).resolve().parent / "old_run_configs"


def test_the_composed_model_is_its_familys_class_with_its_keys_only():
    llama = compose_config(["model=llama_tiny", "data=synthetic"]).model
    gpt = compose_config(["data=synthetic"]).model
    assert type(llama) is LlamaSettings and llama.num_kv_heads == 2 and not hasattr(llama, "activation")
    assert type(gpt) is GPTSettings and gpt.activation == "gelu" and not hasattr(gpt, "rope_scaling_factor")


def test_a_config_yaml_holds_the_familys_keys_only():
    text = to_yaml(compose_config(["data=synthetic"]))
    assert "activation: gelu" in text and "rope_scaling_factor" not in text and "head_dim" not in text


@pytest.mark.parametrize("overrides, message", [
    (["model.rope_scaling_factor=8.0"], "model.rope_scaling_factor=8.0 is read by model.family="),
    (["model=llama_tiny", "model.activation=gelu_tanh"], "model.activation=gelu_tanh is read by model.family=gpt"),
])
def test_another_familys_key_set_is_refused_naming_its_readers(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        compose_config(["data=synthetic", *overrides])
    assert "\n" not in str(refused.value) and "drop the key" in str(refused.value)


def test_another_familys_key_at_its_default_means_not_used():
    config = compose_config(["data=synthetic", "model.rope_scaling_factor=null", "model.head_dim=null"])
    assert type(config.model) is GPTSettings


@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny"])
def test_an_old_run_directorys_config_yaml_reads_as_its_family_and_resolves_the_same(preset):
    old = load_config_file(OLD_CONFIGS / f"{preset}.yaml")
    now = compose_config([f"model={preset}", "data=synthetic"])
    assert type(old.model) is type(now.model) and old == now
    assert resolve(old, data=False).model.memory_shape == resolve(now, data=False).model.memory_shape


def test_an_old_config_yaml_with_another_familys_key_set_is_refused(tmp_path):
    text = (OLD_CONFIGS / "llama_tiny.yaml").read_text().replace("activation: gelu", "activation: gelu_tanh")
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match="model.activation=gelu_tanh is read by model.family=gpt"):
        load_config_file(tmp_path / "config.yaml")


def test_a_hand_built_config_resolves_to_its_familys_class():
    config = dataclasses.replace(compose_config(["data=synthetic"]))
    config.model = family_settings(dataclasses.replace(GPTSettings(), family="llama", position_embedding="rope"))
    assert type(config.model) is LlamaSettings and config.model.num_kv_heads is None


def test_the_schema_accepts_every_familys_keys_once():
    names = [item.name for item in dataclasses.fields(settings_schema())]
    assert len(names) == len(set(names))
    for family in installed_families():
        assert {item.name for item in dataclasses.fields(family.settings)} <= set(names), family.name


def test_two_families_declaring_one_key_differently_is_a_mistake_caught(monkeypatch):
    @dataclasses.dataclass
    class Clashing(GPTSettings):
        num_kv_heads: str = "two"

    clash = ModelFamily(name="clash", shape_of=None, chunk_class=None, rule_of_name=None, settings=Clashing)
    monkeypatch.setattr(family_module, "installed_families", lambda: (*installed_families(), clash))
    settings_schema.cache_clear()
    try:
        with pytest.raises(TypeError, match="model.num_kv_heads is declared by several families"):
            settings_schema()
    finally:
        settings_schema.cache_clear()
