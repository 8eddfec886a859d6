"""The Llama family against ``transformers``: a model read from a Hugging Face folder computes what transformers
computes, each TP rank reads its own slices, and ppctl's tensors written back are the folder's.

Tiny random ``LlamaForCausalLM`` models (grouped-query attention: 4 query heads on 2 key/value heads; Llama 3's
rotary scaling; tied or not) and a ``Qwen2ForCausalLM`` (q/k/v biases) are saved locally. In float64, ppctl's
single-process model started from the folder (``model.init_from``) gives transformers' logits to 1e-10 relative,
with transformers' rotary angles taken in float64 (it computes them in float32 whatever the model's dtype);
within 1e-6 with its own. A broken twin of the mapping (gate and up swapped) must fail. Refusals: one line each.
"""

import json

import pytest
import torch

from ppctl.config import ConfigError, compose_config, validate
from tests.harness.hf_models import relative_error

VOCAB, LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, POSITIONS = 50, 3, 32, 4, 2, 48, 16
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 4}  # every frequency band is hit within 16 positions
MODELS = {"llama": ("llama", False, None), "llama tied, llama3 rotary": ("llama", True, LLAMA3_SCALING),
          "qwen2": ("qwen2", False, None)}
EXACT = 1e-10


def _save(folder, kind: str, tie: bool, scaling):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
                 tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, rms_norm_eps=1e-5)
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(**shape, rope_parameters=rope)
    torch.manual_seed(3)
    model = (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: _save(tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", "")), *spec)
            for name, spec in MODELS.items()}


def _config(folder, *extra, shape_of=None):
    config = compose_config(["data=synthetic", "parallel=single", "trainer.precision=fp64", "model=llama_tiny",
                             f"model.vocab_size={VOCAB}", f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}",
                             f"model.num_heads={HEADS}", f"model.num_kv_heads={KV_HEADS}",
                             f"model.ffn_hidden_size={FFN}", f"model.max_seq_length={POSITIONS}",
                             f"trainer.seq_length={POSITIONS}", "model.norm_epsilon=1e-5", *_shape_overrides(shape_of or folder),
                             f"model.init_from={folder}", *extra])
    validate(config)
    return config


def _shape_overrides(folder) -> list[str]:
    """What ppctl's settings must say of the folder's model beyond the common shape: tying, scaling, biases."""
    from ppctl.model.llama.hf import FORMAT

    shape = FORMAT.shape_from_hf(json.loads((folder / "config.json").read_text()))
    keys = ("tie_embeddings", "qkv_bias", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
            "rope_original_max_position")
    return [f"model.{key}={str(shape[key]).lower() if isinstance(shape[key], bool) else shape[key]}"
            for key in keys if key in shape]


def _hf_logits(folder, tokens, exact_rotary: bool = True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    if exact_rotary:
        _in_float64(model)
    with torch.no_grad():
        return model(tokens).logits


def _in_float64(model) -> None:
    """transformers' RMSNorm and rotary frequencies in float64 (it computes both in float32 whatever the model's
    dtype): its norms' math as written in float64, its frequencies as its config gives them, in float64."""
    from ppctl.model.llama.hf import FORMAT
    from ppctl.model.llama.layers import RopeScaling, llama_inverse_frequencies

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = (lambda norm: lambda hidden: norm.weight * hidden * torch.rsqrt(
                hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))(module)
    shape = FORMAT.shape_from_hf(model.config.to_dict())
    scaling = None
    if "rope_scaling_factor" in shape:
        scaling = RopeScaling(shape["rope_scaling_factor"], shape["rope_low_freq_factor"],
                              shape["rope_high_freq_factor"], shape["rope_original_max_position"])
    rotary = model.model.rotary_emb
    rotary.inv_freq = llama_inverse_frequencies(HIDDEN // HEADS, shape["rope_theta"], scaling)

    def float64_forward(hidden, position_ids):
        angles = position_ids.to(torch.float64)[..., None] * rotary.inv_freq
        table = torch.cat([angles, angles], dim=-1)
        return table.cos().to(hidden.dtype), table.sin().to(hidden.dtype)

    rotary.forward = float64_forward


def _logits(config, tokens):
    from ppctl.run.reference import reference_model

    with torch.no_grad():
        return reference_model(config)(tokens)[..., :VOCAB]


def _tokens():
    return torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers_in_float64(folders, name):
    folder, tokens = folders[name], _tokens()
    assert relative_error(_logits(_config(folder), tokens), _hf_logits(folder, tokens)) < EXACT


def test_with_transformers_own_float32_rotary_within_float32(folders):
    folder, tokens = folders["llama tied, llama3 rotary"], _tokens()
    assert relative_error(_logits(_config(folder), tokens), _hf_logits(folder, tokens, exact_rotary=False)) < 1e-6


@pytest.mark.parametrize("tp", [2])
def test_each_tp_rank_reads_the_dense_models_shard(folders, tp):
    """Each TP rank's chunk holds the single process's shards: whole key/value heads, rows and columns."""
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.run.reference import reference_model
    from tests.distributed.equivalence import expected_shard

    folder = folders["qwen2"]
    dense = dict(reference_model(_config(folder)).named_parameters())
    config = _config(folder, f"parallel.tp={tp}")
    for tp_rank in range(tp):
        chunk = build_chunk(config, [0, 1, 2], True, True, TPGroup(None, tp, tp_rank))
        for name, param in chunk.named_parameters():
            rule = rule_of(param)
            assert torch.equal(param, expected_shard(name, rule, dense[rule.tied_to or name], param, tp, tp_rank,
                                                     VOCAB)), (name, tp_rank)


@pytest.mark.parametrize("name", MODELS)
def test_the_dense_tensors_map_back_to_the_folders_bit_for_bit(folders, name):
    from safetensors.torch import load_file

    from ppctl.model.from_config import model_shape
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.llama.hf import FORMAT
    from ppctl.model.rules import rule_of
    from ppctl.run.reference import reference_model

    folder = folders[name]
    config = _config(folder, "trainer.precision=fp32")
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in reference_model(config).named_parameters()}
    written = to_hf_tensors(FORMAT, model_shape(config), read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = FORMAT.hf_config(model_shape(config))
    assert FORMAT.shape_from_hf(exported) == FORMAT.shape_from_hf(read_hf_config(folder))


def test_a_broken_mapping_fails_the_comparison(folders, monkeypatch):
    """gate and up swapped: the logits move far beyond the tolerance."""
    from dataclasses import replace

    from ppctl.model.llama.hf import FORMAT

    original = FORMAT.tensors

    def swapped(model, hf_config):
        specs = original(model, hf_config)
        for name, spec in specs.items():
            if "gate_proj" in name or "up_proj" in name:
                other = "up_proj" if "gate_proj" in name else "gate_proj"
                specs[name] = replace(spec, names=tuple(n.replace(name.split(".")[-2], other) for n in spec.names))
        return specs

    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: swapped(model, hf_config))
    folder, tokens = folders["llama"], _tokens()
    assert relative_error(_logits(_config(folder), tokens), _hf_logits(folder, tokens)) > 1e-3


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's llama computes SwiGLU with SiLU only"),
    ({"attention_bias": True}, "its attention_bias=true puts a bias on the output projection too"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "its rope_type='yarn'"),
])
def test_what_llama_cannot_compute_is_refused(tmp_path, folders, edit, expected):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(folders["llama"], folder)
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _config(folder, shape_of=folders["llama"])


def test_a_shape_mismatch_names_the_key(folders):
    with pytest.raises(ConfigError, match=r"gives model.num_kv_heads=2, this run has model.num_kv_heads=4"):
        _config(folders["llama"], "model.num_kv_heads=4")


def test_tensors_named_without_the_base_model_prefix_load_the_same(tmp_path, folders):
    """A Qwen2 folder whose tensors are named as its base model names them (``layers.0...``, no ``model.``; the
    untied ``lm_head`` as it is) gives ppctl the same model, bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    original, folder = folders["qwen2"], tmp_path / "base_names"
    folder.mkdir()
    shutil.copy(original / "config.json", folder / "config.json")
    tensors = load_file(str(original / "model.safetensors"))
    save_file({name.removeprefix("model."): tensor for name, tensor in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokens = _tokens()
    assert torch.equal(_logits(_config(folder), tokens), _logits(_config(original), tokens))
