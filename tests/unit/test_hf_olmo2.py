"""The OLMo 2 family against ``transformers``: read, decoded and written with transformers' logits; OLMo refused.

Tiny random ``Olmo2ForCausalLM`` folders saved locally (``tests/harness/hf_models.py``): grouped-query attention
(4 query heads on 2 key/value heads, untied) and multi-head attention with a head width of 16 beside hidden / heads =
8 (tied). Started from the folder alone (``model.init_from``), ppctl's float64 model gives transformers' logits to
1e-10 relative with transformers' RMSNorms and rotary angles in float64 (it computes both in float32 whatever the
model's dtype), also at tp=2 (the TP ranks as threads: each holds its heads' slice of the whole-width q/k norms, the
sums of squares added over the ranks), its greedy tokens are transformers' ``generate``'s, and its tensors written
back are a folder transformers reads with the same logits. The whole-width norm's TP sum is autograd-correct at tp=2:
each rank's input and weight gradients are the single process's slices (a backward that does not sum the ranks'
shares fails). Broken twins must fail: the norms moved before attention and MLP (Llama's order), the q/k norms left
out, each TP rank's q/k slice normalised alone. ``config.json`` is read with ``Olmo2Config``'s defaults, compared with
transformers' own config object; OLMo (v1) and what OLMo 2 does not compute are refused in one line.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ppctl.config import ConfigError
from tests.harness.hf_models import (HEADS, OLMO2, VOCAB, folder_run_config, greedy_matches_transformers, hf_config,
                                     random_tokens, reference_logits, relative_error, save_random, save_tiny,
                                     transformers_logits, written_back_equals_the_folder)
from tests.unit.test_hf_gemma import llama_shaped_attributes, transformers_attributes

EXACT = 1e-10
FLOAT32_LOGITS = 1e-6  # transformers' generate hands out float32 logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{name: folder}``: the tiny OLMo 2 (GQA, untied) and its multi-head twin (heads 16 wide, tied)."""
    from transformers import Olmo2Config

    root = tmp_path_factory.mktemp("olmo2")
    multi_head = Olmo2Config(**{**hf_config(OLMO2, True).to_dict(), "num_key_value_heads": HEADS, "head_dim": 16})
    return {"gqa_untied": save_tiny(root / "gqa", OLMO2, seed=3), "mha_tied": save_random(root / "mha", multi_head, 4)}


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied"])
def test_logits_equal_transformers_in_float64(folders, name):
    config, tokens = folder_run_config(folders[name]), random_tokens()
    assert config.model.family == "olmo2"
    assert relative_error(reference_logits(config, tokens), transformers_logits(folders[name], tokens)) < EXACT


def test_with_transformers_own_float32_norms_within_float32(folders):
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders["gqa_untied"]), tokens),
                          transformers_logits(folders["gqa_untied"], tokens, exact=False)) < 1e-5


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied"])
def test_logits_at_tp2_equal_transformers(folders, monkeypatch, name):
    """Each TP rank normalises its heads' slice of q and k by the whole width's root mean square."""
    from tests.harness.lockstep_tp import lockstep_logits

    config, tokens = folder_run_config(folders[name], "parallel.tp=2"), random_tokens()
    logits = lockstep_logits(config, tokens, monkeypatch)[..., :VOCAB]
    assert relative_error(logits, transformers_logits(folders[name], tokens)) < EXACT


def test_each_tp_rank_normalising_its_slice_alone_fails_at_tp2(folders, monkeypatch):
    import ppctl.model.olmo2.layers as layers
    from tests.harness.lockstep_tp import lockstep_logits

    monkeypatch.setattr(layers, "sum_over_tp", lambda tensor, tp: tensor)
    config, tokens = folder_run_config(folders["gqa_untied"], "parallel.tp=2"), random_tokens()
    logits = lockstep_logits(config, tokens, monkeypatch)[..., :VOCAB]
    assert relative_error(logits, transformers_logits(folders["gqa_untied"], tokens)) > 1e-3


def _norm_gradients(tp_size: int, monkeypatch, sum_over_tp=None):
    """Each TP rank's (output, input gradient, weight gradient) of one ``WholeWidthRMSNorm`` (TP ranks as threads)
    under the loss sum over ranks of ``output * probe``; ``sum_over_tp``: another sum to put in its place."""
    import ppctl.model.olmo2.layers as layers
    import ppctl.parallel.tensor_parallel as tensor_parallel
    from ppctl.parallel.tensor_parallel import TPGroup
    from tests.harness.lockstep_tp import _Lockstep, _Rank

    width, generator = 12, torch.Generator().manual_seed(5)
    inputs, weight, probe = (torch.randn(2, 3, width, generator=generator, dtype=torch.float64) for _ in range(3))
    weight = weight[0, 0]
    monkeypatch.setattr(tensor_parallel, "dist", _Lockstep(tp_size))
    if sum_over_tp is not None:
        monkeypatch.setattr(layers, "sum_over_tp", sum_over_tp)
    lock = threading.Lock()

    def rank_gradients(rank: int):
        tp = TPGroup(_Rank(rank), tp_size, rank)
        norm = layers.WholeWidthRMSNorm(width, 1e-6, tp, torch.float64)
        with torch.no_grad():
            norm.weight.copy_(tp.shard(weight, 0))
        local = tp.shard(inputs, -1).clone().requires_grad_()
        output = norm(local)
        (output * tp.shard(probe, -1)).sum().backward()
        with lock:
            return output.detach(), local.grad, norm.weight.grad

    with ThreadPoolExecutor(tp_size) as pool:
        return [future.result() for future in [pool.submit(rank_gradients, rank) for rank in range(tp_size)]]


def test_the_whole_width_norm_is_autograd_correct_at_tp2(monkeypatch):
    """Every rank's output, input gradient and weight gradient are its slices of the single process's; a backward that
    keeps each rank's own share (the forward's sum without the gradient's) fails."""
    (whole,) = _norm_gradients(1, monkeypatch)
    ranks = _norm_gradients(2, monkeypatch)
    for got, expected in zip(zip(*ranks), whole):
        joined = torch.cat(got, dim=-1)
        assert relative_error(joined, expected) < EXACT
    from ppctl.parallel.tensor_parallel import reduce_from_tp_region

    broken = _norm_gradients(2, monkeypatch, sum_over_tp=reduce_from_tp_region)  # identity backward
    assert relative_error(torch.cat([rank[1] for rank in broken], dim=-1), whole[1]) > 1e-3


def test_greedy_tokens_equal_transformers_generate(folders):
    """The model read from the folder decodes through its KV cache (``ppctl generate``'s ``generate_ids``) to
    transformers' greedy tokens, its step logits to float32 rounding."""
    greedy_matches_transformers(folders["gqa_untied"], [3, 14, 15, 9, 26, 5], 10, FLOAT32_LOGITS)


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied"])
def test_written_tensors_are_the_folders_and_transformers_reads_them(folders, tmp_path, name):
    """The dense model's tensors written back are the folder's, bit for bit; with the ``config.json`` ppctl writes,
    transformers computes the folder's logits."""
    from ppctl.model.olmo2.hf import FORMAT

    written_back_equals_the_folder(FORMAT, folders[name], tmp_path / "written", EXACT)


def _norms_before(layer, hidden, rotary=None, cache=None, mask=None):
    """Llama's order: each block reads the normalised input, its output added unnormalised."""
    hidden = hidden + layer.self_attn(layer.post_attention_layernorm(hidden), rotary, cache, mask)
    return hidden + layer.mlp(layer.post_feedforward_layernorm(hidden))


def _without_qk_norms(monkeypatch):
    from ppctl.model.olmo2.layers import WholeWidthRMSNorm

    monkeypatch.setattr(WholeWidthRMSNorm, "forward", lambda norm, hidden: hidden)


@pytest.mark.parametrize("twin", ["norms before attention and MLP", "q/k norms left out"])
def test_a_broken_twin_fails_the_comparison(folders, monkeypatch, twin):
    from ppctl.model.olmo2.layers import Olmo2Layer

    if twin == "norms before attention and MLP":
        monkeypatch.setattr(Olmo2Layer, "forward", _norms_before)
    else:
        _without_qk_norms(monkeypatch)
    tokens = random_tokens()
    assert relative_error(reference_logits(folder_run_config(folders["gqa_untied"]), tokens),
                          transformers_logits(folders["gqa_untied"], tokens)) > 1e-3


# --- config.json as transformers reads it ----------------------------------------------------------------------------

@pytest.mark.parametrize("edit", [{}, {"num_key_value_heads": 2}, {"head_dim": 16}, {"hidden_act": "swish"}],
                         ids=["defaults", "kv_heads", "head_dim", "swish"])
def test_a_sparse_config_json_is_read_with_transformers_defaults(tmp_path, edit):
    from transformers import AutoConfig

    from ppctl.model.olmo2.hf import FORMAT

    sparse = {"model_type": "olmo2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, **edit}
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    shape = FORMAT.shape_from_hf(sparse)
    assert transformers_attributes(AutoConfig.from_pretrained(tmp_path)) == llama_shaped_attributes(shape)
    assert shape["family"] == "olmo2"


def _refusal(folder) -> str:
    with pytest.raises(ConfigError) as caught:
        folder_run_config(folder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.init_from={folder}: "), message
    return message.removeprefix(f"model.init_from={folder}: ")


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's olmo2 computes SwiGLU with SiLU only"),
    ({"attention_bias": True}, "its attention_bias=true puts a bias on every attention projection"),
    ({"rms_norm_eps": 1}, "its rms_norm_eps=1 is an integer, not a number with a fraction or exponent"),
])
def test_what_olmo2_cannot_compute_is_refused(folders, tmp_path, edit, expected):
    import shutil

    folder = shutil.copytree(folders["gqa_untied"], tmp_path / "edited")
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    assert _refusal(folder).startswith(expected)


def test_olmo_v1_is_refused_by_name_with_the_reason(tmp_path):
    from transformers import OlmoConfig

    shape = {key: value for key, value in hf_config(OLMO2, False).to_dict().items()
             if key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")}
    folder = save_random(tmp_path / "olmo", OlmoConfig(**shape, pad_token_id=None, eos_token_id=None))
    assert _refusal(folder).startswith("its model_type 'olmo' is OLMo (v1), whose LayerNorm has neither scale nor "
                                       "shift and whose clip_qkv clamps")
