"""Mixtral both ways: a ``MixtralForCausalLM`` folder read by ppctl's MoE Llama, and ppctl's MoE Llama exported as one.

A tiny random Mixtral (4 layers, 4 experts, top-2, grouped-query attention; ``tests/harness/hf_models.py``) saved
by ``save_pretrained`` (the hub's per-expert ``block_sparse_moe.experts.<j>.w1/w2/w3``) starts ppctl's
single-process model in float64 (``model.init_from``): its logits are transformers' to 1e-10 relative with
transformers' router softmax, rotary angles and RMSNorm taken in float64 (measured 1.7e-15), within 1e-6 with its
own float32 ones (measured 4e-7); two pipeline stages' chunks read their own layers' experts. The other way, a
random ppctl MoE Llama written by ``ppctl export``'s own function from a checkpoint is loaded by
``from_pretrained`` and gives ppctl's logits to 1e-10 (measured 2.8e-15). Broken twins of the mapping (w1 and w3
swapped, the experts reversed) fail both comparisons by far (0.98 to 1.1). Every ``model.moe`` setting Mixtral
cannot express is refused by the export in one line naming it, and a run that does not match a folder (or a dense
folder for a run with experts, and the other way round) is refused before anything starts.
"""

import json
from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (EXPERTS, MIXTRAL, POSITIONS, VOCAB, hf_model, overrides, relative_error,
                                     save_tiny)

EXACT = 1e-10
BROKEN = 1e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("mixtral"), MIXTRAL, seed=3)


@pytest.fixture(scope="module")
def folder_logits(folder):
    """transformers' float64 logits of the folder's model on ``_tokens()``."""
    return _hf_logits(folder, _tokens())


def _config(folder, *extra):
    """The fp64 single-process config of a run that starts from the Mixtral in ``folder``."""
    config = compose_config([*overrides(folder, MIXTRAL), "parallel=single", "trainer.precision=fp64", *extra])
    validate(config)
    return config


def _tokens():
    return torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(7))


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def _hf_logits(folder, tokens, exact: bool = True):
    with torch.no_grad():
        return hf_model(folder, exact)(tokens).logits


def _ppctl(config):
    from ppctl.run.reference import reference_model

    return reference_model(config)


def test_a_mixtral_folder_gives_transformers_logits_in_float64(folder, folder_logits):
    tokens = _tokens()
    ours = _logits(_ppctl(_config(folder)), tokens)
    assert relative_error(ours, folder_logits) < EXACT
    assert relative_error(ours, _hf_logits(folder, tokens, exact=False)) < 1e-6  # transformers' float32 router


def test_the_dense_tensors_map_back_to_the_folders_bit_for_bit(folder):
    """ppctl's parameters read from the folder, written back by the export's mapping, are the folder's tensors
    (every expert of every layer by its hub name), and its config.json describes the same model."""
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.llama.hf import FORMAT
    from ppctl.model.rules import rule_of

    config = _config(folder)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in _ppctl(config).named_parameters()}
    written = to_hf_tensors(FORMAT, resolve_model(config).shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    assert "model.layers.3.block_sparse_moe.experts.3.w2.weight" in saved
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = FORMAT.hf_config(resolve_model(config).shape)
    assert FORMAT.shape_from_hf(exported) == FORMAT.shape_from_hf(read_hf_config(folder))


def test_each_pipeline_stage_reads_its_own_layers_experts(folder):
    """Two stages' chunks (layers 0-1 with the embedding, 2-3 with the output layer) hold the single process's
    parameters, every expert of every layer read from its own tensor."""
    from ppctl.model.from_config import build_chunk
    from ppctl.parallel.layout import StageLayers

    config = _config(folder)
    whole = dict(_ppctl(config).named_parameters())
    for layer_ids, first, last in (([0, 1], True, False), ([2, 3], False, True)):
        chunk = build_chunk(config, StageLayers(0, tuple(layer_ids), first, last))
        names = [name for name, _param in chunk.named_parameters()]
        assert f"layers.{layer_ids[0]}.mlp.experts.down_proj.weight" in names
        for name, param in chunk.named_parameters():
            assert torch.equal(param, whole[name]), name


@pytest.mark.parametrize("ep", [2, 4])
def test_each_expert_parallel_rank_reads_its_own_experts(folder, ep):
    """Under expert parallelism each EP rank's chunk holds its share of every layer's experts (``E / ep`` of them,
    from its own hub tensors) and every other parameter whole."""
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.expert_parallel import EPGroup
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers

    config = _config(folder)
    whole = dict(_ppctl(config).named_parameters())
    per_rank = EXPERTS // ep
    for rank in range(ep):
        chunk = build_chunk(config, StageLayers.whole(4), RankGroups(ep=EPGroup(None, ep, rank)))
        for name, param in chunk.named_parameters():
            expected = whole[name][rank * per_rank:(rank + 1) * per_rank] if rule_of(param).experts else whole[name]
            assert torch.equal(param, expected), (name, rank)


def _swap_gate_and_up(name, spec):
    return replace(spec, names=tuple(hf.replace(".w1.", "#").replace(".w3.", ".w1.").replace("#", ".w3.")
                                     for hf in spec.names))


DEFECTS = {
    "w1 and w3 swapped": _swap_gate_and_up,
    "experts reversed": lambda name, spec: replace(spec, names=spec.names[::-1]) if spec.stacked else spec,
}


def _broken(monkeypatch, defect):
    """The Llama format's mapping with one defect."""
    from ppctl.model.llama.hf import FORMAT

    original = type(FORMAT).tensors
    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: {
        name: DEFECTS[defect](name, spec) for name, spec in original(self, model, hf_config).items()})


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_broken_mapping_fails_the_import(folder, folder_logits, monkeypatch, defect):
    _broken(monkeypatch, defect)
    assert relative_error(_logits(_ppctl(_config(folder)), _tokens()), folder_logits) > BROKEN


def _export(tmp_path, config, model):
    """``model``'s parameters saved as a checkpoint of a run of ``config``, exported by ``export_checkpoint``."""
    from ppctl.checkpoint.hf_export import export_checkpoint
    from ppctl.checkpoint.pieces import Piece
    from ppctl.checkpoint.store import Sharded, save_state
    from ppctl.model.rules import rule_of

    checkpoint, out = tmp_path / "checkpoint", tmp_path / "exported"
    state = {}
    for name, param in model.named_parameters():  # each whole, as one process saves it
        tensor = (param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()).clone()
        state[f"model/{name}"] = Sharded(tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor)])
    save_state(state, checkpoint)
    (checkpoint / "ppctl.json").write_text("{}")
    assert export_checkpoint(checkpoint, config, out) == [
        "note: synthetic data has no tokenizer: no tokenizer files written"]
    return out


def _random_moe_llama():
    """A ppctl MoE Llama of the tiny shape, its weights drawn wide (as ``save_tiny``'s) so that a wrong mapping
    moves the logits by far more than rounding, and its config (no folder to start from)."""
    from tests.harness.hf_models import OVERRIDES

    config = compose_config(["model=mixtral_tiny", *OVERRIDES, "model.num_kv_heads=2", f"model.moe.num_experts="
                             f"{EXPERTS}", "model.moe.expert_ffn_hidden_size=48", "parallel=single",
                             "trainer.precision=fp64"])
    validate(config)
    model = _ppctl(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.2)
    return config, model


@pytest.fixture(scope="module")
def moe_llama():
    return _random_moe_llama()


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
def test_an_exported_moe_llama_gives_ppctls_logits_in_transformers(tmp_path, moe_llama):
    config, model = moe_llama
    out = _export(tmp_path, config, model)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"] and written["model_type"] == "mixtral"
    assert (written["num_local_experts"], written["num_experts_per_tok"], written["intermediate_size"]) == (4, 2, 48)
    assert written["router_aux_loss_coef"] == config.model.moe.aux_loss_coeff and not written["output_router_logits"]
    assert written["sliding_window"] is None and written["router_jitter_noise"] == 0.0
    tokens = _tokens()
    assert relative_error(_hf_logits(out, tokens), _logits(model, tokens)) < EXACT


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
@pytest.mark.parametrize("defect", DEFECTS)
def test_a_broken_mapping_fails_the_export(tmp_path, monkeypatch, moe_llama, defect):
    config, model = moe_llama
    _broken(monkeypatch, defect)
    out = _export(tmp_path, config, model)
    tokens = _tokens()
    assert relative_error(_hf_logits(out, tokens), _logits(model, tokens)) > BROKEN


UNEXPRESSIBLE = [
    (["model.moe.shared_experts=1"], "model.moe.shared_experts=1: MixtralForCausalLM cannot express it (Mixtral has "
                                     "no shared experts: model.moe.shared_experts=0)"),
    (["model.moe.router_score=sigmoid"], "model.moe.router_score=sigmoid: MixtralForCausalLM cannot express it"),
    (["model.moe.router_topk_norm=false"], "model.moe.router_topk_norm=False: MixtralForCausalLM cannot express it "
                                           "(Mixtral divides each token's top-k weights by their sum (with top-1: 1)"),
    (["model.moe.topk=1", "model.moe.router_topk_norm=false"], "model.moe.router_topk_norm=False: Mixtral"),
    (["model.moe.expert_bias=true"], "model.moe.expert_bias=True: MixtralForCausalLM cannot express it"),
    (["model.moe.layer_freq=2"], "model.moe.layer_freq=2: MixtralForCausalLM cannot express it (every layer of a "
                                 "Mixtral routes: model.moe.layer_freq=1)"),
    (["model.moe.first_dense_layers=1"], "model.moe.first_dense_layers=1: MixtralForCausalLM cannot express it"),
    (["model.moe.capacity_factor=1.5"], "model.moe.capacity_factor=1.5: MixtralForCausalLM cannot express it "
                                        "(Mixtral drops no tokens"),
    (["model.qkv_bias=true"], "model.qkv_bias=true: MixtralForCausalLM has no q/k/v biases"),
    (["model=gpt_tiny", "model.moe.num_experts=4"], "model.moe.num_experts=4 with model.family=gpt: this family's "
                                                    "Hugging Face format writes no mixture of experts"),
]


@pytest.mark.parametrize("settings, fragment", UNEXPRESSIBLE, ids=[case[0][-1] for case in UNEXPRESSIBLE])
def test_what_mixtral_cannot_express_is_refused_in_one_line(tmp_path, settings, fragment):
    """Refused before the checkpoint is read (there is none here) and before anything is written."""
    from ppctl.checkpoint.hf_export import ExportError, export_checkpoint

    config = compose_config(["model=mixtral_tiny", "data=synthetic", "parallel=single", *settings])
    validate(config, data=False, prove_schedule=False)
    with pytest.raises(ExportError) as refused:
        export_checkpoint(tmp_path / "checkpoint", config, tmp_path / "out")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'checkpoint'}: ") and fragment in message and "\n" not in message, message
    assert not (tmp_path / "out").exists()


def test_a_dense_run_exports_llama_as_before(tmp_path):
    from ppctl.model.family import resolve_model
    from ppctl.model.llama.hf import FORMAT

    written = FORMAT.hf_config(resolve_model(compose_config(["model=llama_tiny", "data=synthetic"])).shape)
    assert written["architectures"] == ["LlamaForCausalLM"] and "num_local_experts" not in written


MISMATCHES = [
    (["model.moe.topk=1", "model.moe.aux_loss_coeff=0.01"], "gives model.moe.topk=2, this run has model.moe.topk=1"),
    (["model.moe.num_experts=8"], "gives model.moe.num_experts=4, this run has model.moe.num_experts=8"),
    (["model.moe.expert_ffn_hidden_size=32"], "gives model.moe.expert_ffn_hidden_size=64, this run has "
                                              "model.moe.expert_ffn_hidden_size=32"),
    (["model.moe.shared_experts=1"], "gives model.moe.shared_experts=0, this run has model.moe.shared_experts=1"),
    (["model.moe.router_topk_norm=false"], "gives model.moe.router_topk_norm=True, this run has "
                                           "model.moe.router_topk_norm=False"),
    (["model.moe.capacity_factor=2.0"], "gives model.moe.capacity_factor=None, this run has "
                                        "model.moe.capacity_factor=2.0"),
    (["model.moe.num_experts=0", "model.moe.topk=2", "model.moe.router_topk_norm=false",
      "model.moe.aux_loss_coeff=0.0"], "gives model.moe.num_experts=4, this run has model.moe.num_experts=0"),
]


@pytest.mark.parametrize("settings, fragment", MISMATCHES, ids=[case[0][0] for case in MISMATCHES])
def test_a_run_that_does_not_match_the_folder_is_refused(folder, settings, fragment):
    with pytest.raises(ConfigError) as refused:
        _config(folder, *settings)
    assert str(refused.value) == f"model.init_from={folder}: its config.json {fragment}"


def test_an_unset_expert_width_is_the_ffn_width(folder):
    """The folder's intermediate_size is the experts' width: an explicit one equal to it is the same run."""
    _config(folder, "model.moe.expert_ffn_hidden_size=64")
    with pytest.raises(ConfigError, match="gives model.moe.expert_ffn_hidden_size=64, this run has "
                                          "model.moe.expert_ffn_hidden_size=128"):
        _config(folder, "model.ffn_hidden_size=128")


def test_a_dense_llama_folder_is_refused_to_a_run_with_experts(tmp_path):
    from tests.harness.hf_models import LLAMA

    dense = save_tiny(tmp_path / "llama", LLAMA)
    with pytest.raises(ConfigError, match=r"its config.json gives model.moe.num_experts=0, this run has "
                                          r"model.moe.num_experts=4$"):
        _config(dense)


def test_a_gpt_run_with_experts_reads_no_folder(folder):
    config = compose_config(["model=gpt_tiny", "data=synthetic", "parallel=single", "model.moe.num_experts=4",
                             f"model.init_from={folder}"])
    with pytest.raises(ConfigError, match="model.init_from with model.moe.num_experts=4 and model.family=gpt: this "
                                          "family's Hugging Face format reads no mixture of experts"):
        validate(config)


def test_a_sliding_window_shorter_than_the_positions_is_refused(tmp_path, folder):
    import shutil

    edited = tmp_path / "windowed"
    shutil.copytree(folder, edited)
    config_file = edited / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "sliding_window": 8}))
    with pytest.raises(ConfigError, match="its sliding_window=8 is shorter than its max_position_embeddings=16: "
                                          "ppctl attends to the whole sequence"):
        _config(edited)
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "sliding_window": POSITIONS}))
    _config(edited)
