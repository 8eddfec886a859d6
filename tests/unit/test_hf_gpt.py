"""The GPT family against ``transformers``: a model read from a Hugging Face folder computes what transformers
computes, and ppctl's tensors written back are the folder's.

Each case builds a tiny random GPT-2 (learned positions) or StarCoder2 (rotary) model locally, tied or not, with
random nonzero QKV biases as real checkpoints have (``model.qkv_bias=true``), its vocabulary of 50 ids padded to
64 rows by ppctl (``tests/harness/hf_models.py``). In float64: ppctl's single-process model started from the
folder (``model.init_from``) gives transformers' logits to 1e-10 relative (measured: 1.1e-15; StarCoder2 1e-15
with transformers' rotary angles taken in float64, 3e-8 with its own float32 ones); each TP rank's slices read
from the folder are the dense model's shards; and the dense tensors mapped back are the folder's, bit for bit.
Broken twins of the mapping (a transposed weight, q and k swapped, a vocabulary row dropped) must fail the logits
comparison. Refusals: one line each.

The tanh GELU (``model.activation=gelu_tanh``): every HF activation name ppctl reads is torch's GELU of its
approximation to one rounding in float64 (``gelu_fast``, refused, is thousands of roundings off); a GPT-2 with
``gelu_new`` and a StarCoder2 with ``gelu_pytorch_tanh`` (real checkpoints' own) give transformers' logits to 1e-10
(the exact GELU on them, the broken twin, misses by ~3e-4), and written back (the ``config.json`` export writes,
naming the architecture's own tanh GELU) transformers reloads the same logits.

Real GPT-2 (``gelu_new`` and its ``c_attn.bias``): at tp=2, TP ranks run as threads of this process, the logits
are transformers' (1.3e-15); broken twins (the bias dropped, its q and k blocks swapped, split over TP as plain
rows) miss by 0.28 or more. Tensors named without ``transformer.`` (``GPT2Model``'s and the hub's names), beside
GPT-2's mask buffers, load the same; a run without the bias exports zeros transformers reads to its logits.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import GPT2, STARCODER2, VOCAB, hf_model, overrides, relative_error, save_tiny

MODELS = [(GPT2, False), (GPT2, True), (STARCODER2, False), (STARCODER2, True)]
EXACT = 1e-10


def _config(folder, architecture, tie, *extra):
    config = compose_config([*overrides(folder, architecture, tie), "parallel=single", "trainer.precision=fp64",
                             *extra])
    validate(config)
    return config


def _logits(config, tokens):
    """ppctl's single-process logits over the real vocabulary (the reference model of the equivalence tests)."""
    from ppctl.run.reference import reference_model

    with torch.no_grad():
        return reference_model(config)(tokens)[..., :VOCAB]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved tiny model per (architecture, tie)."""
    return {(architecture, tie): save_tiny(tmp_path_factory.mktemp(f"{architecture}_{tie}"), architecture, tie)
            for architecture, tie in MODELS}


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("architecture, tie", MODELS)
def test_logits_equal_transformers_in_float64(folders, architecture, tie):
    folder = folders[(architecture, tie)]
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder)(tokens).logits
    assert relative_error(_logits(_config(folder, architecture, tie), tokens), expected) < EXACT


def test_starcoder2_with_its_own_float32_rotary_is_within_float32_of_ppctl(folders):
    """transformers computes rotary angles in float32 whatever the model's dtype: the only difference left."""
    folder = folders[(STARCODER2, False)]
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder, exact=False)(tokens).logits
    assert relative_error(_logits(_config(folder, STARCODER2, False), tokens), expected) < 1e-6


@pytest.mark.parametrize("architecture, tie", MODELS)
@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_reads_the_dense_models_shard(folders, monkeypatch, architecture, tie, tp):
    """Chunks built for each TP rank (the vocabulary padded to 64 * tp rows) hold the single process's tensors'
    shards: heads of q, k and v, row and column ranges, zero padding rows; read 100 elements at a time, so that
    every tensor's slice comes in several pieces (GPT-2's ``[in, out]`` ones too)."""
    import ppctl.model.hf_weights as hf_weights
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from tests.distributed.equivalence import expected_shard

    folder = folders[(architecture, tie)]
    dense = dict(_reference(_config(folder, architecture, tie)).named_parameters())
    config = _config(folder, architecture, tie, f"parallel.tp={tp}")
    monkeypatch.setattr(hf_weights, "READ_ELEMENTS", 100)
    for tp_rank in range(tp):
        for pre, post in ((True, False), (False, True)):  # a tied output layer alone on the last stage reads wte
            chunk = build_chunk(config, StageLayers(0, (1, 2) if pre else (3,), pre, post),
                                RankGroups(tp=TPGroup(None, tp, tp_rank)))
            for name, param in chunk.named_parameters():
                rule = rule_of(param)
                expected = expected_shard(name, rule, dense[rule.tied_to or name], param, tp, tp_rank, VOCAB)
                assert torch.equal(param, expected), (name, tp_rank)


def _reference(config):
    from ppctl.run.reference import reference_model

    return reference_model(config)


@pytest.mark.parametrize("architecture, tie", MODELS)
def test_the_dense_tensors_map_back_to_the_folders_bit_for_bit(folders, architecture, tie):
    from safetensors.torch import load_file

    from ppctl.model.gpt.hf import FORMAT
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.rules import rule_of

    folder = folders[(architecture, tie)]
    config = _config(folder, architecture, tie, "trainer.precision=fp32")
    dense = {name: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()  # as checkpoints hold
             for name, param in _reference(config).named_parameters()}
    written = to_hf_tensors(FORMAT, _shape(config), read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(written[name], tensor), name


def _shape(config):
    from ppctl.model.family import resolve_model

    return resolve_model(config).shape


class _Twin:
    """The GPT format with one defect in its mapping."""

    def __init__(self, defect):
        from ppctl.model.gpt.hf import FORMAT

        self.format, self.defect = FORMAT, defect
        self.architectures = FORMAT.architectures

    def __getattr__(self, name):
        return getattr(self.format, name)

    def tensors(self, model, hf_config):
        return {name: self.defect(name, spec) for name, spec in self.format.tensors(model, hf_config).items()}


def _transposed_projection(name, spec):
    return replace(spec, transpose=not spec.transpose) if name.endswith("attention.proj.weight") else spec


def _q_and_k_swapped(name, spec):
    return replace(spec, names=(spec.names[1], spec.names[0], spec.names[2])) if len(spec.names) == 3 else spec


@pytest.mark.parametrize("architecture, defect", [(GPT2, _transposed_projection), (STARCODER2, _transposed_projection),
                                                  (STARCODER2, _q_and_k_swapped)])
def test_a_broken_mapping_fails_the_comparison(folders, monkeypatch, architecture, defect):
    import ppctl.model.from_config as from_config

    folder = folders[(architecture, False)]
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder)(tokens).logits
    monkeypatch.setattr(from_config, "hf_format_of", lambda family: _Twin(defect))
    assert relative_error(_logits(_config(folder, architecture, False), tokens), expected) > 1e-3


def _shifted(blocks):
    """The first word dropped, rows read one off (a zero row below)."""
    first = blocks[0]
    return [replace(first, rows=(first.rows[0] + 1, first.rows[1])), *blocks[1:], _padding(1)]


def _last_word_as_padding(blocks):
    """The last real row taken for padding."""
    first = blocks[0]
    return [replace(first, rows=(first.rows[0], first.rows[1] - 1)), _padding(1), *blocks[1:]]


def _padding(rows):
    from ppctl.model.hf_weights import Block

    return Block(None, (0, rows))


@pytest.mark.parametrize("drop", [_shifted, _last_word_as_padding])
def test_a_dropped_vocabulary_row_fails_the_comparison(folders, monkeypatch, drop):
    import ppctl.model.hf_weights as hf_weights

    folder = folders[(GPT2, False)]
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder)(tokens).logits
    row_blocks = hf_weights._row_blocks

    def dropping(weights, spec, start, stop, vocab_rows):
        blocks = row_blocks(weights, spec, start, stop, vocab_rows)
        return drop(blocks) if vocab_rows else blocks

    monkeypatch.setattr(hf_weights, "_row_blocks", dropping)
    assert relative_error(_logits(_config(folder, GPT2, False), tokens), expected) > 1e-3


def _refusal(*items) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(list(items)))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_an_architecture_of_another_kind_is_refused(folders):
    folder = folders[(STARCODER2, False)]
    message = _refusal(*overrides(folder, GPT2, False))
    assert message == (f"model.init_from={folder}: its config.json is Starcoder2ForCausalLM "
                       f"(model.position_embedding=rope), this run has model.position_embedding=learned")


def test_an_architecture_no_family_reads_is_refused(tmp_path, folders):
    import json
    import shutil

    folder = shutil.copytree(folders[(GPT2, False)], tmp_path / "unknown")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "nosuch"}))
    assert _refusal(*overrides(folder)) == (
        f"model.init_from={folder}: its config.json has model_type='nosuch', which no model family reads (one of "
        f"gemma, gemma2, gpt2, starcoder2, gpt_neox, llama, qwen2, mixtral, mistral, olmo2, olmo, phi3, qwen3, "
        f"qwen2_moe, qwen3_moe)")


def test_a_shape_mismatch_names_the_key_and_both_values(folders, tanh_folders):
    folder = folders[(GPT2, False)]
    message = _refusal(*overrides(folder), "model.hidden_size=64")
    assert message == (f"model.init_from={folder}: its config.json gives model.hidden_size=32, this run has "
                       f"model.hidden_size=64")
    tied = _refusal(*overrides(folder, GPT2, True))
    assert "model.tie_embeddings=False, this run has model.tie_embeddings=True" in tied
    assert _refusal(*overrides(tanh_folders[GPT2]), "model.activation=gelu") == (
        f"model.init_from={tanh_folders[GPT2]}: its config.json gives model.activation=gelu_tanh, this run has "
        f"model.activation=gelu")
    assert "gives model.activation=gelu, this run has model.activation=gelu_tanh" in _refusal(
        *overrides(folder), "model.activation=gelu_tanh")


def test_a_run_without_the_qkv_bias_is_refused_a_folder_that_has_it(folders):
    """Every GPT-2 has ``c_attn.bias`` and a StarCoder2 with ``use_bias`` its q/k/v biases: a run must hold them."""
    for architecture in (GPT2, STARCODER2):
        folder = folders[(architecture, False)]
        assert _refusal(*overrides(folder, architecture), "model.qkv_bias=false") == (
            f"model.init_from={folder}: its config.json gives model.qkv_bias=True, this run has model.qkv_bias=False")


@pytest.mark.parametrize("edit, expected", [
    ({"activation_function": "gelu_fast"}, "its activation_function='gelu_fast' is no activation ppctl's gpt "
                                           "computes exactly (model.activation=gelu: gelu, gelu_python; "
                                           "model.activation=gelu_tanh: gelu_new, "),
    ({"scale_attn_by_inverse_layer_idx": True}, "its attention scores are not scaled by 1/sqrt(head dim) alone"),
])
def test_what_gpt_cannot_compute_is_refused(tmp_path, folders, edit, expected):
    import json
    import shutil

    folder = shutil.copytree(folders[(GPT2, False)], tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    assert expected in _refusal(*overrides(folder))


def test_a_missing_folder_or_tensor_is_refused(tmp_path, folders):
    import shutil

    assert _refusal(*overrides(tmp_path / "nowhere")) == f"model.init_from={tmp_path / 'nowhere'}: no such folder"
    folder = shutil.copytree(folders[(GPT2, False)], tmp_path / "partial")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    assert _refusal(*overrides(folder)).endswith("it has no tensor lm_head.weight (ppctl's output_layer.weight)")


def test_a_resumed_run_does_not_read_init_from(tmp_path):
    """trainer.resume_from reads the checkpoint: the HF folder is neither checked nor loaded."""
    validate(compose_config([*overrides(tmp_path / "gone"), f"trainer.resume_from={tmp_path}"]))


def test_sharded_weights_load_in_transformers_and_in_ppctl(tmp_path, folders):
    """Weights written in shards with an index (``write_weights`` above its threshold) are one model to both."""
    import shutil

    from safetensors.torch import load_file

    from ppctl.checkpoint.hf_export import write_weights

    folder = shutil.copytree(folders[(STARCODER2, True)], tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    write_weights(folder, tensors, max_shard_bytes=20_000)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").exists()
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(folder)(tokens).logits
    assert relative_error(_logits(_config(folder, STARCODER2, True), tokens), expected) < EXACT


# --- the tanh GELU: GPT-2's own gelu_new, StarCoder2's own gelu_pytorch_tanh ---------------------------------------

TANH = {GPT2: "gelu_new", STARCODER2: "gelu_pytorch_tanh"}  # each architecture's default: what real checkpoints use


@pytest.fixture(scope="module")
def tanh_folders(tmp_path_factory):
    """One saved tiny untied model per architecture with its own tanh GELU."""
    return {architecture: save_tiny(tmp_path_factory.mktemp(f"{architecture}_tanh"), architecture,
                                    activation=activation) for architecture, activation in TANH.items()}


def test_each_hf_activation_read_is_torchs_gelu_to_one_rounding_in_float64():
    """Every name ppctl reads computes, in transformers, ``F.gelu`` of its ``model.activation``'s approximation to
    one rounding of the input's scale (``eps * max(1, |x|)``), and not the other one; ``gelu_fast`` (refused: its
    sqrt(2/pi) cut to 10 digits) is thousands of roundings off the tanh GELU."""
    from transformers.activations import ACT2FN

    from ppctl.model.gpt.hf import HF_ACTIVATIONS
    from ppctl.model.gpt.model import GELU_APPROXIMATIONS

    inputs = torch.linspace(-12, 12, 20_001, dtype=torch.float64)
    rounding = torch.finfo(torch.float64).eps * inputs.abs().clamp_min(1.0)
    ours = {activation: F.gelu(inputs, approximate=approximate)
            for activation, approximate in GELU_APPROXIMATIONS.items()}

    def roundings(name):
        theirs = ACT2FN[name](inputs)
        return {activation: float(((theirs - values).abs() / rounding).max()) for activation, values in ours.items()}

    for activation, names in HF_ACTIVATIONS.items():
        for name in names:
            off = roundings(name)
            assert off.pop(activation) <= 2 and all(other > 1e9 for other in off.values()), (name, activation)
    assert roundings("gelu_fast")["gelu_tanh"] > 1000


@pytest.mark.parametrize("architecture", [GPT2, STARCODER2])
def test_a_tanh_gelu_folder_gives_transformers_logits_and_is_written_back_as_it_was(tanh_folders, tmp_path,
                                                                                     architecture):
    """ppctl's model from the folder gives transformers' logits, and the exact GELU on the same weights (the broken
    twin) does not; what ``ppctl export`` writes of it (the format's ``config.json``, naming the architecture's own
    tanh GELU, and its tensors) reloads in transformers with the same logits."""
    import json

    from ppctl.checkpoint.hf_export import write_weights
    from ppctl.model.gpt.hf import FORMAT
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.layers import MLP
    from ppctl.model.rules import rule_of

    folder, tokens = tanh_folders[architecture], _tokens()
    config = _config(folder, architecture, False, "model.activation=gelu_tanh")
    model, shape = _reference(config), _shape(config)
    with torch.no_grad():
        expected, ours = hf_model(folder)(tokens).logits, model(tokens)[..., :VOCAB]
    assert relative_error(ours, expected) < EXACT

    hf_config = FORMAT.hf_config(shape)
    assert hf_config["activation_function" if architecture == GPT2 else "hidden_act"] == TANH[architecture]
    assert FORMAT.shape_from_hf(hf_config)["activation"] == "gelu_tanh"
    dense = {name: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for name, param in model.named_parameters()}
    out = tmp_path / "written"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config))
    write_weights(out, to_hf_tensors(FORMAT, shape, hf_config, dense), max_shard_bytes=1 << 30)
    with torch.no_grad():
        assert relative_error(hf_model(out)(tokens).logits, ours) < EXACT

    for module in model.modules():
        if isinstance(module, MLP):
            module.approximate = "none"
    with torch.no_grad():
        assert relative_error(model(tokens)[..., :VOCAB], expected) > 1e-5


def test_export_names_each_activation_as_its_architecture_does_and_reads_it_back():
    from ppctl.model.gpt.hf import FORMAT
    from ppctl.model.gpt.settings import GPTSettings

    for position, key, tanh in (("learned", "activation_function", "gelu_new"),
                                ("rope", "hidden_act", "gelu_pytorch_tanh")):
        for activation, name in (("gelu", "gelu"), ("gelu_tanh", tanh)):
            written = FORMAT.hf_config(GPTSettings(vocab_size=VOCAB, position_embedding=position,
                                                   activation=activation))
            assert written[key] == name and FORMAT.shape_from_hf(written)["activation"] == activation


# --- real GPT-2: its QKV bias at tp=2, broken twins of it, hub-style names, a run without it -----------------------

@pytest.fixture(scope="module")
def real_gpt2(tanh_folders):
    """A tiny GPT-2 as OpenAI's are (``gelu_new``, a random ``c_attn.bias``): its folder, the tokens and
    transformers' logits of them."""
    folder, tokens = tanh_folders[GPT2], _tokens()
    with torch.no_grad():
        return folder, tokens, hf_model(folder)(tokens).logits


def _real_gpt2_config(folder, *extra):
    return _config(folder, GPT2, False, "model.activation=gelu_tanh", *extra)


def test_gpt2_logits_at_tp2_equal_transformers(real_gpt2, monkeypatch):
    """Two TP ranks (threads of this process, their all-reduces met at a barrier), each with its heads' rows of the
    QKV weight and bias, give transformers' logits; the bias split as plain rows (the broken twin: rank 0 would hold
    all of q's bias and half of k's) does not."""
    import ppctl.model.gpt.rules as gpt_rules
    from ppctl.model.rules import ROWS
    from tests.harness.lockstep_tp import lockstep_logits

    folder, tokens, expected = real_gpt2
    config = _real_gpt2_config(folder, "parallel.tp=2")
    assert relative_error(lockstep_logits(config, tokens, monkeypatch)[..., :VOCAB], expected) < EXACT
    rules = {**gpt_rules.PARAMETER_RULES}
    rules["attention.qkv.bias"] = replace(rules["attention.qkv.bias"], split=ROWS)
    monkeypatch.setattr(gpt_rules, "PARAMETER_RULES", rules)
    assert relative_error(lockstep_logits(config, tokens, monkeypatch)[..., :VOCAB], expected) > 1e-3


def _q_and_k_blocks_swapped(bias):
    query, key, value = bias.chunk(3)
    return torch.cat([key, query, value])


def test_a_qkv_bias_dropped_or_its_q_and_k_blocks_swapped_fails_the_comparison(real_gpt2):
    folder, tokens, expected = real_gpt2
    model = _reference(_real_gpt2_config(folder))
    biases = {name: param for name, param in model.named_parameters() if name.endswith("attention.qkv.bias")}
    read = {name: bias.detach().clone() for name, bias in biases.items()}
    with torch.no_grad():
        for defect in (torch.zeros_like, _q_and_k_blocks_swapped):
            for name, bias in biases.items():
                bias.copy_(defect(read[name]))
            assert relative_error(model(tokens)[..., :VOCAB], expected) > 1e-3, defect


def test_a_folder_with_base_model_names_loads_the_same(tmp_path, folders):
    """Tensors named as ``GPT2Model`` and the hub's ``gpt2`` files name them (no ``transformer.`` prefix, no tied
    ``lm_head``), with GPT-2's causal mask buffers beside them, give the same logits; a tensor under neither spelling
    is refused in one line naming both."""
    import shutil

    from safetensors.torch import load_file, save_file

    original = folders[(GPT2, True)]
    folder = tmp_path / "hub_names"
    folder.mkdir()
    shutil.copy(original / "config.json", folder / "config.json")
    tensors = {name.removeprefix("transformer."): tensor
               for name, tensor in load_file(str(original / "model.safetensors")).items() if name != "lm_head.weight"}
    for layer in range(4):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(original)(tokens).logits
    assert relative_error(_logits(_config(folder, GPT2, True), tokens), expected) < EXACT

    del tensors["h.1.attn.c_attn.bias"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert _refusal(*overrides(folder, GPT2, True)) == (
        f"model.init_from={folder}: it has no tensor transformer.h.1.attn.c_attn.bias (or h.1.attn.c_attn.bias) "
        f"(ppctl's layers.1.attention.qkv.bias)")


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_run_without_the_qkv_bias_exports_zeros_that_transformers_reads_exactly(tmp_path, position):
    import json

    from ppctl.checkpoint.hf_export import write_weights
    from ppctl.model.gpt.hf import FORMAT
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.rules import rule_of
    from tests.harness.hf_models import OVERRIDES

    config = compose_config([*OVERRIDES, "parallel=single", "trainer.precision=fp64",
                             f"model.position_embedding={position}"])
    model, shape, tokens = _reference(config), _shape(config), _tokens()
    hf_config = FORMAT.hf_config(shape)
    dense = {name: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for name, param in model.named_parameters()}
    tensors = to_hf_tensors(FORMAT, shape, hf_config, dense)
    biases = [name for name in tensors if name.endswith(("c_attn.bias", "q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) == (1 if position == "learned" else 3) * 4 and not any(tensors[name].any() for name in biases)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    write_weights(tmp_path, tensors, max_shard_bytes=1 << 30)
    with torch.no_grad():
        assert relative_error(hf_model(tmp_path)(tokens).logits, model(tokens)[..., :VOCAB]) < EXACT
