"""Llama's ``attention_bias``: biases on q, k, v and ``o_proj``, read as ``model.qkv_bias`` and
``model.attention_output_bias`` and written back as ``LlamaForCausalLM`` with ``attention_bias: true``.

A tiny random ``LlamaForCausalLM`` with ``attention_bias=true`` (every bias drawn wide;
``tests/harness/hf_models.py``), named alone (``model.init_from``), gives ppctl's single-process model transformers'
float64 logits to 1e-10 and its greedy tokens; at tp=2 each rank holds the whole output bias (added once, after the
row-parallel sum) and its heads' rows of the q/k/v biases. The output bias left out of the mapping (read as zero) fails
by far. Its tensors map back to the folder's bit for bit, and its ``config.json`` reads back to the same settings. An
output bias without q/k/v biases (no Hugging Face architecture has it) or with experts is refused by the export in
one line; ``mlp_bias`` stays refused (``tests/unit/test_hf_llama.py``).
"""

import pytest
import torch

from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (LLAMA, OVERRIDES, VOCAB, folder_run_config, hf_config, random_tokens,
                                     reference_logits, relative_error, save_random, transformers_logits)

EXACT = 1e-10
BROKEN = 1e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = hf_config(LLAMA, False)
    config.attention_bias = True
    return save_random(tmp_path_factory.mktemp("llama_attention_bias"), config, seed=3)


def test_the_folder_gives_both_biases_and_transformers_logits(folder):
    config, tokens = folder_run_config(folder), random_tokens()
    assert config.model.qkv_bias and config.model.attention_output_bias
    ours, theirs = reference_logits(config, tokens), transformers_logits(folder, tokens)
    assert relative_error(ours, theirs) < EXACT
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_each_tp_rank_holds_the_whole_output_bias(folder):
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.run.reference import reference_model
    from tests.distributed.equivalence import expected_shard

    dense = dict(reference_model(folder_run_config(folder)).named_parameters())
    config = folder_run_config(folder, "parallel.tp=2")
    for tp_rank in range(2):
        groups = RankGroups(tp=TPGroup(None, 2, tp_rank))
        chunk = build_chunk(config, StageLayers.whole(config.model.num_layers), groups)
        held = dict(chunk.named_parameters())
        assert torch.equal(held["layers.0.self_attn.o_proj.bias"], dense["layers.0.self_attn.o_proj.bias"])
        for name, param in held.items():
            rule = rule_of(param)
            assert torch.equal(param, expected_shard(name, rule, dense[rule.tied_to or name], param, 2, tp_rank,
                                                     VOCAB)), (name, tp_rank)


def test_the_output_bias_left_out_fails_the_comparison(folder, monkeypatch):
    from dataclasses import replace

    from ppctl.model.llama.hf import FORMAT

    original = FORMAT.tensors

    def without_output_bias(model, hf_config):
        return {name: replace(spec, names=()) if name.endswith("o_proj.bias") else spec
                for name, spec in original(model, hf_config).items()}

    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: without_output_bias(model, hf_config))
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folder), tokens), transformers_logits(folder, tokens)) > BROKEN


def test_the_tensors_and_the_config_map_back(folder):
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.rules import rule_of
    from ppctl.run.reference import reference_model

    config = folder_run_config(folder, "trainer.precision=fp32")
    resolved = resolve_model(config)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in reference_model(config).named_parameters()}
    written = to_hf_tensors(resolved.hf, resolved.shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved) and all(torch.equal(written[key], saved[key]) for key in saved)
    exported = resolved.hf.hf_config(resolved.shape)
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["attention_bias"] is True
    assert resolved.hf.shape_from_hf(exported) == resolved.hf.shape_from_hf(read_hf_config(folder))


@pytest.mark.parametrize("settings, fragment", [
    (["model=llama_tiny", "model.attention_output_bias=true"],
     "model.attention_output_bias=true without model.qkv_bias"),
    (["model=mixtral_tiny", "model.attention_output_bias=true"], "MixtralForCausalLM has no output bias"),
])
def test_an_output_bias_no_architecture_holds_is_refused_by_the_export(settings, fragment):
    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import HFError

    config = compose_config([*settings, *OVERRIDES, "parallel=single"])
    validate(config)
    resolved = resolve_model(config)
    with pytest.raises(HFError, match=fragment):
        resolved.hf.hf_config(resolved.shape)
