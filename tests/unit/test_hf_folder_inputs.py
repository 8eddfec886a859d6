"""A Hugging Face folder read as ``transformers`` reads it, or refused in one line; nothing outside it opened.

``config.json``: the rotary parameters where transformers finds them (an older ``rope_scaling`` replaces
``rope_parameters`` whole, ``rope_theta`` beside them fills in), compared with transformers' own config object,
and a Llama 3 ``rope_scaling`` beside a plain ``rope_parameters`` giving transformers' logits; a scaling ppctl does
not compute (``linear``) refused by name, StarCoder2's older ``type`` key too. ``tie_word_embeddings: true`` beside
an ``lm_head.weight`` of its own: transformers keeps it (checked here), so ppctl reads the folder untied and gives
transformers' logits. Values type-checked as transformers' strict config fields check them (a string or a float
for an integer is refused as transformers refuses it), a 0 size or rotary base refused (transformers reads it as
0, not as unset), the architecture read from ``model_type`` as ``AutoModelForCausalLM`` builds it whatever
``architectures`` holds, ``hidden_act: swish`` read as SiLU (transformers' ``ACT2FN`` computes the same).

Files: an index entry that leaves the folder (``..``, an absolute path, a link out) is refused naming it, while a
hub cache's links into its ``blobs`` are read; a FIFO where a file should be is refused at once, not read. Malformed
safetensors files and indexes are one line naming the file, the tensor and what is wrong, before anything starts;
a tensor whose shape is not the one the config makes (``n_positions`` of 10**9 beside a 16-row table) is refused
before anything is allocated, and the shapes ppctl expects are those of the model it builds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import GPT2, LLAMA, STARCODER2, VOCAB, hf_model, overrides, relative_error, save_tiny

EXACT = 1e-10
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved tiny model per architecture, untied."""
    return {architecture: save_tiny(tmp_path_factory.mktemp(architecture), architecture)
            for architecture in (GPT2, STARCODER2, LLAMA)}


def _edited(folders, tmp_path, architecture, edit=None, drop=()):
    """A copy of a saved folder with its config.json's keys ``edit``ed and ``drop``ped."""
    folder = shutil.copytree(folders[architecture], tmp_path / f"{architecture}_edited")
    config = {key: value for key, value in json.loads((folder / "config.json").read_text()).items() if key not in drop}
    (folder / "config.json").write_text(json.dumps({**config, **(edit or {})}))
    return folder


def _config(folder, architecture, *extra, tie=False):
    config = compose_config([*overrides(folder, architecture, tie), "parallel=single", "trainer.precision=fp64",
                             *extra])
    validate(config)
    return config


def _refusal(folder, architecture, *extra, tie=False) -> str:
    with pytest.raises(ConfigError) as caught:
        _config(folder, architecture, *extra, tie=tie)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.init_from={folder}: "), message
    return message.removeprefix(f"model.init_from={folder}: ")


def _logits(config, tokens):
    from ppctl.run.reference import reference_model

    with torch.no_grad():
        return reference_model(config)(tokens)[..., :VOCAB]


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _transformers_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


# --- rotary parameters where transformers reads them ----------------------------------------------------------------

@pytest.mark.parametrize("edit", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": {"rope_type": "default"},
     "rope_theta": 300000.0},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 300000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 300000.0, "rope_scaling": {}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": LLAMA3},
    {"rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}, "rope_theta": 2e5},
], ids=["scaling_over_parameters", "scaling_and_top_level_theta", "theta_beside", "empty_scaling", "llama3_scaling",
        "older_type_key"])
def test_llama_rotary_parameters_are_transformers(folders, tmp_path, edit):
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.llama.hf import FORMAT

    folder = _edited(folders, tmp_path, LLAMA, edit, drop=("rope_parameters", "rope_theta"))
    shape, theirs = FORMAT.shape_from_hf(read_hf_config(folder)), _transformers_config(folder).rope_parameters
    assert shape["rope_theta"] == theirs["rope_theta"]
    assert ("rope_scaling_factor" in shape) == (theirs["rope_type"] == "llama3")
    if theirs["rope_type"] == "llama3":
        assert (shape["rope_scaling_factor"], shape["rope_original_max_position"]) == (
            theirs["factor"], theirs["original_max_position_embeddings"])


def test_a_llama3_rope_scaling_beside_plain_rope_parameters_gives_transformers_logits(folders, tmp_path):
    """transformers computes Llama 3's scaling from ``rope_scaling`` (with the top-level ``rope_theta``): so does
    ppctl, to its logits; the plain rotary embedding of ``rope_parameters`` misses them."""
    edit = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": LLAMA3,
            "rope_theta": 20000.0}
    folder = _edited(folders, tmp_path, LLAMA, edit)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder)(tokens).logits
    scaling = [f"model.rope_scaling_factor={LLAMA3['factor']}", "model.rope_low_freq_factor=1.0",
               "model.rope_high_freq_factor=4.0", "model.rope_original_max_position=8"]
    assert relative_error(_logits(_config(folder, LLAMA, *scaling, "model.rope_theta=20000.0"), tokens),
                          expected) < EXACT
    assert "gives model.rope_theta=20000.0, this run has model.rope_theta=10000.0" in _refusal(folder, LLAMA)


@pytest.mark.parametrize("architecture, edit, expected", [
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
             "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "its rope_scaling (which transformers reads over its rope_parameters) gives rope_type='dynamic': ppctl computes "
     "the plain rotary embedding ('default') and the 'llama3', 'linear', 'yarn' scalings only"),
    (STARCODER2, {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 10000.0},
     "its rope_scaling gives rope_type='linear': ppctl's gpt has the plain rotary embedding ('default') only"),
    (STARCODER2, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                  "rope_scaling": {"type": "linear", "factor": 4.0}},
     "its rope_scaling (which transformers reads over its rope_parameters) gives rope_type='linear'"),
])
def test_a_rotary_scaling_transformers_applies_and_ppctl_does_not_compute_is_refused(folders, tmp_path, architecture,
                                                                                     edit, expected):
    folder = _edited(folders, tmp_path, architecture, edit, drop=("rope_parameters", "rope_theta"))
    scaling = edit["rope_scaling"]
    # what transformers would compute
    assert _transformers_config(folder).rope_parameters["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    assert _refusal(folder, architecture).startswith(expected)


# --- a tied config beside an output layer of its own ----------------------------------------------------------------

def test_tie_word_embeddings_beside_its_own_lm_head_is_read_untied_as_transformers_does(folders, tmp_path):
    folder = _edited(folders, tmp_path, GPT2, {"tie_word_embeddings": True})
    loaded = hf_model(folder)
    assert not torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)  # transformers kept lm_head
    tokens = _tokens()
    with torch.no_grad():
        expected = loaded(tokens).logits
    assert relative_error(_logits(_config(folder, GPT2), tokens), expected) < EXACT
    assert _refusal(folder, GPT2, tie=True) == (
        "its lm_head.weight differs from its word embedding, so transformers does not tie them whatever "
        "tie_word_embeddings says (model.tie_embeddings=False), this run has model.tie_embeddings=True")


def test_a_tied_folder_whose_lm_head_is_the_embedding_stays_tied(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _edited(folders, tmp_path, GPT2, {"tie_word_embeddings": True})
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    _config(folder, GPT2, tie=True)


# --- values type-checked and read as transformers reads them --------------------------------------------------------

@pytest.mark.parametrize("architecture, edit, expected", [
    (GPT2, {"n_embd": "32"}, 'its n_embd="32" is a string, not an integer: transformers refuses it'),
    (GPT2, {"n_embd": 32.0}, "its n_embd=32.0 is a number with a fraction or exponent (such as 1e-05), not an integer"),
    (GPT2, {"tie_word_embeddings": 0}, "its tie_word_embeddings=0 is an integer, not true or false"),
    (LLAMA, {"rms_norm_eps": 1}, "its rms_norm_eps=1 is an integer, not a number with a fraction or exponent"),
    (LLAMA, {"hidden_act": 5}, "its hidden_act=5 is an integer, not a string"),
])
def test_a_value_of_another_json_type_is_refused_as_transformers_refuses_it(folders, tmp_path, architecture, edit,
                                                                           expected):
    folder = _edited(folders, tmp_path, architecture, edit)
    with pytest.raises(Exception, match="Validation error for field"):
        _transformers_config(folder)
    assert _refusal(folder, architecture).startswith(expected)


@pytest.mark.parametrize("architecture, edit, attribute, expected", [
    (LLAMA, {"head_dim": 0}, "head_dim", "its head_dim=0 must be above 0 (transformers reads it as it is, not as "
                                         "unset: null or no key is unset)"),
    (LLAMA, {"num_key_value_heads": 0}, "num_key_value_heads", "its num_key_value_heads=0 must be above 0"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, None,
     "its rope_parameters.rope_theta=0.0: a rotary base is a positive finite number"),
    (STARCODER2, {"rope_theta": 0}, None, "its rope_theta=0: a rotary base is a positive finite number"),
    (GPT2, {"n_head": 0}, "n_head", "its n_head=0 must be above 0"),
])
def test_a_zero_size_is_read_as_zero_by_transformers_and_refused(folders, tmp_path, architecture, edit, attribute,
                                                                  expected):
    drop = ("rope_parameters",) if architecture == STARCODER2 else ()
    folder = _edited(folders, tmp_path, architecture, edit, drop=drop)
    theirs = _transformers_config(folder)
    value = getattr(theirs, attribute) if attribute else theirs.rope_parameters["rope_theta"]
    assert value == 0  # not its default: transformers reads the 0
    assert _refusal(folder, architecture).startswith(expected)


@pytest.mark.parametrize("architectures", ["GPT2LMHeadModel", 5, {"a": 1}, None, ["LlamaForCausalLM"]])
def test_the_architecture_is_read_from_model_type_as_transformers_builds_it(folders, tmp_path, architectures):
    from transformers import AutoModelForCausalLM

    from ppctl.model.gpt.hf import FORMAT
    from ppctl.model.hf_format import architecture_of, read_hf_config

    drop = ("architectures",) if architectures is None else ()
    edit = {} if architectures is None else {"architectures": architectures}
    folder = _edited(folders, tmp_path, GPT2, edit, drop=drop)
    hf_config = read_hf_config(folder)
    built = AutoModelForCausalLM.from_config(_transformers_config(folder))
    assert architecture_of(hf_config) == type(built).__name__ == "GPT2LMHeadModel"
    assert FORMAT.shape_from_hf(hf_config) == FORMAT.shape_from_hf(read_hf_config(folders[GPT2]))
    _config(folder, GPT2)


def test_a_config_without_model_type_is_refused(folders, tmp_path):
    folder = _edited(folders, tmp_path, GPT2, drop=("model_type",))
    assert _refusal(folder, GPT2) == ("its config.json has no model_type, which transformers reads the architecture "
                                      "from (one of gemma, gemma2, gpt2, starcoder2, gpt_neox, llama, qwen2, "
                                      "mixtral, mistral, olmo2, olmo, phi3, qwen3, qwen2_moe, qwen3_moe)")


def test_swish_is_read_as_silu(folders, tmp_path):
    from transformers.activations import ACT2FN

    values = torch.linspace(-8, 8, 101, dtype=torch.float64)
    assert torch.equal(ACT2FN["swish"](values), torch.nn.functional.silu(values))
    _config(_edited(folders, tmp_path, LLAMA, {"hidden_act": "swish"}), LLAMA)


# --- nothing outside the folder ------------------------------------------------------------------------------------

def _indexed(folders, tmp_path, shard_of):
    """A copy of the GPT-2 folder whose weights are named by an index; ``shard_of(folder)``: the shard file name
    of its word embedding (every other tensor stays in ``model.safetensors``)."""
    folder = _edited(folders, tmp_path, GPT2)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    weight_map = {name: "model.safetensors" for name in names}
    weight_map["transformer.wte.weight"] = shard_of(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("kind", ["parent", "absolute", "link"])
def test_an_index_entry_outside_the_folder_is_refused_naming_it(folders, tmp_path, kind):
    outside = shutil.copy(folders[GPT2] / "model.safetensors", tmp_path / "outside.safetensors")

    def shard_of(folder):
        if kind == "parent":
            return "../outside.safetensors"
        if kind == "absolute":
            return str(outside)
        (folder / "linked.safetensors").symlink_to(outside)
        return "linked.safetensors"

    folder = _indexed(folders, tmp_path, shard_of)
    entry = {"parent": "../outside.safetensors", "absolute": str(outside), "link": "linked.safetensors"}[kind]
    message = _refusal(folder, GPT2)
    assert message.startswith(f"its model.safetensors.index.json entry transformer.wte.weight: {entry} "), message
    assert ("leads outside the folder" if kind == "link" else "is outside the folder") in message


def test_a_hub_cache_snapshot_links_into_its_blobs(folders, tmp_path):
    """The hub cache's own layout: ``snapshots/<revision>/<file>`` links to ``../../blobs/<hash>``."""
    repo = tmp_path / "models--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in folders[GPT2].iterdir():
        blob = shutil.copy(file, repo / "blobs" / f"hash_{file.name}")
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    _config(snapshot, GPT2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_a_fifo_in_the_folder_is_refused_not_read(folders, tmp_path, name):
    folder = _edited(folders, tmp_path, GPT2)
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    started = time.monotonic()
    assert _refusal(folder, GPT2) == (f"its {name} is not a regular file (a FIFO, a device or a folder would block "
                                      f"or never end)")
    assert time.monotonic() - started < 5


# --- malformed safetensors files and indexes ----------------------------------------------------------------------

def _safetensors(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
MALFORMED = {
    "length_beyond_the_file": (_safetensors({"a": F32}, bytes(8), length=10_000),
                               "its header length 10000 is beyond the file's"),
    "length_2_62": (_safetensors({"a": F32}, bytes(8), length=2**62),
                    f"its header length {2**62} is beyond the file's"),
    "header_a_list": (_safetensors([1, 2]), "its header is a list, not a JSON object"),
    "no_data_offsets": (_safetensors({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
                        'tensor a: its entry is {"dtype": "F32", "shape": [2]}, not an object with dtype, shape and '
                        'data_offsets'),
    "random_bytes": (bytes(range(7, 250, 3)) * 3, "is beyond the file's"),
    "shorter_than_8_bytes": (b"\x01\x02", "2 bytes, less than the 8 of its header length"),
    "shape_not_fitting": (_safetensors({"a": {**F32, "shape": [3]}}, bytes(8)),
                          "tensor a: F32 of shape [3] is 12 bytes, its data_offsets [0, 8] hold 8"),
    "dtype_not_fitting": (_safetensors({"a": {**F32, "dtype": "F64"}}, bytes(8)),
                          "tensor a: F64 of shape [2] is 16 bytes, its data_offsets [0, 8] hold 8"),
    "unknown_dtype": (_safetensors({"a": {**F32, "dtype": "F31"}}, bytes(8)), 'tensor a: unknown dtype "F31"'),
    "offsets_past_the_end": (_safetensors({"a": {**F32, "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
                             "tensor a: data_offsets [0, 16] end past the file's 8 data bytes"),
    "a_gap": (_safetensors({"a": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
              "tensor a: data_offsets start at 4, where the previous tensor ends at 0"),
    "header_not_json": (struct.pack("<Q", 4) + b"{{{{", "its header is no JSON"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_safetensors_file_is_one_line_naming_it(folders, tmp_path, case):
    content, expected = MALFORMED[case]
    folder = _edited(folders, tmp_path, GPT2)
    (folder / "model.safetensors").write_bytes(content)
    message = _refusal(folder, GPT2)
    assert message.startswith("its model.safetensors is no readable safetensors file: "), message
    assert expected in message, message


def test_a_truncated_safetensors_file_is_refused_naming_the_tensor(folders, tmp_path):
    folder = _edited(folders, tmp_path, GPT2)
    content = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(content[:-100])
    message = _refusal(folder, GPT2)
    assert message.startswith("its model.safetensors is no readable safetensors file: tensor ") and \
        "end past the file's" in message, message


@pytest.mark.parametrize("index, expected", [
    ({"weight_map": ["model.safetensors"]}, 'its model.safetensors.index.json has no weight_map object (tensor name '
                                            '-> shard file), it has ["model.safetensors"]'),
    ({"weight_map": {"transformer.wte.weight": 3}},
     "its model.safetensors.index.json maps transformer.wte.weight to 3, not a shard file name"),
    ([1, 2], "its model.safetensors.index.json has no weight_map object"),
    ({"weight_map": {"transformer.wte.weight": "missing.safetensors"}},
     "its model.safetensors.index.json entry transformer.wte.weight: missing.safetensors is not in the folder"),
])
def test_a_malformed_index_is_one_line(folders, tmp_path, index, expected):
    folder = _edited(folders, tmp_path, GPT2)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _refusal(folder, GPT2).startswith(expected)


# --- tensor shapes against the model's, before anything is allocated -----------------------------------------------

@pytest.mark.timeout(60)
def test_a_position_table_shorter_than_n_positions_is_refused_before_allocating(folders, tmp_path):
    """``n_positions`` of 10**9 beside the folder's 16-row table: ppctl's table would be 10**9 rows (128 GB in
    float64 at this width); refused from the headers, in validation and in ``ppctl generate``'s reader."""
    from ppctl.generate.source import GenerateError, load_model

    positions = 10**9
    folder = _edited(folders, tmp_path, GPT2, {"n_positions": positions})
    expected = (f"its tensor transformer.wpe.weight has shape [16, 32], its config.json makes it [{positions}, 32] "
                f"(ppctl's embedding.position.weight is [{positions}, 32])")
    assert _refusal(folder, GPT2, f"model.max_seq_length={positions}") == expected
    with pytest.raises(GenerateError) as caught:
        load_model(folder)
    assert str(caught.value).endswith(expected)


def test_a_transposed_or_split_tensor_of_another_shape_is_refused_naming_it(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _edited(folders, tmp_path, STARCODER2)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:16]
    save_file(tensors, str(folder / "model.safetensors"))
    assert _refusal(folder, STARCODER2) == (
        "its tensor model.layers.1.self_attn.k_proj.weight has shape [16, 32], its config.json makes it [32, 32] "
        "(ppctl's layers.1.attention.qkv.weight is [96, 32])")


@pytest.mark.parametrize("overrides_", [
    ["model=gpt_tiny", "model.qkv_bias=true"],
    ["model=gpt_tiny", "model.position_embedding=rope", "model.tie_embeddings=true"],
    ["model=llama_tiny", "model.num_kv_heads=2", "model.head_dim=24", "model.qkv_bias=true"],
    ["model=llama_tiny", "model.moe.num_experts=4", "model.moe.topk=2", "model.moe.expert_ffn_hidden_size=48"],
], ids=["gpt2", "starcoder2_tied", "qwen2_head_dim", "mixtral"])
def test_the_shapes_checked_are_those_of_the_model_ppctl_builds(overrides_):
    """Every parameter of the model built on the meta device (nothing allocated) has the shape ``dense_shapes``
    gives, its vocabulary rows unpadded."""
    from ppctl.model.family import resolve_model
    from ppctl.model.from_config import build_chunk
    from ppctl.model.hf_format import hf_format_of
    from ppctl.model.rules import rule_of
    from ppctl.parallel.layout import StageLayers

    config = compose_config(["parallel=single", "data=synthetic", *overrides_])
    expected = hf_format_of(resolve_model(config).family).dense_shapes(config.model)
    with torch.device("meta"):
        chunk = build_chunk(config, StageLayers.whole(config.model.num_layers), load_init_from=False)
    for name, param in chunk.named_parameters():
        shape = tuple(param.shape)
        if rule_of(param).vocab_rows:
            shape = (config.model.vocab_size, *shape[1:])
        assert expected[name] == shape, name
    assert math.prod(expected["embedding.word.weight"]) > 0
