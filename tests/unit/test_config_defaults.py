"""Defaults live in one place: the schema dataclasses; the YAML options hold only what they change,
and the key table of docs/configuration.md is generated from the schema."""

import dataclasses
from pathlib import Path

import pytest

from ppctl.config import PpctlConfig, fill_unset
from ppctl.resolve import PACKAGE_CONF_DIR, compose_config, config_reference, config_reference_table, render_default

from ppctl.model.family import family_own_keys, family_settings

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TABLE_START, TABLE_END = "<!-- config-table:start -->\n", "<!-- config-table:end -->"

# What each shipped group option changes relative to the default composition, recorded from the
# full YAML files before the defaults moved into the schema (an empty dict: the option is the default).
OPTION_CHANGES = {
    "model=gpt_tiny": {},
    "model=gpt_small": {"model.name": "gpt_small", "model.num_layers": 12, "model.hidden_size": 768,
                        "model.num_heads": 12, "model.ffn_hidden_size": 3072, "model.max_seq_length": 1024,
                        "model.tie_embeddings": True},
    "model=llama_tiny": {"model.name": "llama_tiny", "model.family": "llama", "model.num_kv_heads": 2,
                         "model.ffn_hidden_size": 192, "model.position_embedding": "rope"},
    "model=llama3_1b": {"model.name": "llama3_1b", "model.family": "llama", "model.num_layers": 16,
                        "model.hidden_size": 2048, "model.num_heads": 32, "model.num_kv_heads": 8, "model.head_dim": 64,
                        "model.ffn_hidden_size": 8192, "model.vocab_size": 128256, "model.max_seq_length": 131072,
                        "model.position_embedding": "rope", "model.rope_theta": 500000.0,
                        "model.rope_scaling_factor": 32.0, "model.tie_embeddings": True},
    "model=llama3_8b": {"model.name": "llama3_8b", "model.family": "llama", "model.num_layers": 32,
                        "model.hidden_size": 4096, "model.num_heads": 32, "model.num_kv_heads": 8,
                        "model.head_dim": 128, "model.ffn_hidden_size": 14336, "model.vocab_size": 128256,
                        "model.max_seq_length": 131072, "model.position_embedding": "rope",
                        "model.rope_theta": 500000.0, "model.rope_scaling_factor": 8.0},
    "model=mixtral_tiny": {"model.name": "mixtral_tiny", "model.family": "llama", "model.num_kv_heads": 2,
                           "model.ffn_hidden_size": 128, "model.position_embedding": "rope",
                           "model.moe.num_experts": 8, "model.moe.topk": 2, "model.moe.router_topk_norm": True,
                           "model.moe.aux_loss_coeff": 0.02},
    "model=deepseek_tiny": {"model.name": "deepseek_tiny", "model.family": "llama", "model.num_kv_heads": 2,
                            "model.ffn_hidden_size": 192, "model.position_embedding": "rope",
                            "model.moe.num_experts": 8, "model.moe.topk": 2, "model.moe.expert_ffn_hidden_size": 48,
                            "model.moe.first_dense_layers": 1, "model.moe.shared_experts": 1,
                            "model.moe.router_score": "sigmoid", "model.moe.router_topk_norm": True,
                            "model.moe.expert_bias": True},
    "model=mixtral_8x7b": {"model.name": "mixtral_8x7b", "model.family": "llama", "model.num_layers": 32,
                           "model.hidden_size": 4096, "model.num_heads": 32, "model.num_kv_heads": 8,
                           "model.ffn_hidden_size": 14336, "model.vocab_size": 32000, "model.max_seq_length": 32768,
                           "model.position_embedding": "rope", "model.rope_theta": 1000000.0,
                           "model.moe.num_experts": 8, "model.moe.topk": 2, "model.moe.router_topk_norm": True,
                           "model.moe.aux_loss_coeff": 0.02},
    "model=deepseek_v2_lite": {"model.name": "deepseek_v2_lite", "model.family": "llama", "model.num_layers": 27,
                               "model.hidden_size": 2048, "model.num_heads": 16, "model.head_dim": 128,
                               "model.ffn_hidden_size": 10944, "model.vocab_size": 102400,
                               "model.max_seq_length": 32768, "model.position_embedding": "rope",
                               "model.moe.num_experts": 64, "model.moe.topk": 6,
                               "model.moe.expert_ffn_hidden_size": 1408, "model.moe.first_dense_layers": 1,
                               "model.moe.shared_experts": 2, "model.moe.aux_loss_coeff": 0.001},
    "model=mistral_tiny": {"model.name": "mistral_tiny", "model.family": "mistral", "model.num_kv_heads": 2,
                           "model.ffn_hidden_size": 192, "model.position_embedding": "rope"},
    "model=phi3_tiny": {"model.name": "phi3_tiny", "model.family": "phi3", "model.num_kv_heads": 2,
                        "model.ffn_hidden_size": 192, "model.position_embedding": "rope"},
    "model=gpt_neox_tiny": {"model.name": "gpt_neox_tiny", "model.family": "gpt_neox", "model.qkv_bias": True,
                            "model.position_embedding": "rope", "model.parallel_residual": True,
                            "model.partial_rotary_factor": 0.25},
    "model=qwen3_tiny": {"model.name": "qwen3_tiny", "model.family": "qwen3", "model.num_kv_heads": 2,
                         "model.head_dim": 32, "model.ffn_hidden_size": 192, "model.position_embedding": "rope",
                         "model.norm_epsilon": 1e-6},
    "model=qwen2_moe_tiny": {"model.name": "qwen2_moe_tiny", "model.family": "qwen_moe", "model.num_kv_heads": 2,
                             "model.ffn_hidden_size": 128, "model.position_embedding": "rope",
                             "model.norm_epsilon": 1e-6, "model.qkv_bias": True, "model.moe.num_experts": 4,
                             "model.moe.topk": 2, "model.moe.expert_ffn_hidden_size": 32,
                             "model.moe.first_dense_layers": 1, "model.moe.shared_experts": 2,
                             "model.moe.shared_expert_gate": True, "model.moe.aux_loss_coeff": 0.001},
    "model=qwen3_moe_tiny": {"model.name": "qwen3_moe_tiny", "model.family": "qwen_moe", "model.num_kv_heads": 2,
                             "model.head_dim": 32, "model.ffn_hidden_size": 128, "model.position_embedding": "rope",
                             "model.norm_epsilon": 1e-6, "model.qk_norm": True, "model.moe.num_experts": 8,
                             "model.moe.topk": 2, "model.moe.expert_ffn_hidden_size": 32,
                             "model.moe.router_topk_norm": True, "model.moe.aux_loss_coeff": 0.001},
    "model=gemma_tiny": {"model.name": "gemma_tiny", "model.family": "gemma", "model.num_kv_heads": 2,
                         "model.head_dim": 32, "model.ffn_hidden_size": 192, "model.position_embedding": "rope",
                         "model.tie_embeddings": True, "model.norm_epsilon": 1e-6},
    "model=olmo2_tiny": {"model.name": "olmo2_tiny", "model.family": "olmo2", "model.num_kv_heads": 2,
                         "model.ffn_hidden_size": 192, "model.position_embedding": "rope", "model.norm_epsilon": 1e-6},
    "parallel=default": {},
    "parallel=single": {"parallel.pp": 1},
    "parallel=tp2_pp2_dp2": {"parallel.tp": 2, "parallel.dp": 2},
    "schedule=1f1b": {},
    "schedule=gpipe": {"schedule.name": "gpipe"},
    "schedule=pipedream_flush": {"schedule.name": "pipedream_flush"},
    "schedule=pipedream_2bw": {"schedule.name": "pipedream_2bw"},
    "schedule=interleaved_1f1b": {"schedule.name": "interleaved_1f1b"},
    "schedule=zb_h1": {"schedule.name": "zb_h1"},
    "schedule=looped_bfs": {"schedule.name": "looped_bfs"},
    "schedule=interleaved_zb": {"schedule.name": "interleaved_zb"},
    "schedule=custom": {"schedule.name": "custom"},
    "schedule=hanayo": {"schedule.name": "hanayo", "parallel.vpp": 2},  # 2 * waves (1 unset)  # with no schedule.file yet: vpp 1
    "schedule=zbv": {"schedule.name": "zbv", "parallel.vpp": 2},  # vpp follows the placement
    "schedule=v_half": {"schedule.name": "v_half", "parallel.vpp": 2},
    "schedule=v_min": {"schedule.name": "v_min", "parallel.vpp": 2},
    "schedule=dualpipe": {"schedule.name": "dualpipe", "parallel.vpp": 2},  # vpp follows the placement
    "schedule=dualpipev": {"schedule.name": "dualpipev", "parallel.vpp": 2},  # vpp follows the placement
    "data=python_stdlib": {},
    "data=synthetic": {"data.source": "synthetic"},
    "data=text": {"data.source": "text"},
    "data=indexed": {"data.source": "indexed"},
    "data=chat": {"data.source": "chat", "data.documents": "separate"},
    "data=prompt_completion": {"data.source": "prompt_completion", "data.documents": "separate"},
    "optimizer=adamw": {},
    "launcher=local": {},
    "launcher=slurm": {"launcher.kind": "slurm"},
}

# The effective defaults of the shipped composition before this change (spot checks of the old disagreements).
KNOWN_DEFAULTS = {"optimizer.lr": 0.003, "parallel.pp": 2, "model.name": "gpt_tiny", "schedule.name": "1f1b",
                  "data.source": "python_stdlib", "trainer.max_steps": 200, "launcher.timeout_s": 120,
                  "model.norm_epsilon": 1e-5, "optimizer.eps": 1e-8, "data.eod_mask_loss": False}


def flat(config: PpctlConfig) -> dict:
    """``{"section.key": value}`` of a config (a nested section's as ``section.sub.key``)."""
    return dict(_flat_items("", dataclasses.asdict(config)))


def _flat_items(prefix: str, values: dict):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flat_items(f"{prefix}{key}.", value)
        else:
            yield f"{prefix}{key}", value


def schema_defaults(family: str = "gpt") -> PpctlConfig:
    """The schema's defaults, ``model.family=family`` with that family's own keys at their defaults, with the
    settings it leaves unset filled as composing fills them."""
    config = PpctlConfig()
    config.model = family_settings(dataclasses.replace(config.model, family=family))
    fill_unset(config)
    return config


def test_default_composition_equals_the_schema_defaults():
    assert flat(compose_config([])) == flat(schema_defaults())


def test_schema_defaults_keep_the_shipped_values():
    defaults = flat(schema_defaults())
    assert {key: defaults[key] for key in KNOWN_DEFAULTS} == KNOWN_DEFAULTS


def test_every_shipped_option_is_in_the_table():
    shipped = {f"{path.parent.name}={path.stem}" for path in PACKAGE_CONF_DIR.glob("*/*.yaml")}
    assert shipped == set(OPTION_CHANGES)


@pytest.mark.parametrize("option", sorted(OPTION_CHANGES))
def test_each_option_composes_as_before(option):
    family = OPTION_CHANGES[option].get("model.family", "gpt")
    expected = {**flat(schema_defaults(family)), **OPTION_CHANGES[option]}
    assert flat(compose_config([option])) == expected


def test_key_overrides_still_win_over_options():
    config = compose_config(["parallel=single", "parallel.pp=4", "model=gpt_small", "model.vocab_size=300"])
    assert config.parallel.pp == 4 and config.model.vocab_size == 300 and config.model.num_layers == 12


def test_every_field_is_documented_once_in_one_line():
    rows = config_reference()
    own = [f"model.{item.name}" for item, _ in family_own_keys()]
    assert sorted(key for key, _, _ in rows) == sorted([*flat(PpctlConfig()), *own])
    for key, _, doc in rows:
        assert doc.strip() and "\n" not in doc, key


@pytest.mark.parametrize("value, text", [
    (None, "null"), (True, "true"), (False, "false"), (4, "4"), (0.003, "0.003"), (1.0, "1.0"),
    (1e-5, "1e-5"), (1e-8, "1e-8"), ("fp32", "`fp32`"),
])
def test_defaults_render_as_in_the_reference(value, text):
    assert render_default(value) == text


def test_table_escapes_pipes_and_has_one_row_per_field():
    table = config_reference_table()
    lines = table.splitlines()
    assert lines[:2] == ["| key | default | meaning |", "|---|---|---|"]
    assert len(lines) == 2 + len(config_reference())
    assert r"`Ettt\|tttt\|tttL`" in table


def test_reference_table_is_the_generated_one():
    text = REFERENCE.read_text()
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    between = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert between == config_reference_table(), "docs/configuration.md table drifted: regenerate it with python -m ppctl.resolve"
