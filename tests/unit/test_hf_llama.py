"""The Llama family against ``transformers``: a model read from a Hugging Face folder computes what transformers
computes, each TP rank reads its own slices, and ppctl's tensors written back are the folder's.

Tiny random ``LlamaForCausalLM`` models (grouped-query attention: 4 query heads on 2 key/value heads; Llama 3's
rotary scaling; tied or not) and a ``Qwen2ForCausalLM`` (q/k/v biases) are saved locally
(``tests/harness/hf_models.py``). In float64, ppctl's single-process model started from the folder
(``model.init_from``) gives transformers' logits to 1e-10 relative, with transformers' rotary angles and RMSNorm
taken in float64 (it computes both in float32 whatever the model's dtype); within 1e-6 with its own. At tp=2 a
rank reads its shard's elements and nothing else, a piece at a time. Broken twins of the mapping (gate and up
swapped, k and v swapped, o_proj transposed) must fail; q and k swapped is refused (under GQA their shapes
differ). Refusals: one line each.
"""

import json
from dataclasses import replace

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import LLAMA, POSITIONS, QWEN2, VOCAB, hf_model, overrides, relative_error, save_tiny

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 4}  # every frequency band is hit within 16 positions
MODELS = {"llama": (LLAMA, False, None), "llama tied, llama3 rotary": (LLAMA, True, LLAMA3_SCALING),
          "qwen2": (QWEN2, False, None)}
EXACT = 1e-10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: save_tiny(tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", "")), architecture, tie,
                            seed=3, rope_scaling=scaling)
            for name, (architecture, tie, scaling) in MODELS.items()}


def _config(folders, name, *extra, folder=None):
    """The fp64 single-process config that starts from model ``name`` (or from ``folder``, said to be it)."""
    config = compose_config([*overrides(folder or folders[name], *MODELS[name]), "parallel=single",
                             "trainer.precision=fp64", *extra])
    validate(config)
    return config


def _hf_logits(folder, tokens, exact: bool = True):
    with torch.no_grad():
        return hf_model(folder, exact)(tokens).logits


def _logits(config, tokens):
    from ppctl.run.reference import reference_model

    with torch.no_grad():
        return reference_model(config)(tokens)[..., :VOCAB]


def _tokens():
    return torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers_in_float64(folders, name):
    tokens = _tokens()
    assert relative_error(_logits(_config(folders, name), tokens), _hf_logits(folders[name], tokens)) < EXACT


def test_with_transformers_own_float32_rotary_within_float32(folders):
    name, tokens = "llama tied, llama3 rotary", _tokens()
    assert relative_error(_logits(_config(folders, name), tokens), _hf_logits(folders[name], tokens, False)) < 1e-6


@pytest.mark.parametrize("tp", [2])
def test_each_tp_rank_reads_the_dense_models_shard(folders, tp):
    """Each TP rank's chunk holds the single process's shards: whole key/value heads, rows and columns."""
    from ppctl.model.from_config import build_chunk
    from ppctl.model.rules import rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.run.reference import reference_model
    from tests.distributed.equivalence import expected_shard

    dense = dict(reference_model(_config(folders, "qwen2")).named_parameters())
    config = _config(folders, "qwen2", f"parallel.tp={tp}")
    for tp_rank in range(tp):
        chunk = build_chunk(config, StageLayers.whole(3), RankGroups(tp=TPGroup(None, tp, tp_rank)))
        for name, param in chunk.named_parameters():
            rule = rule_of(param)
            assert torch.equal(param, expected_shard(name, rule, dense[rule.tied_to or name], param, tp, tp_rank,
                                                     VOCAB)), (name, tp_rank)


def test_a_rank_reads_its_slices_only_a_piece_at_a_time(folders, monkeypatch):
    """At tp=2 each rank reads from the folder exactly its shard's elements (padding rows none), in reads of at most
    ``READ_ELEMENTS``, into the dense model's shards, and draws no random dense value first (that held whole
    tensors: 1.8 times a rank's share at tp2 pp2 in ``benchmarks/hf_load.py``)."""
    import ppctl.model.hf_weights as hf_weights
    import ppctl.model.rules as rules
    from ppctl.model.from_config import build_chunk
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup
    from ppctl.run.reference import reference_model
    from tests.distributed.equivalence import expected_shard

    dense = dict(reference_model(_config(folders, "llama")).named_parameters())
    reads, slice_of = [], hf_weights.HFWeights._slice

    class Counted:
        """A safetensors slice that counts the elements each read gives."""

        def __init__(self, part):
            self.part = part

        def get_shape(self):
            return self.part.get_shape()

        def __getitem__(self, index):
            tensor = self.part[index]
            reads.append(tensor.numel())
            return tensor

    monkeypatch.setattr(hf_weights.HFWeights, "_slice", lambda self, name: Counted(slice_of(self, name)))
    monkeypatch.setattr(hf_weights, "READ_ELEMENTS", 100)
    monkeypatch.setattr(rules, "dense_parameter", lambda *args: pytest.fail("a dense value was drawn"))
    config = _config(folders, "llama", "parallel.tp=2")
    for tp_rank in range(2):
        reads.clear()
        chunk = build_chunk(config, StageLayers.whole(3), RankGroups(tp=TPGroup(None, 2, tp_rank)))
        real = 0
        for name, param in chunk.named_parameters():
            rule = rules.rule_of(param)
            assert torch.equal(param, expected_shard(name, rule, dense[name], param, 2, tp_rank, VOCAB)), name
            rows = param.shape[0]
            if rule.vocab_rows:
                rows = min(max(VOCAB - tp_rank * rows, 0), rows)
            real += rows * param[0].numel()
        assert max(reads) <= 100 and sum(reads) == real, (tp_rank, max(reads), sum(reads), real)


@pytest.mark.parametrize("name", MODELS)
def test_the_dense_tensors_map_back_to_the_folders_bit_for_bit(folders, name):
    from safetensors.torch import load_file

    from ppctl.model.family import resolve_model
    from ppctl.model.hf_format import read_hf_config
    from ppctl.model.hf_weights import to_hf_tensors
    from ppctl.model.llama.hf import FORMAT
    from ppctl.model.rules import rule_of
    from ppctl.run.reference import reference_model

    folder = folders[name]
    config = _config(folders, name, "trainer.precision=fp32")
    dense = {key: param.detach()[:VOCAB] if rule_of(param).vocab_rows else param.detach()
             for key, param in reference_model(config).named_parameters()}
    written = to_hf_tensors(FORMAT, resolve_model(config).shape, read_hf_config(folder), dense)
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(written[key], tensor), key
    exported = FORMAT.hf_config(resolve_model(config).shape)
    assert FORMAT.shape_from_hf(exported) == FORMAT.shape_from_hf(read_hf_config(folder))


def _swapped(spec, one: str, other: str):
    return replace(spec, names=tuple(name.replace(one, "#").replace(other, one).replace("#", other)
                                     for name in spec.names))


DEFECTS = {
    "gate and up swapped": lambda name, spec: _swapped(spec, "gate_proj", "up_proj"),
    "k and v swapped": lambda name, spec: _swapped(spec, "k_proj", "v_proj"),  # q and k differ in shape under GQA
    "o_proj transposed": lambda name, spec: replace(spec, transpose=name.endswith("o_proj.weight")),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_broken_mapping_fails_the_comparison(folders, monkeypatch, defect):
    """One defect in the mapping: the logits move far beyond the tolerance."""
    from ppctl.model.llama.hf import FORMAT

    original = FORMAT.tensors

    def broken(model, hf_config):
        return {name: DEFECTS[defect](name, spec) for name, spec in original(model, hf_config).items()}

    monkeypatch.setattr(type(FORMAT), "tensors", lambda self, model, hf_config: broken(model, hf_config))
    tokens = _tokens()
    assert relative_error(_logits(_config(folders, "llama"), tokens), _hf_logits(folders["llama"], tokens)) > 1e-3


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_act": "gelu"}, "its hidden_act='gelu': ppctl's llama computes SwiGLU with SiLU only"),
    ({"mlp_bias": True}, "its mlp_bias=true: ppctl's llama MLP has no biases"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "its rope_parameters gives rope_type='dynamic'"),
])
def test_what_llama_cannot_compute_is_refused(tmp_path, folders, edit, expected):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(folders["llama"], folder)
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _config(folders, "llama", folder=folder)


def test_a_shape_mismatch_names_the_key(folders):
    with pytest.raises(ConfigError, match=r"gives model.num_kv_heads=2, this run has model.num_kv_heads=4"):
        _config(folders, "llama", "model.num_kv_heads=4")


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
    assert torch.equal(_logits(_config(folders, "qwen2", folder=folder), tokens),
                       _logits(_config(folders, "qwen2"), tokens))
