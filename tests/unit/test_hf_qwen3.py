"""Qwen3 both ways: a ``Qwen3ForCausalLM`` folder read by ppctl's qwen3 family, and a ppctl Qwen3 exported as one.

A tiny random Qwen3 (4 layers, grouped-query attention, heads of 16 beside hidden 32 / 4 heads, per-head q/k
RMSNorms; ``tests/harness/hf_models.py``) saved by ``save_pretrained`` is named by ``model.init_from`` alone (the
folder gives the family and every key): its float64 logits are transformers' to 1e-10 relative with transformers'
norms and rotary angles in float64 (measured ~2e-15), and ``ppctl generate``'s greedy tokens are transformers'. The
other way, a random ppctl Qwen3 written by the export's own function is loaded by ``from_pretrained`` and gives
ppctl's logits to 1e-10. Broken twins: the q/k norms left out of the computation, or q_norm and k_norm swapped in
the mapping (import and export), fail by far. What Qwen3 computes and ppctl does not (a bias on every projection,
a window, another activation) is refused in one line, and ``config.json`` is read as transformers reads it
(``head_dim`` 128 when absent, strict types).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import (QWEN3, QWEN_HEAD_DIM, VOCAB, folder_run_config, hf_model, random_tokens,
                                     relative_error, save_tiny)

EXACT = 1e-10
BROKEN = 1e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3"), QWEN3, seed=2)


@pytest.fixture(scope="module")
def folder_logits(folder):
    """transformers' float64 logits of the folder's model on ``random_tokens()``."""
    with torch.no_grad():
        return hf_model(folder)(random_tokens()).logits


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def _ppctl(config):
    from ppctl.run.reference import reference_model

    return reference_model(config)


def test_a_qwen3_folder_alone_gives_transformers_logits_in_float64(folder, folder_logits):
    config = folder_run_config(folder)
    assert (config.model.family, config.model.head_dim, config.model.num_kv_heads) == ("qwen3", QWEN_HEAD_DIM, 2)
    assert relative_error(_logits(_ppctl(config), random_tokens()), folder_logits) < EXACT


def test_greedy_decoding_equals_transformers_generate(folder, tmp_path):
    from ppctl.generate.decode import generate_ids
    from ppctl.generate.sampling import Sampling
    from ppctl.generate.source import load_model
    from tests.harness.char_tokenizer import save_char_tokenizer

    copy = shutil.copytree(folder, tmp_path / "qwen3")
    save_char_tokenizer(copy, VOCAB)
    model = load_model(copy, precision="fp64")
    prompt = model.prompt_ids("Qwen", 6)
    ids = list(generate_ids(model.chunk, prompt, 8, Sampling(temperature=0.0)))
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model(copy).generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                           max_new_tokens=8, pad_token_id=0)
    assert ids == expected[0, len(prompt):].tolist()


def _omit_qk_norms(model):
    """The broken twin: every attention's q/k norms left out of the computation (their scales still loaded)."""
    from ppctl.model.llama.layers import GroupedQueryAttention

    attentions = [module for module in model.modules() if isinstance(module, GroupedQueryAttention)]
    assert attentions and all(attention.q_norm is not None for attention in attentions)
    for attention in attentions:
        attention.q_norm = attention.k_norm = None
    return model


def test_leaving_the_qk_norms_out_fails_the_comparison(folder, folder_logits):
    assert relative_error(_logits(_omit_qk_norms(_ppctl(folder_run_config(folder))), random_tokens()), folder_logits) > BROKEN


def _swap_qk_norms(monkeypatch):
    """The broken twin of the mapping: each layer's q_norm read from k_norm's tensor and the other way round."""
    from ppctl.model.qwen3.hf import FORMAT

    original = type(FORMAT).tensors

    def swapped(self, model, hf_config):
        return {name: replace(spec, names=tuple(hf.replace("q_norm", "#").replace("k_norm", "q_norm")
                                                .replace("#", "k_norm") for hf in spec.names))
                for name, spec in original(self, model, hf_config).items()}

    monkeypatch.setattr(type(FORMAT), "tensors", swapped)


def test_a_swapped_qk_norm_mapping_fails_the_import(folder, folder_logits, monkeypatch):
    _swap_qk_norms(monkeypatch)
    assert relative_error(_logits(_ppctl(folder_run_config(folder)), random_tokens()), folder_logits) > BROKEN


def test_the_tensors_map_back_to_the_folders_bit_for_bit(folder):
    """ppctl's parameters read from the folder, written back by the export's mapping, are the folder's tensors (the
    q/k norms of every layer included), and the config.json it writes describes the same model."""
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.qwen3.hf import FORMAT
    from ppctl.model.rules import rule_of

    config = folder_run_config(folder)
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in _ppctl(config).named_parameters()}
    written = to_hf_tensors(FORMAT, resolve_model(config).shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved) and "model.layers.3.self_attn.k_norm.weight" in saved
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = FORMAT.hf_config(resolve_model(config).shape)
    assert FORMAT.shape_from_hf(exported) == FORMAT.shape_from_hf(read_hf_config(folder))


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


def _random_qwen3():
    """A ppctl Qwen3 of the tiny shape from its preset, its weights drawn wide (norms around 1), and its config."""
    from tests.harness.hf_models import OVERRIDES

    config = compose_config(["model=qwen3_tiny", *OVERRIDES, f"model.head_dim={QWEN_HEAD_DIM}", "parallel=single",
                             "trainer.precision=fp64"])
    validate(config)
    model = _ppctl(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.2)
    return config, model


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
def test_an_exported_qwen3_gives_ppctls_logits_in_transformers(tmp_path):
    config, model = _random_qwen3()
    out = _export(tmp_path, config, model)
    written = json.loads((out / "config.json").read_text())
    assert (written["architectures"], written["model_type"], written["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3",
                                                                                      QWEN_HEAD_DIM)
    assert written["layer_types"] == ["full_attention"] * 4 and not written["attention_bias"]
    tokens = random_tokens()
    assert relative_error(_logits(model, tokens), hf_model(out)(tokens).logits.detach()) < EXACT


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_export_with_the_qk_norms_swapped_fails_in_transformers(tmp_path, monkeypatch):
    """The broken twin of the export (leaving the norms out is refused: the checkpoint's tensors must all map)."""
    config, model = _random_qwen3()
    _swap_qk_norms(monkeypatch)
    out = _export(tmp_path, config, model)
    tokens = random_tokens()
    assert relative_error(_logits(model, tokens), hf_model(out)(tokens).logits.detach()) > BROKEN


def _edited(folder, tmp_path, **edit):
    """A copy of the folder with its config.json's keys edited (None drops a key)."""
    copy = shutil.copytree(folder, tmp_path / "edited")
    config = {**json.loads((copy / "config.json").read_text()), **edit}
    (copy / "config.json").write_text(json.dumps({key: value for key, value in config.items() if value is not None}))
    return copy


REFUSED = [
    ({"attention_bias": True}, "its attention_bias=true puts a bias on q, k, v and the output projection: ppctl's "
                               "qwen3 has none there"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
     "its layer_types[1]='sliding_attention': ppctl's qwen3 attends to the whole sequence in every layer"),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
     "its use_sliding_window=true (sliding_window=8 on the layers from max_window_layers=2 on): ppctl's qwen3 "
     "attends to the whole sequence in every layer"),
    ({"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's qwen3 computes SwiGLU with SiLU only"),
    ({"head_dim": 16.0}, "its head_dim=16.0 is a number with a fraction or exponent (such as 1e-05), not an integer"),
]


@pytest.mark.parametrize("edit, message", REFUSED, ids=[next(iter(edit)) + str(index)
                                                        for index, (edit, _m) in enumerate(REFUSED)])
def test_what_ppctls_qwen3_does_not_compute_is_refused_in_one_line(folder, tmp_path, edit, message):
    edited = _edited(folder, tmp_path, **edit)
    with pytest.raises(ConfigError) as refused:
        folder_run_config(edited)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_window_no_layer_reaches_is_read(folder, tmp_path):
    """``use_sliding_window`` with every layer below ``max_window_layers`` windows none (Qwen3Config's rule)."""
    folder_run_config(_edited(folder, tmp_path, layer_types=None, use_sliding_window=True, sliding_window=8,
                    max_window_layers=4))


def test_config_json_is_read_as_transformers_reads_it(folder, tmp_path):
    """``head_dim`` absent is transformers' default 128 (not hidden / heads); ``mlp_bias`` and ``pretraining_tp``,
    keys Qwen3 has no field for, change nothing in transformers and are not read."""
    from transformers import AutoConfig

    from ppctl.model.qwen3.hf import FORMAT

    edited = _edited(folder, tmp_path, head_dim=None, mlp_bias=True, pretraining_tp=2)
    ours = FORMAT.shape_from_hf(json.loads((edited / "config.json").read_text()))
    theirs = AutoConfig.from_pretrained(edited)
    assert ours["head_dim"] == theirs.head_dim == 128 and ours["qkv_bias"] is False


def test_what_qwen3_cannot_express_is_refused_by_the_export(tmp_path):
    from ppctl.checkpoint.hf_export import ExportError, export_checkpoint

    config = compose_config(["model=qwen3_tiny", "data=synthetic", "parallel=single", "model.qkv_bias=true"])
    validate(config, data=False, prove_schedule=False)
    with pytest.raises(ExportError, match="model.qkv_bias=true: Qwen3ForCausalLM has no q/k/v biases alone"):
        export_checkpoint(tmp_path / "checkpoint", config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_llama_builds_no_qk_norms():
    """The hook is off for Llama: its layers hold the parameters they held before (llama_tiny unchanged)."""
    from ppctl.resolve import compose_config as compose

    config = compose(["model=llama_tiny", "data=synthetic", "parallel=single"])
    names = [name for name, _param in _ppctl(config).named_parameters()]
    assert not [name for name in names if "q_norm" in name or "k_norm" in name]
    qwen3 = [name for name, _param in _ppctl(compose(["model=qwen3_tiny", "data=synthetic",
                                                       "parallel=single"])).named_parameters()]
    assert sorted(set(qwen3) - set(names)) == sorted(f"layers.{layer}.self_attn.{norm}.weight"
                                                     for layer in range(4) for norm in ("q_norm", "k_norm"))
