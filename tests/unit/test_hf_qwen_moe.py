"""Qwen2-MoE and Qwen3-MoE both ways: folders read by ppctl's qwen_moe family, and ppctl's mixtures exported as them.

Tiny random folders saved by ``save_pretrained`` (``tests/harness/hf_models.py``; the hub's per-expert tensors): a
Qwen2-MoE (q/k/v biases, its first layer dense through ``mlp_only_layers``, 4 experts top-2 not renormalised, a
shared expert two experts wide behind its sigmoid gate) and a Qwen3-MoE (per-head q/k norms, heads of 16, every
other layer routed through ``decoder_sparse_step=2``, the top-2 renormalised). Each named by ``model.init_from``
alone gives transformers' float64 logits to 1e-10 relative with transformers' router softmax, norms and rotary
angles taken in float64 (measured ~1.5e-15), within 1e-6 with its own float32 router (measured ~4e-7), and ``ppctl
generate``'s greedy tokens are transformers'. A random ppctl mixture of each preset, exported, gives ppctl's logits
in transformers. Broken twins: the shared expert's gate left out (its output added whole, as DeepSeek's), the q/k
norms left out, the experts read in reverse order, each fails by far. Which layers route is read as transformers
builds them (checked against its modules) and written so that transformers builds the same; what ppctl does not
compute is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (EXPERTS, OVERRIDES, QWEN2_MOE, QWEN3_MOE, QWEN_HEAD_DIM, VOCAB, folder_run_config,
                                     hf_model, random_tokens, relative_error, save_tiny)

EXACT = 1e-10
BROKEN = 1e-3
ARCHITECTURES = (QWEN2_MOE, QWEN3_MOE)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {architecture: save_tiny(tmp_path_factory.mktemp(architecture), architecture, seed=4)
            for architecture in ARCHITECTURES}


@pytest.fixture(scope="module")
def folder_logits(folders):
    """transformers' float64 logits of each folder's model on ``random_tokens()``."""
    with torch.no_grad():
        return {architecture: hf_model(folder)(random_tokens()).logits for architecture, folder in folders.items()}


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def _ppctl(config):
    from ppctl.run.reference import reference_model

    return reference_model(config)


# What each folder's config.json gives ppctl: (qk_norm, qkv_bias, layer_freq, first_dense_layers, shared_experts,
# shared_expert_gate, router_topk_norm).
READ = {QWEN2_MOE: (False, True, 1, 1, 2, True, False), QWEN3_MOE: (True, False, 2, 1, 0, False, True)}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_folder_alone_gives_transformers_logits_in_float64(folders, folder_logits, architecture):
    config = folder_run_config(folders[architecture])
    model, moe = config.model, config.model.moe
    assert model.family == "qwen_moe" and (moe.num_experts, moe.topk, moe.expert_ffn_hidden_size) == (EXPERTS, 2, 24)
    assert (model.qk_norm, model.qkv_bias, moe.layer_freq, moe.first_dense_layers, moe.shared_experts,
            moe.shared_expert_gate, moe.router_topk_norm) == READ[architecture]
    ours = _logits(_ppctl(config), random_tokens())
    assert relative_error(ours, folder_logits[architecture]) < EXACT
    with torch.no_grad():  # transformers' own float32 router softmax, norms and angles
        assert relative_error(ours, hf_model(folders[architecture], exact=False)(random_tokens()).logits) < 1e-6


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_decoding_equals_transformers_generate(folders, tmp_path, architecture):
    from ppctl.generate.decode import generate_ids
    from ppctl.generate.sampling import Sampling
    from ppctl.generate.source import load_model
    from tests.harness.char_tokenizer import save_char_tokenizer

    copy = shutil.copytree(folders[architecture], tmp_path / architecture)
    save_char_tokenizer(copy, VOCAB)
    model = load_model(copy, precision="fp64")
    prompt = model.prompt_ids("Qwen", 6)
    ids = list(generate_ids(model.chunk, prompt, 8, Sampling(temperature=0.0)))
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model(copy).generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                           max_new_tokens=8, pad_token_id=0)
    assert ids == expected[0, len(prompt):].tolist()


def _omit_gates(model):
    """The broken twin: every MoE layer's shared-expert gate left out (the shared output added whole)."""
    from ppctl.model.moe.layer import moe_mlps

    mlps = moe_mlps(model).values()
    assert mlps and all(mlp.shared_expert_gate is not None for mlp in mlps)
    for mlp in mlps:
        mlp.shared_expert_gate = None
    return model


def _omit_qk_norms(model):
    """The broken twin: every attention's q/k norms left out of the computation."""
    from ppctl.model.llama.layers import GroupedQueryAttention

    attentions = [module for module in model.modules() if isinstance(module, GroupedQueryAttention)]
    assert attentions and all(attention.q_norm is not None for attention in attentions)
    for attention in attentions:
        attention.q_norm = attention.k_norm = None
    return model


@pytest.mark.parametrize("architecture, omit", [(QWEN2_MOE, _omit_gates), (QWEN3_MOE, _omit_qk_norms)],
                         ids=["shared_expert_gate", "qk_norms"])
def test_leaving_a_part_out_fails_the_comparison(folders, folder_logits, architecture, omit):
    model = omit(_ppctl(folder_run_config(folders[architecture])))
    assert relative_error(_logits(model, random_tokens()), folder_logits[architecture]) > BROKEN


def _reverse_experts(monkeypatch):
    """The broken twin of the mapping: each stacked expert weight read from the experts in reverse order."""
    from ppctl.model.qwen_moe.hf import FORMAT

    original = type(FORMAT).tensors
    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: {
        name: replace(spec, names=spec.names[::-1]) if spec.stacked else spec
        for name, spec in original(self, model, hf_config).items()})


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_broken_mapping_fails_the_import(folders, folder_logits, monkeypatch, architecture):
    _reverse_experts(monkeypatch)
    model = _ppctl(folder_run_config(folders[architecture]))
    assert relative_error(_logits(model, random_tokens()), folder_logits[architecture]) > BROKEN


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_tensors_map_back_to_the_folders_bit_for_bit(folders, architecture):
    """ppctl's parameters read from the folder, written back by the export's mapping, are the folder's tensors
    (every expert by its hub name, the shared expert and its gate), and its config.json describes the same model."""
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.qwen_moe.hf import FORMAT
    from ppctl.model.rules import rule_of

    folder = folders[architecture]
    config = folder_run_config(folder)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in _ppctl(config).named_parameters()}
    written = to_hf_tensors(FORMAT, resolve_model(config).shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved) and "model.layers.3.mlp.experts.3.down_proj.weight" in saved
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = FORMAT.hf_config(resolve_model(config).shape)
    assert FORMAT.shape_from_hf(exported) == FORMAT.shape_from_hf(read_hf_config(folder))


def test_each_expert_parallel_rank_reads_its_own_experts(folders):
    """At ep=2 each rank holds its 2 experts of every routed layer and the shared expert and its gate whole."""
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.expert_parallel import EPGroup
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers

    config = folder_run_config(folders[QWEN2_MOE])
    whole = dict(_ppctl(config).named_parameters())
    for rank in range(2):
        chunk = build_chunk(config, StageLayers.whole(4), RankGroups(ep=EPGroup(None, 2, rank)))
        names = [name for name, _param in chunk.named_parameters()]
        assert "layers.1.mlp.shared_expert_gate.weight" in names and "layers.0.mlp.gate_proj.weight" in names
        for name, param in chunk.named_parameters():
            expected = whole[name][rank * 2:(rank + 1) * 2] if rule_of(param).experts else whole[name]
            assert torch.equal(param, expected), (name, rank)


def _export(tmp_path, config, model):
    """``model``'s parameters saved as a one-process checkpoint of ``config``, exported by ``export_checkpoint``."""
    from ppctl.checkpoint.hf_export import export_checkpoint
    from ppctl.checkpoint.pieces import Piece
    from ppctl.checkpoint.store import Sharded, save_state
    from ppctl.model.rules import rule_of

    checkpoint, out = tmp_path / "checkpoint", tmp_path / "exported"
    state = {}
    for name, param in model.named_parameters():
        tensor = (param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()).clone()
        state[f"model/{name}"] = Sharded(tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor)])
    save_state(state, checkpoint)
    (checkpoint / "ppctl.json").write_text("{}")
    export_checkpoint(checkpoint, config, out)
    return out


PRESETS = {QWEN2_MOE: ["model=qwen2_moe_tiny"], QWEN3_MOE: ["model=qwen3_moe_tiny", f"model.head_dim={QWEN_HEAD_DIM}"]}


def _random_mixture(architecture):
    """A random ppctl mixture of the architecture's preset on the tiny shape, weights drawn wide, and its config."""
    config = compose_config([*PRESETS[architecture], *OVERRIDES, "parallel=single", "trainer.precision=fp64"])
    validate(config)
    model = _ppctl(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.2)
    return config, model


# What each preset is written as: (architectures, decoder_sparse_step, mlp_only_layers, its own keys)
WRITTEN = {QWEN2_MOE: (["Qwen2MoeForCausalLM"], 1, [0], {"shared_expert_intermediate_size": 64, "qkv_bias": True}),
           QWEN3_MOE: (["Qwen3MoeForCausalLM"], 1, [], {"num_experts": 8, "norm_topk_prob": True})}


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_exported_mixture_gives_ppctls_logits_in_transformers(tmp_path, architecture):
    config, model = _random_mixture(architecture)
    out = _export(tmp_path, config, model)
    written = json.loads((out / "config.json").read_text())
    names, step, dense, own = WRITTEN[architecture]
    assert (written["architectures"], written["decoder_sparse_step"]) == (names, step)
    assert written["mlp_only_layers"] == dense
    assert {key: written[key] for key in own} == own and written["router_aux_loss_coef"] == 0.001
    tokens = random_tokens()
    with torch.no_grad():
        assert relative_error(_logits(model, tokens), hf_model(out)(tokens).logits) < EXACT


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_broken_mapping_fails_the_export(tmp_path, monkeypatch):
    config, model = _random_mixture(QWEN2_MOE)
    _reverse_experts(monkeypatch)
    out = _export(tmp_path, config, model)
    tokens = random_tokens()
    with torch.no_grad():
        assert relative_error(_logits(model, tokens), hf_model(out)(tokens).logits) > BROKEN


def _routed_by_transformers(**keys):
    """The layers transformers builds a sparse MoE block for, in a 6-layer Qwen2-MoE of ``keys``."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=4,
                            shared_expert_intermediate_size=4, num_experts=2, num_experts_per_tok=1, **keys)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tuple(index for index, layer in enumerate(model.model.layers) if "Sparse" in type(layer.mlp).__name__)


LAYER_CASES = [dict(decoder_sparse_step=1), dict(decoder_sparse_step=2), dict(decoder_sparse_step=3),
               dict(mlp_only_layers=[0, 1]), dict(decoder_sparse_step=2, mlp_only_layers=[1])]


@pytest.mark.parametrize("keys", LAYER_CASES, ids=[json.dumps(keys) for keys in LAYER_CASES])
def test_the_routed_layers_are_read_and_written_as_transformers_builds_them(keys):
    from ppctl.model.moe.shape import MoEShape
    from ppctl.model.qwen_moe.hf import FORMAT, _sparse_layers

    config = {"model_type": "qwen2_moe", "num_hidden_layers": 6, "num_experts": 2, "moe_intermediate_size": 4,
              "shared_expert_intermediate_size": 4, **keys}
    shape = FORMAT.shape_from_hf(config)
    ours = MoEShape(num_experts=2, topk=1, expert_ffn_hidden_size=4, layer_freq=shape["moe.layer_freq"],
                    first_dense_layers=shape["moe.first_dense_layers"])
    assert ours.layer_ids(6) == _routed_by_transformers(**keys)
    assert _routed_by_transformers(**_sparse_layers(ours, 6)) == ours.layer_ids(6)


def _edited(folder, tmp_path, **edit):
    """A copy of the folder with its config.json's keys edited (None drops a key)."""
    copy = shutil.copytree(folder, tmp_path / "edited")
    config = {**json.loads((copy / "config.json").read_text()), **edit}
    (copy / "config.json").write_text(json.dumps({key: value for key, value in config.items() if value is not None}))
    return copy


REFUSED = [
    (QWEN2_MOE, {"mlp_only_layers": [2]}, "its decoder_sparse_step=1 and mlp_only_layers=[2] route layers [0, 1, 3], "
                                          "which no model.moe.layer_freq and model.moe.first_dense_layers give"),
    (QWEN2_MOE, {"shared_expert_intermediate_size": 36}, "its shared_expert_intermediate_size=36 is no multiple of its "
                                                         "moe_intermediate_size=24"),
    (QWEN2_MOE, {"layer_types": None, "use_sliding_window": True}, "its use_sliding_window=true (below "
                                                                   "max_window_layers=28): ppctl's qwen_moe attends"),
    (QWEN2_MOE, {"layer_types": ["sliding_attention"] * 4}, "its layer_types[0]='sliding_attention'"),
    (QWEN3_MOE, {"use_sliding_window": True, "sliding_window": 8}, "its use_sliding_window=true (sliding_window=8 on "
                                                                   "every layer)"),
    (QWEN3_MOE, {"attention_bias": True}, "its attention_bias=true puts a bias on q, k, v and the output projection"),
    (QWEN3_MOE, {"num_local_experts": 4.0}, "its num_local_experts=4.0 is a number with a fraction"),
]


@pytest.mark.parametrize("architecture, edit, message", REFUSED,
                         ids=[f"{case[0]}-{next(iter(case[1]))}" for case in REFUSED])
def test_what_ppctl_does_not_compute_is_refused_in_one_line(folders, tmp_path, architecture, edit, message):
    with pytest.raises(ConfigError) as refused:
        folder_run_config(_edited(folders[architecture], tmp_path, **edit))
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_keys_read_as_transformers_reads_them(folders, tmp_path):
    """Qwen3-MoE's ``num_local_experts`` is read over ``num_experts`` (its attribute map), Qwen2-MoE's
    ``attention_bias`` is no key of its config and changes nothing."""
    from transformers import AutoConfig

    from ppctl.model.qwen_moe.hf import FORMAT

    edited = _edited(folders[QWEN3_MOE], tmp_path, num_experts=8, num_local_experts=4)
    assert FORMAT.shape_from_hf(json.loads((edited / "config.json").read_text()))["moe.num_experts"] == \
        AutoConfig.from_pretrained(edited).num_experts == 4
    folder_run_config(_edited(folders[QWEN2_MOE], tmp_path / "qwen2", attention_bias=True))


UNEXPRESSIBLE = [
    (QWEN2_MOE, ["model.moe.shared_expert_gate=false"],
     "model.moe.shared_experts=2 and model.moe.shared_expert_gate=False: Qwen2MoeForCausalLM has one shared expert "
     "with its sigmoid gate"),
    (QWEN3_MOE, ["model.moe.shared_experts=1"],
     "model.moe.shared_experts=1: Qwen3MoeForCausalLM has no shared experts"),
    (QWEN3_MOE, ["model.qkv_bias=true"], "model.qkv_bias=true: Qwen3MoeForCausalLM has no q/k/v biases alone"),
    (QWEN3_MOE, ["model.moe.router_score=sigmoid"], "model.moe.router_score=sigmoid: Qwen2MoeForCausalLM/"
                                                    "Qwen3MoeForCausalLM cannot express it"),
    (QWEN2_MOE, ["model.moe.capacity_factor=1.5"], "model.moe.capacity_factor=1.5: Qwen2MoeForCausalLM/"
                                                   "Qwen3MoeForCausalLM cannot express it (it drops no tokens"),
]


@pytest.mark.parametrize("architecture, settings, fragment", UNEXPRESSIBLE, ids=[case[1][0] for case in UNEXPRESSIBLE])
def test_what_the_architecture_cannot_express_is_refused_by_the_export(tmp_path, architecture, settings, fragment):
    from ppctl.checkpoint.hf_export import ExportError, export_checkpoint

    config = compose_config([*PRESETS[architecture], "data=synthetic", "parallel=single", *settings])
    validate(config, data=False, prove_schedule=False)
    with pytest.raises(ExportError) as refused:
        export_checkpoint(tmp_path / "checkpoint", config, tmp_path / "out")
    assert fragment in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("settings, fragment", [
    (["model.moe.num_experts=0"], "model.family=qwen_moe is a mixture of experts: set model.moe.num_experts >= 1"),
    (["model.moe.shared_experts=0"], "model.moe.shared_expert_gate=true gates the shared experts' output, and "
                                     "model.moe.shared_experts=0"),
])
def test_a_qwen_mixture_without_what_it_needs_is_refused(settings, fragment):
    config = compose_config(["model=qwen2_moe_tiny", "data=synthetic", "parallel=single", *settings])
    with pytest.raises(ConfigError, match=fragment):
        validate(config, data=False, prove_schedule=False)


@pytest.mark.parametrize("preset", ["mixtral_tiny", "deepseek_tiny"])
def test_an_ungated_mixture_builds_no_gate(preset):
    """The gate is off for Mixtral and DeepSeek: their MoE layers hold the parameters they held before."""
    names = [name for name, _param in _ppctl(compose_config([f"model={preset}", "data=synthetic",
                                                             "parallel=single"])).named_parameters()]
    assert not [name for name in names if "gate" in name and "gate_proj" not in name]
