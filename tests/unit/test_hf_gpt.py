"""The GPT family against ``transformers``: a model read from a Hugging Face folder computes what transformers
computes, and ppctl's tensors written back are the folder's.

Each case builds a tiny random GPT-2 (learned positions) or StarCoder2 (rotary) model locally, tied or not,
its vocabulary of 50 ids padded to 64 rows by ppctl (``tests/harness/hf_models.py``). In float64: ppctl's
single-process model started from the folder (``model.init_from``) gives transformers' logits to 1e-10
relative (measured: 9e-16; StarCoder2 1e-15 with transformers' rotary angles taken in float64, 4e-8 with its
own float32 ones); each TP rank's slices read from the folder are the dense model's shards; and the
dense tensors mapped back are the folder's, bit for bit. Broken twins of the mapping (a transposed weight,
q and k swapped, a vocabulary row dropped) must fail the logits comparison. Refusals: one line each.
"""

from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError, compose_config, validate
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
    from ppctl.parallel.tensor_parallel import TPGroup
    from tests.distributed.equivalence import expected_shard

    folder = folders[(architecture, tie)]
    dense = dict(_reference(_config(folder, architecture, tie)).named_parameters())
    config = _config(folder, architecture, tie, f"parallel.tp={tp}")
    monkeypatch.setattr(hf_weights, "READ_ELEMENTS", 100)
    for tp_rank in range(tp):
        for pre, post in ((True, False), (False, True)):  # a tied output layer alone on the last stage reads wte
            chunk = build_chunk(config, [1, 2] if pre else [3], pre, post, TPGroup(None, tp, tp_rank))
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
    from ppctl.model.from_config import model_shape

    return model_shape(config)


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
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    assert _refusal(*overrides(folder)).startswith(
        f"model.init_from={folder}: its config.json is NoSuchForCausalLM, which no model family reads (gpt: "
        f"GPT2LMHeadModel, Starcoder2ForCausalLM")


def test_a_shape_mismatch_names_the_key_and_both_values(folders):
    folder = folders[(GPT2, False)]
    message = _refusal(*overrides(folder), "model.hidden_size=64")
    assert message == (f"model.init_from={folder}: its config.json gives model.hidden_size=32, this run has "
                       f"model.hidden_size=64")
    tied = _refusal(*overrides(folder, GPT2, True))
    assert "model.tie_embeddings=False, this run has model.tie_embeddings=True" in tied


def test_a_nonzero_qkv_bias_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny(tmp_path / "bias")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["transformer.h.2.attn.c_attn.bias"][5] = 0.5
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert _refusal(*overrides(folder)) == (
        f"model.init_from={folder}: its transformer.h.2.attn.c_attn.bias is not zero: ppctl's gpt model has no such "
        f"parameter, so this model cannot be expressed exactly")


@pytest.mark.parametrize("edit, expected", [
    ({"activation_function": "gelu_new"}, "its activation_function='gelu_new': ppctl's gpt computes the exact GELU"),
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
