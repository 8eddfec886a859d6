"""Llama's ``linear`` and ``yarn`` rotary scalings against transformers, both ways.

Tiny random ``LlamaForCausalLM`` folders with ``rope_type`` ``linear`` (factor 4) and ``yarn`` (factor 4 over an
original context of 2048, so that YaRN's ramp runs across the head's frequency pairs: ``[0, 0, 0.5, 1]``; also with
``truncate`` off and its own betas, and with its own ``attention_factor``) are read alone (``model.init_from``).
ppctl's inverse frequencies and cos/sin factor equal transformers' own formulas (``modeling_rope_utils``, run in float64
by ``tests/harness/hf_models.transformers_rope_in_float64``) to 1e-13, and its float64 logits transformers' (its
rotary angles in float64 by that same formula) to 1e-10, with the same greedy tokens; within 1e-5 with transformers'
own float32 rotary. Broken twins: YaRN without its attention factor on cos and sin, and linear without its division,
fail by far. The settings written back (``rope_parameters``) read again to the same settings, and transformers reads
them to the same frequencies. What transformers reads otherwise (``partial_rotary_factor``, a missing factor, another
``rope_type``) is refused in one line.
"""

import json
import shutil

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (LLAMA, folder_run_config, random_tokens, reference_logits, relative_error,
                                     save_tiny, transformers_logits, transformers_rope_in_float64)

EXACT = 1e-10
BROKEN = 1e-3
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                         "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn attention factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                              "attention_factor": 1.25},
    # no factor: transformers' max_position_embeddings / original_max_position_embeddings (16 / 4)
    "yarn factor null": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: save_tiny(tmp_path_factory.mktemp(name.replace(" ", "_")), LLAMA, seed=3, rope_scaling=scaling)
            for name, scaling in SCALINGS.items()}


def _scaling(config):
    """The ``RopeScaling`` ppctl's chunks are built with."""
    from ppctl.model.family import resolve_model

    return resolve_model(config).shape.rope_scaling


@pytest.mark.parametrize("name", SCALINGS)
def test_the_frequencies_and_the_cos_sin_factor_are_transformers_formulas(folders, name):
    from transformers import AutoConfig

    from ppctl.model.llama.layers import llama_inverse_frequencies

    config, hf = folder_run_config(folders[name]), AutoConfig.from_pretrained(folders[name])
    expected, attention = transformers_rope_in_float64(hf)
    scaling = _scaling(config)
    assert scaling.kind == SCALINGS[name]["rope_type"]
    ours = llama_inverse_frequencies(8, config.model.rope_theta, scaling)
    assert relative_error(ours, expected) < 1e-13
    assert scaling.cos_sin_factor == pytest.approx(attention, rel=1e-13)
    if name.startswith("yarn"):  # the ramp runs across the pairs: neither all kept nor all divided
        unscaled = llama_inverse_frequencies(8, config.model.rope_theta, None)
        assert 0 < int((ours == unscaled).sum()) < 4 and 0 < int((ours == unscaled / 4).sum()) < 4


@pytest.mark.parametrize("name", SCALINGS)
def test_logits_and_greedy_tokens_equal_transformers_in_float64(folders, name):
    tokens = random_tokens()
    ours, theirs = reference_logits(folder_run_config(folders[name]), tokens), transformers_logits(folders[name], tokens)
    assert relative_error(ours, theirs) < EXACT
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_with_transformers_own_float32_rotary_within_float32(folders):
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders["yarn"]), tokens), transformers_logits(folders["yarn"], tokens, False)) < 1e-5


BROKEN_TWINS = {"yarn without its attention factor": "yarn", "linear without its division": "linear"}


@pytest.mark.parametrize("twin", BROKEN_TWINS)
def test_a_broken_scaling_fails_the_comparison(folders, monkeypatch, twin):
    from ppctl.model.llama import layers

    name = BROKEN_TWINS[twin]
    if name == "yarn":
        monkeypatch.setattr(layers.RopeScaling, "cos_sin_factor", property(lambda self: 1.0))
    else:
        unscaled = layers.llama_inverse_frequencies
        monkeypatch.setattr(layers, "llama_inverse_frequencies",
                            lambda head_dim, theta, scaling: unscaled(head_dim, theta, None))
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders[name]), tokens), transformers_logits(folders[name], tokens)) > BROKEN


@pytest.mark.parametrize("name", SCALINGS)
def test_the_written_rope_parameters_read_back_the_same_in_ppctl_and_transformers(tmp_path, folders, name):
    from transformers import LlamaConfig

    from ppctl.model.family import resolve_model

    resolved = resolve_model(folder_run_config(folders[name]))
    written = resolved.hf.hf_config(resolved.shape)
    assert written["rope_parameters"]["rope_type"] == SCALINGS[name]["rope_type"]
    original = json.loads((folders[name] / "config.json").read_text())
    assert resolved.hf.shape_from_hf(written) == resolved.hf.shape_from_hf(original)
    ours, _ = transformers_rope_in_float64(LlamaConfig(**{k: v for k, v in written.items() if k != "architectures"}))
    theirs, _ = transformers_rope_in_float64(LlamaConfig(**{k: v for k, v in original.items()
                                                            if k not in ("architectures", "transformers_version")}))
    assert torch.equal(ours, theirs)


def _edited(tmp_path, folder, rope):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config_file = copy / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "rope_parameters": rope}))
    return copy


@pytest.mark.parametrize("rope, fragment", [
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5},
     "its rope_parameters (yarn) has partial_rotary_factor=0.5"),
    ({"rope_type": "linear", "rope_theta": 10000.0}, "its rope_parameters (linear) has no positive factor"),
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "its rope_parameters gives rope_type='dynamic'"),
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "truncate": "yes"},
     'its rope_parameters.truncate="yes" is not true, false or null'),
])
def test_what_transformers_reads_otherwise_is_refused_in_one_line(tmp_path, folders, rope, fragment):
    with pytest.raises(ConfigError) as refused:
        folder_run_config(_edited(tmp_path, folders["linear"], rope))
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_yarn_keys_without_yarn_are_refused():
    with pytest.raises(ConfigError, match="model.rope_yarn_beta_fast=8.0 is read only with"):
        validate(compose_config(["model=llama_tiny", "model.rope_scaling_factor=4.0", "model.rope_scaling_type=linear",
                                 "model.rope_yarn_beta_fast=8.0", "parallel=single"]))
