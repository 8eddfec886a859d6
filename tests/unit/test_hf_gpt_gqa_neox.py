"""StarCoder2 with grouped key/value heads (``model.family=gpt``) and GPT-NeoX (``model.family=gpt_neox``) against
``transformers``: read from a Hugging Face folder, each computes what transformers computes; written back, its
tensors are the folder's; broken twins of what each adds to GPT's layer fail.

Tiny random folders saved locally (``tests/harness/hf_models.py``): a ``Starcoder2ForCausalLM`` with 4 query heads
on 2 key/value heads (tied and not, random q/k/v biases), and a ``GPTNeoXForCausalLM`` with Pythia's parallel
residual, rotary over half of each head's 8 dims (``rotary_pct=0.5``), biases everywhere, untied and tied. In
float64, ppctl's single-process model started from the folder (every key written, or the folder alone) gives
transformers' logits to 1e-10 relative (transformers' rotary angles taken in float64; within float32 of its own),
and its greedy decoding (``ppctl generate``'s KV cache) transformers' tokens. Each TP rank reads its shard (whole
key/value heads; whole heads' rows of GPT-NeoX's per-head QKV); the dense tensors map back to the folder's bit for
bit, and the ``config.json`` export writes reloads in transformers to the same logits. Broken twins: GPT-NeoX's
parallel residual computed sequentially; its partial rotary applied to every dim of each head; StarCoder2's key and
value heads swapped. ``config.json`` is read as ``GPTNeoXConfig`` reads it (checked against it), and what ppctl
cannot compute is refused in one line.
"""

import json
import shutil

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (GPT_NEOX, STARCODER2_GQA, VOCAB, folder_overrides, hf_model, overrides,
                                     relative_error, save_tiny)

MODELS = [(STARCODER2_GQA, False), (STARCODER2_GQA, True), (GPT_NEOX, False), (GPT_NEOX, True)]
EXACT = 1e-10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved tiny model per (architecture, tie)."""
    return {(architecture, tie): save_tiny(tmp_path_factory.mktemp(f"{architecture}_{tie}"), architecture, tie)
            for architecture, tie in MODELS}


def _config(items):
    config = compose_config([*items, "parallel=single", "trainer.precision=fp64"])
    validate(config)
    return config


def _reference(config):
    from ppctl.run.reference import reference_model

    return reference_model(config)


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


def _hf_logits(folder, tokens, exact=True):
    with torch.no_grad():
        return hf_model(folder, exact)(tokens).logits


@pytest.mark.parametrize("architecture, tie", MODELS)
def test_logits_equal_transformers_in_float64_with_every_key_or_the_folder_alone(folders, architecture, tie):
    folder, tokens = folders[(architecture, tie)], _tokens()
    expected = _hf_logits(folder, tokens)
    for items in (overrides(folder, architecture, tie), folder_overrides(folder)):
        ours = _logits(_reference(_config(items)), tokens)
        assert relative_error(ours, expected) < EXACT, items
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert relative_error(ours, _hf_logits(folder, tokens, exact=False)) < 1e-6  # its own float32 rotary angles


@pytest.mark.parametrize("architecture", [STARCODER2_GQA, GPT_NEOX])
def test_greedy_decoding_equals_transformers_generate(folders, architecture):
    """``ppctl generate``'s model (the folder's, with the KV cache: grouped key/value heads, partial rotary) picks
    transformers' greedy tokens."""
    from ppctl.generate.decode import generate_ids
    from ppctl.generate.sampling import Sampling
    from ppctl.generate.source import load_model
    from tests.harness.char_tokenizer import save_char_tokenizer

    folder = folders[(architecture, False)]
    save_char_tokenizer(folder, VOCAB)
    model = load_model(folder, precision="fp64")
    prompt = model.prompt_ids("Hello", 10)
    ids = list(generate_ids(model.chunk, prompt, 10, Sampling(temperature=0.0)))
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model(folder).generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                             max_new_tokens=10, pad_token_id=0)
    assert ids == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("architecture, tie", MODELS)
def test_each_tp_rank_reads_the_dense_models_shard(folders, architecture, tie):
    """At tp=2 each rank's chunk holds the single process's shards: whole key/value heads (and their query heads) of
    StarCoder2, whole heads' q, k and v rows of GPT-NeoX's per-head QKV."""
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from tests.distributed.equivalence import expected_shard

    folder = folders[(architecture, tie)]
    dense = dict(_reference(_config(overrides(folder, architecture, tie))).named_parameters())
    config = _config([*overrides(folder, architecture, tie), "parallel.tp=2"])
    for tp_rank in range(2):
        chunk = build_chunk(config, StageLayers(0, (0, 1, 2, 3), True, True), RankGroups(tp=TPGroup(None, 2, tp_rank)))
        for name, param in chunk.named_parameters():
            rule = rule_of(param)
            expected = expected_shard(name, rule, dense[rule.tied_to or name], param, 2, tp_rank, VOCAB)
            assert torch.equal(param, expected), (name, tp_rank)


def _dense(model):
    from ppctl.model.rules import rule_of

    return {name: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
            for name, param in model.named_parameters()}


@pytest.mark.parametrize("architecture, tie", MODELS)
def test_written_back_the_tensors_are_the_folders_and_transformers_reads_the_export(folders, tmp_path, architecture,
                                                                                   tie):
    from safetensors.torch import load_file

    from ppctl.checkpoint.hf_export import write_weights
    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors

    folder, tokens = folders[(architecture, tie)], _tokens()
    config = _config(overrides(folder, architecture, tie))
    resolved, model = resolve_model(config), _reference(config)
    dense = _dense(model)
    written = to_hf_tensors(resolved.hf, resolved.shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(written[name], tensor.double()), name

    hf_config = resolved.hf.hf_config(resolved.shape)  # what ppctl export writes
    assert resolved.hf.shape_from_hf(hf_config) == resolved.hf.shape_from_hf(read_hf_config(folder))
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    write_weights(tmp_path, to_hf_tensors(resolved.hf, resolved.shape, hf_config, dense), max_shard_bytes=1 << 30)
    assert relative_error(_hf_logits(tmp_path, tokens), _logits(model, tokens)) < EXACT


# --- broken twins ---------------------------------------------------------------------------------------------------

def test_gpt_neox_with_its_residual_computed_sequentially_fails_the_comparison(folders):
    from ppctl.model.layers import TransformerLayer

    folder, tokens = folders[(GPT_NEOX, False)], _tokens()
    model = _reference(_config(overrides(folder, GPT_NEOX)))
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    assert layers and all(layer.parallel_residual for layer in layers)
    for layer in layers:
        layer.parallel_residual = False
    assert relative_error(_logits(model, tokens), _hf_logits(folder, tokens)) > 1e-3


def test_gpt_neox_with_its_rotary_over_every_dim_fails_the_comparison(folders, monkeypatch):
    from ppctl.model.gpt.model import GPTChunk
    from ppctl.model.layers import rotary_cos_sin

    folder, tokens = folders[(GPT_NEOX, False)], _tokens()
    model = _reference(_config(overrides(folder, GPT_NEOX)))
    assert model.config.rotary_dim == model.config.head_dim // 2
    monkeypatch.setattr(GPTChunk, "rotary_tables", lambda chunk, positions, dtype: rotary_cos_sin(
        positions, chunk.config.head_dim, chunk.config.rope_base, dtype))
    assert relative_error(_logits(model, tokens), _hf_logits(folder, tokens)) > 1e-3


def test_starcoder2_with_its_key_and_value_heads_swapped_fails_the_comparison(folders):
    folder, tokens = folders[(STARCODER2_GQA, False)], _tokens()
    model = _reference(_config(overrides(folder, STARCODER2_GQA)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attention.key." in name:
                value = dict(model.named_parameters())[name.replace(".key.", ".value.")]
                swapped = param.detach().clone()
                param.copy_(value)
                value.copy_(swapped)
    assert relative_error(_logits(model, tokens), _hf_logits(folder, tokens)) > 1e-3


# --- config.json as transformers reads it, and refusals -----------------------------------------------------------

NEOX_ROTARY_KEYS = [{}, {"rotary_pct": 0.5}, {"rotary_emb_base": 500}, {"rope_theta": 700.0},
                    {"partial_rotary_factor": 0.5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
                    {"rope_scaling": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1.0},
                     "rotary_pct": 0.5, "rope_parameters": {"rope_theta": 3.0}},
                    {"rope_parameters": {"rope_type": "default"}, "rotary_pct": 0.75, "rotary_emb_base": 5},
                    {"use_parallel_residual": False, "attention_bias": False, "rotary_pct": 1}]


@pytest.mark.parametrize("keys", NEOX_ROTARY_KEYS, ids=[json.dumps(keys) for keys in NEOX_ROTARY_KEYS])
def test_gpt_neox_config_is_read_as_transformers_reads_it(keys):
    """The rotary base and fraction, the residual and the biases ppctl reads of a ``config.json`` are those
    ``GPTNeoXConfig`` builds the model with (its ``rope_parameters``; a top-level ``rope_theta`` or
    ``partial_rotary_factor`` is not read, the older ``rotary_pct``/``rotary_emb_base`` are)."""
    from transformers import GPTNeoXConfig

    from ppctl.model.gpt_neox.hf import FORMAT

    raw = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, **keys}
    theirs = GPTNeoXConfig(**{key: value for key, value in raw.items() if key != "model_type"})
    ours = FORMAT.shape_from_hf(raw)
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["partial_rotary_factor"] == theirs.rope_parameters["partial_rotary_factor"]
    assert (ours["parallel_residual"], ours["qkv_bias"]) == (theirs.use_parallel_residual, theirs.attention_bias)
    assert (ours["hidden_size"], ours["num_layers"], ours["ffn_hidden_size"]) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.intermediate_size)


def _edited(folder, tmp_path, edit):
    edited = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, **edit}))
    return edited


def _refusal(items) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(items))
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("architecture, edit, expected", [
    (GPT_NEOX, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "its rope_parameters gives rope_type='linear': ppctl's gpt_neox has the plain rotary embedding ('default') only"),
    (GPT_NEOX, {"rope_parameters": None, "rotary_pct": 0.375},
     "its rotary fraction 0.375 rotates 3 of each head's 8 dims: ppctl rotates an even number of them, at least 2"),
    (GPT_NEOX, {"rope_parameters": None, "rotary_pct": "0.5"},
     "its rotary fraction (partial_rotary_factor, or rotary_pct)=\"0.5\" is not a number in (0, 1]"),
    (GPT_NEOX, {"hidden_act": "gelu_fast"}, "its hidden_act='gelu_fast' is no activation ppctl's gpt computes"),
    (STARCODER2_GQA, {"sliding_window": 8},
     "its sliding_window=8 is shorter than its max_position_embeddings=16 (model.max_seq_length, the run's longest "
     "sequence)"),
    (STARCODER2_GQA, {"num_key_value_heads": 3},
     "its num_attention_heads=4 is not a multiple of its num_key_value_heads=3"),
])
def test_what_ppctl_cannot_compute_is_refused_in_one_line(folders, tmp_path, architecture, edit, expected):
    folder = _edited(folders[(architecture, False)], tmp_path, edit)
    assert expected in _refusal(folder_overrides(folder))


def test_a_starcoder2_window_no_shorter_than_its_positions_is_read(folders, tmp_path):
    """A window of at least ``max_position_embeddings`` hides nothing: transformers' logits are GPT's."""
    folder, tokens = _edited(folders[(STARCODER2_GQA, False)], tmp_path, {"sliding_window": 16}), _tokens()
    assert relative_error(_logits(_reference(_config(folder_overrides(folder))), tokens),
                          _hf_logits(folder, tokens)) < EXACT


def test_grouped_heads_a_tp_rank_cannot_hold_whole_are_refused(folders):
    folder = folders[(STARCODER2_GQA, False)]
    assert _refusal([*overrides(folder, STARCODER2_GQA), "parallel.tp=4"]) == (
        "model.num_kv_heads=2 must be divisible by parallel.tp=4 (each TP rank owns whole key/value heads)")
    assert "gives model.num_kv_heads=2, this run has model.num_kv_heads=1" in _refusal(
        [*overrides(folder, STARCODER2_GQA), "model.num_kv_heads=1"])


def test_gpt_neox_refuses_grouped_heads_and_learned_positions():
    assert _refusal(["model=gpt_neox_tiny", "model.num_kv_heads=2"]) == (
        "model.num_kv_heads=2: model.family=gpt_neox has as many key/value heads as heads (its QKV is fused head by "
        "head); drop the key")
    assert "model.family=gpt_neox has rotary positions" in _refusal(
        ["model=gpt_neox_tiny", "model.position_embedding=learned"])
    assert "must be in (0, 1]" in _refusal(["model=gpt_neox_tiny", "model.partial_rotary_factor=1.5"])


def test_gpt2_export_of_grouped_heads_is_refused():
    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import HFError

    config = compose_config(["model=gpt_tiny", "model.num_kv_heads=2"])
    validate(config)
    resolved = resolve_model(config)
    with pytest.raises(HFError, match="GPT2LMHeadModel has as many key/value heads as heads"):
        resolved.hf.hf_config(resolved.settings)


def test_gpt_tiny_builds_as_before_its_rules_and_names_unchanged():
    """No GPT-NeoX or grouped-query hook reaches GPT's default model: one fused ``qkv`` split as q, k and v heads,
    the residual sequential, rotary over the whole head."""
    from ppctl.model.family import resolve_model
    from ppctl.model.rules import QKV_ROWS, rule_of

    config = compose_config(["model=gpt_tiny", "model.position_embedding=rope", "parallel=single"])
    shape = resolve_model(config).shape
    assert (shape.num_kv_heads, shape.parallel_residual, shape.qkv_per_head, shape.rotary_dim) == (
        None, False, False, shape.head_dim)
    model = _reference(config)
    names = {name.split(".", 2)[2] for name in dict(model.named_parameters()) if name.startswith("layers.0.")}
    assert {name for name in names if name.startswith("attention")} == {
        "attention.qkv.weight", "attention.proj.weight", "attention.proj.bias"}
    assert rule_of(model.layers["0"].attention.qkv.weight).split == QKV_ROWS
