"""The Gemma family against ``transformers``: read, decoded and written with transformers' logits; Gemma 2 refused.

Tiny random ``GemmaForCausalLM`` folders saved locally (``tests/harness/hf_models.py``): grouped-query attention
with a head width of 16 beside hidden / heads = 8 (tied, as Gemma's default), and multi-query attention (one
key/value head, untied). Started from the folder alone (``model.init_from``), ppctl's float64 model gives
transformers' logits to 1e-10 relative with transformers' RMSNorm and rotary angles in float64 (it computes both in
float32 whatever the model's dtype), its greedy tokens are transformers' ``generate``'s, and its tensors written back
(``to_hf_tensors``, ``hf_config``) are a folder transformers reads with the same logits. Broken twins of Gemma's three
hooks (the norm without its ``+ 1``, the embeddings unscaled, SiLU for the tanh GELU) must fail. ``config.json`` is
read with ``GemmaConfig``'s defaults (a head width of 256, 16 key/value heads, tied) and its rewrite of ``"gelu"``
to the tanh GELU, compared with transformers' own config object; Gemma 2 and what Gemma does not compute are refused
in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from ppctl.config import ConfigError
from tests.harness.hf_models import (GEMMA, KV_HEADS, folder_run_config, greedy_matches_transformers, hf_config,
                                     random_tokens, reference_logits, relative_error, save_random, save_tiny,
                                     transformers_logits, written_back_equals_the_folder)

EXACT = 1e-10
FLOAT32_LOGITS = 1e-6  # transformers' generate hands out float32 logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{name: folder}``: the tiny Gemma (GQA, tied) and its multi-query twin (one key/value head, untied)."""
    from transformers import GemmaConfig

    root = tmp_path_factory.mktemp("gemma")
    multi_query = GemmaConfig(**{**hf_config(GEMMA, False).to_dict(), "num_key_value_heads": 1})
    return {"gqa_tied": save_tiny(root / "gqa", GEMMA, tie=True, seed=3),
            "mqa_untied": save_random(root / "mqa", multi_query, seed=4)}


@pytest.mark.parametrize("name", ["gqa_tied", "mqa_untied"])
def test_logits_equal_transformers_in_float64(folders, name):
    config, tokens = folder_run_config(folders[name]), random_tokens()
    assert config.model.family == "gemma" and config.model.head_dim == 16
    assert config.model.num_kv_heads == (KV_HEADS if name == "gqa_tied" else 1)
    assert relative_error(reference_logits(config, tokens), transformers_logits(folders[name], tokens)) < EXACT


def test_with_transformers_own_float32_norms_within_float32(folders):
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders["gqa_tied"]), tokens),
                          transformers_logits(folders["gqa_tied"], tokens, exact=False)) < 1e-5


def test_greedy_tokens_equal_transformers_generate(folders):
    """The model read from the folder decodes through its KV cache (``ppctl generate``'s ``generate_ids``) to
    transformers' greedy tokens, its step logits to float32 rounding."""
    greedy_matches_transformers(folders["mqa_untied"], [3, 14, 15, 9, 26, 5], 10, FLOAT32_LOGITS)


@pytest.mark.parametrize("name", ["gqa_tied", "mqa_untied"])
def test_written_tensors_are_the_folders_and_transformers_reads_them(folders, tmp_path, name):
    """The dense model's tensors written back are the folder's, bit for bit; with the ``config.json`` ppctl writes,
    transformers computes the folder's logits."""
    from ppctl.model.gemma.hf import FORMAT

    written_back_equals_the_folder(FORMAT, folders[name], tmp_path / "written", EXACT)


# Each of Gemma's three hooks undone (Llama's value): the logits must leave transformers' by far.
TWINS = {"norm without its + 1": {"norm_offset": None}, "embeddings unscaled": {"scale_embeddings": False},
         "SiLU gate": {"mlp_activation": "silu"}}


@pytest.mark.parametrize("twin", TWINS)
def test_a_broken_twin_fails_the_comparison(folders, monkeypatch, twin):
    import ppctl.model.gemma as gemma

    monkeypatch.setattr(gemma, "GEMMA_HOOKS", {**gemma.GEMMA_HOOKS, **TWINS[twin]})
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders["gqa_tied"]), tokens), transformers_logits(folders["gqa_tied"], tokens)) > 1e-3


# --- config.json as transformers reads it ----------------------------------------------------------------------------

def llama_shaped_attributes(shape: dict) -> dict:
    """transformers' config attributes that ppctl's settings ``shape`` (from ``shape_from_hf``) stand for."""
    hidden, heads = shape["hidden_size"], shape["num_heads"]
    return {"num_hidden_layers": shape["num_layers"], "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": shape["num_kv_heads"], "head_dim": shape.get("head_dim", hidden // heads),
            "intermediate_size": shape["ffn_hidden_size"], "vocab_size": shape["vocab_size"],
            "max_position_embeddings": shape["max_seq_length"], "tie_word_embeddings": shape["tie_embeddings"],
            "rms_norm_eps": shape["norm_epsilon"], "rope_theta": shape["rope_theta"]}


def transformers_attributes(config) -> dict:
    """The same attributes of a transformers config object (its head width as its attention reads it)."""
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {**{key: getattr(config, key) for key in keys}, "head_dim": head_dim,
            "rope_theta": config.rope_parameters["rope_theta"]}


@pytest.mark.parametrize("edit", [{}, {"hidden_act": "gelu", "hidden_activation": "silu"}, {"head_dim": 8},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}],
                         ids=["defaults", "gelu_is_tanh", "head_dim_8", "rope_theta"])
def test_a_sparse_config_json_is_read_with_transformers_defaults(tmp_path, edit):
    from transformers import AutoConfig

    from ppctl.model.gemma.hf import FORMAT

    sparse = {"model_type": "gemma", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, **edit}
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    theirs = AutoConfig.from_pretrained(tmp_path)
    shape = FORMAT.shape_from_hf(sparse)
    assert transformers_attributes(theirs) == llama_shaped_attributes(shape)
    assert theirs.hidden_act == "gelu_pytorch_tanh" and shape["family"] == "gemma"


def _refusal(folder) -> str:
    with pytest.raises(ConfigError) as caught:
        folder_run_config(folder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.init_from={folder}: "), message
    return message.removeprefix(f"model.init_from={folder}: ")


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_act": "silu"}, "its hidden_act='silu': ppctl's gemma gates its MLP with the tanh GELU only"),
    ({"attention_bias": True}, "its attention_bias=true puts a bias on every attention projection"),
    ({"use_bidirectional_attention": True}, "its use_bidirectional_attention=true: ppctl's gemma attends causally"),
    ({"head_dim": None}, "its head_dim=null is null, not an integer: transformers refuses it"),
])
def test_what_gemma_cannot_compute_is_refused(folders, tmp_path, edit, expected):
    import shutil

    from transformers import AutoConfig

    folder = shutil.copytree(folders["gqa_tied"], tmp_path / "edited")
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    assert _refusal(folder).startswith(expected)
    if "head_dim" in edit:  # GemmaConfig's head width is an integer, never null: transformers refuses it too
        with pytest.raises(Exception, match="Validation error for field"):
            AutoConfig.from_pretrained(folder)


def test_gemma2_is_refused_by_name_with_the_reason(tmp_path):
    from transformers import Gemma2Config

    shape = {key: value for key, value in hf_config(GEMMA, True).to_dict().items()
             if key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings")}
    folder = save_random(tmp_path / "gemma2", Gemma2Config(**shape, pad_token_id=None))
    assert _refusal(folder).startswith("its model_type 'gemma2' is Gemma 2, which soft-caps every layer's attention "
                                       "logits (attn_logit_softcapping")
