"""Mistral and Phi-3 both ways: each its own family on Llama's layers, read from a folder transformers saved and
exported as one transformers reads.

Tiny random ``MistralForCausalLM`` (a sliding window as long as the sequence) and ``Phi3ForCausalLM`` (fused
``qkv_proj`` and ``gate_up_proj``) folders (``tests/harness/hf_models.py``), named alone (``model.init_from``: the
folder gives every model key), give ppctl's single-process model transformers' logits to 1e-10 relative in float64
(transformers' rotary angles and RMSNorm taken in float64) and the same greedy tokens. At tp=2 each rank holds its
own heads' rows of Phi-3's fused parts. A random ppctl model of each preset, saved as a checkpoint and written by
``ppctl export``'s function, is loaded by ``from_pretrained`` with ppctl's logits, as its own architecture. The
window's off-by-one is transformers': a window as long as the sequence hides nothing, one shorter moves the logits,
and is refused. Broken twins of Phi-3's fused mapping (k and v parts swapped, gate and up swapped) fail by far.
What neither computes is refused in one line; the defaults a ``config.json`` may leave out are transformers' own.
"""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (MISTRAL, OVERRIDES, PHI3, POSITIONS, VOCAB, folder_run_config, random_tokens,
                                     reference_logits, relative_error, save_tiny, transformers_logits)

EXACT = 1e-10
BROKEN = 1e-3
ARCHITECTURES = {MISTRAL: "MistralForCausalLM", PHI3: "Phi3ForCausalLM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: save_tiny(tmp_path_factory.mktemp(name), name, seed=3) for name in ARCHITECTURES}


def _edited(tmp_path, folder, **edit):
    """A copy of ``folder`` whose ``config.json`` has ``edit`` over its keys."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config_file = copy / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    return copy


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_folder_alone_gives_transformers_logits_and_greedy_tokens(folders, name):
    config, tokens = folder_run_config(folders[name]), random_tokens()
    assert config.model.family == name
    ours, theirs = reference_logits(config, tokens), transformers_logits(folders[name], tokens)
    assert relative_error(ours, theirs) < EXACT
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_window_as_long_as_the_sequence_hides_nothing_and_one_shorter_is_refused(tmp_path, folders):
    """transformers' window W lets a query see the keys fewer than W positions back: W = the sequence length gives
    the unwindowed logits (the test above), W one shorter moves them, and ppctl refuses it by name."""
    tokens = random_tokens()
    shorter = _edited(tmp_path, folders[MISTRAL], sliding_window=POSITIONS - 1)
    assert relative_error(reference_logits(folder_run_config(folders[MISTRAL]), tokens), transformers_logits(shorter, tokens)) > BROKEN
    with pytest.raises(ConfigError, match=rf"its sliding_window={POSITIONS - 1} is shorter than its "
                                          rf"max_position_embeddings={POSITIONS} \(model.max_seq_length"):
        folder_run_config(shorter)


@pytest.mark.parametrize("tp", [2])
def test_each_tp_rank_reads_its_heads_rows_of_the_fused_tensors(folders, tp):
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.run.reference import reference_model
    from tests.distributed.equivalence import expected_shard

    dense = dict(reference_model(folder_run_config(folders[PHI3])).named_parameters())
    config = folder_run_config(folders[PHI3], f"parallel.tp={tp}")
    for tp_rank in range(tp):
        groups = RankGroups(tp=TPGroup(None, tp, tp_rank))
        chunk = build_chunk(config, StageLayers.whole(config.model.num_layers), groups)
        for name, param in chunk.named_parameters():
            rule = rule_of(param)
            assert torch.equal(param, expected_shard(name, rule, dense[rule.tied_to or name], param, tp, tp_rank,
                                                     VOCAB)), (name, tp_rank)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_dense_tensors_map_back_to_the_folders_bit_for_bit(folders, name):
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.rules import rule_of
    from ppctl.run.reference import reference_model

    config = folder_run_config(folders[name], "trainer.precision=fp32")
    resolved = resolve_model(config)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in reference_model(config).named_parameters()}
    written = to_hf_tensors(resolved.hf, resolved.shape, read_hf_config(folders[name]), dense)
    saved = load_file(str(folders[name] / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = resolved.hf.hf_config(resolved.shape)
    assert resolved.hf.shape_from_hf(exported) == resolved.hf.shape_from_hf(read_hf_config(folders[name]))


def _random_model(name):
    """A ppctl model of the ``<name>_tiny`` preset at the tiny shape, its weights drawn wide, and its config."""
    from ppctl.run.reference import reference_model

    config = compose_config([f"model={name}_tiny", *OVERRIDES, "parallel=single", "trainer.precision=fp64"])
    validate(config)
    model = reference_model(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for key, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in key else param.normal_(0.0, 0.2)
    return config, model


def _export(tmp_path, config, model):
    """``model``'s parameters saved as a checkpoint of a run of ``config``, exported by ``export_checkpoint``."""
    from ppctl.checkpoint.hf_export import export_checkpoint
    from ppctl.checkpoint.pieces import Piece
    from ppctl.checkpoint.store import Sharded, save_state
    from ppctl.model.rules import rule_of

    checkpoint, out = tmp_path / "checkpoint", tmp_path / "exported"
    state = {}
    for key, param in model.named_parameters():  # each whole, as one process saves it
        tensor = (param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()).clone()
        state[f"model/{key}"] = Sharded(tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor)])
    save_state(state, checkpoint)
    (checkpoint / "ppctl.json").write_text("{}")
    export_checkpoint(checkpoint, config, out)
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_an_exported_model_gives_ppctls_logits_in_transformers(tmp_path, name):
    config, model = _random_model(name)
    out = _export(tmp_path, config, model)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[name]] and written["model_type"] == name
    assert written["sliding_window"] is None
    tokens = random_tokens()
    with torch.no_grad():
        assert relative_error(transformers_logits(out, tokens), model(tokens)[..., :VOCAB]) < EXACT


FUSED_DEFECTS = {"k and v parts swapped": ("self_attn.k_proj", "self_attn.v_proj"),
                 "gate and up parts swapped": ("mlp.gate_proj", "mlp.up_proj")}


@pytest.mark.parametrize("defect", FUSED_DEFECTS)
def test_a_broken_fused_mapping_fails_the_comparison(folders, monkeypatch, defect):
    from ppctl.model.phi3.hf import FORMAT

    first, second = FUSED_DEFECTS[defect]
    original = FORMAT.tensors

    def broken(model, hf_config):
        specs = original(model, hf_config)
        for layer in range(model.num_layers):
            one, other = f"layers.{layer}.{first}.weight", f"layers.{layer}.{second}.weight"
            specs[one], specs[other] = (replace(specs[one], fused=specs[other].fused),
                                        replace(specs[other], fused=specs[one].fused))
        return specs

    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: broken(model, hf_config))
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders[PHI3]), tokens), transformers_logits(folders[PHI3], tokens)) > BROKEN


REFUSED = [
    (PHI3, {"rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}},
     "gives rope_type='su' (Phi-3 computes it as 'longrope')"),
    (PHI3, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "its partial_rotary_factor=0.5: ppctl's phi3 rotates the whole head"),
    (PHI3, {"sliding_window": 8}, "its sliding_window=8 is shorter than its max_position_embeddings=16"),
    (PHI3, {"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's phi3 computes SwiGLU with SiLU only"),
    (MISTRAL, {"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's mistral computes SwiGLU with SiLU only"),
    (MISTRAL, {"sliding_window": 0}, "its sliding_window=0 must be above 0"),
    (MISTRAL, {"num_key_value_heads": None}, "its num_key_value_heads=null is null, not an integer"),
]


@pytest.mark.parametrize("name, edit, fragment", REFUSED, ids=[f"{case[0]}-{next(iter(case[1]))}" for case in REFUSED])
def test_what_neither_computes_is_refused_in_one_line(tmp_path, folders, name, edit, fragment):
    with pytest.raises(ConfigError) as refused:
        folder_run_config(_edited(tmp_path, folders[name], **edit))
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_a_top_level_partial_rotary_factor_gives_way_to_the_rotary_parameters_as_in_transformers(tmp_path, folders):
    """Phi3Config puts ``partial_rotary_factor`` into ``rope_parameters`` only where they lack one: a saved folder's
    1.0 there wins over a top-level 0.5 (read, and computing the whole head's rotation)."""
    from transformers import AutoConfig

    folder = _edited(tmp_path, folders[PHI3], partial_rotary_factor=0.5)
    assert AutoConfig.from_pretrained(folder).rope_parameters["partial_rotary_factor"] == 1.0
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folder), tokens), transformers_logits(folder, tokens)) < EXACT


def test_a_mistral_folder_without_a_window_key_has_transformers_4096(tmp_path, folders):
    """MistralConfig's window default is 4096, not none: a folder leaving the key out at 8192 positions is refused."""
    from transformers import AutoConfig

    folder = _edited(tmp_path, folders[MISTRAL], max_position_embeddings=8192)
    config = json.loads((folder / "config.json").read_text())
    del config["sliding_window"]
    (folder / "config.json").write_text(json.dumps(config))
    assert AutoConfig.from_pretrained(folder).sliding_window == 4096
    with pytest.raises(ConfigError, match="its sliding_window=4096 is shorter than its max_position_embeddings=8192"):
        folder_run_config(folder)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_defaults_a_config_may_leave_out_are_transformers(name):
    from transformers import MistralConfig, Phi3Config

    from ppctl.model.mistral.hf import MISTRAL_DEFAULTS
    from ppctl.model.phi3.hf import PHI3_DEFAULTS

    defaults, hf = (MISTRAL_DEFAULTS, MistralConfig()) if name == MISTRAL else (PHI3_DEFAULTS, Phi3Config())
    read = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "sliding_window")
    assert {key: defaults[key] for key in read} == {key: getattr(hf, key) for key in read}
    assert (defaults["num_key_value_heads"] or defaults["num_attention_heads"]) == hf.num_key_value_heads
    assert hf.rope_parameters["rope_theta"] == defaults["rope_theta"]


@pytest.mark.parametrize("family, setting, fragment", [
    (MISTRAL, "model.qkv_bias=true", "a Mistral has no q/k/v biases"),
    (MISTRAL, "model.moe.num_experts=4", "a Mistral has no experts"),
    (PHI3, "model.rope_scaling_factor=8.0", "a Phi-3 computes the plain rotary embedding or longrope"),
])
def test_what_the_architecture_cannot_hold_is_refused_before_a_run(family, setting, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(compose_config([f"model={family}_tiny", *OVERRIDES, setting, "parallel=single"]))
