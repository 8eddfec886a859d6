"""``ppctl generate``'s model side: the KV cache, greedy decoding against ``transformers``, sampling, refusals.

In float64 throughout. The KV-cache path (``DecoderChunk.generate_step``: the prompt as one causal block, then
one token a step, or several) gives the logits of running the whole sequence again at every step, to 1e-10
relative, for GPT (learned and rotary positions, tied) and Llama (grouped-query attention, q/k/v biases).
Greedy decoding equals ``transformers``' ``generate(do_sample=False)`` token for token, its step logits to
float32 rounding (generate casts them to float32), on the same weights: a tiny random GPT-2 (with GPT-2's own
tanh GELU, ``gelu_new``), StarCoder2 and Llama (grouped-query attention) saved locally and read from their folders
through ``model.init_from``.
Sampling is reproducible from a seed and differs with another.
"""

from __future__ import annotations

import pytest
import torch

from ppctl.resolve import compose_config
from ppctl.generate.decode import TextStream, generate, generate_ids
from ppctl.generate.sampling import Sampling, next_token
from ppctl.generate.source import GenerateError, load_model
from ppctl.model.kv_cache import KVCache
from ppctl.run.reference import reference_model
from tests.harness.char_tokenizer import save_char_tokenizer
from tests.harness.hf_models import GPT2, STARCODER2, VOCAB, hf_model, relative_error, save_tiny

EXACT = 1e-10
# transformers' generate hands out each step's logits in float32, whatever the model's dtype.
FLOAT32_LOGITS = 1e-6
GREEDY = Sampling(temperature=0.0)
MODELS = {
    "gpt_learned": ["model=gpt_tiny"],
    "gpt_rope_tied": ["model=gpt_tiny", "model.position_embedding=rope", "model.tie_embeddings=true"],
    "llama_gqa_bias": ["model=llama_tiny", "model.qkv_bias=true"],
}


def _model(overrides):
    """The whole model of a tiny config in float64, weights wide enough that attention is far from uniform."""
    config = compose_config(["parallel=single", "data=synthetic", "trainer.precision=fp64", "model.init_std=0.2",
                             "model.max_seq_length=32", *overrides])
    return reference_model(config).eval(), config.model.vocab_size


@pytest.mark.parametrize("steps", [[5, 1, 1, 1, 1, 1], [4, 3, 1, 2]], ids=["one_token_a_step", "blocks"])
@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_steps_equal_recomputing_the_whole_sequence(name, steps):
    model, vocab = _model(MODELS[name])
    tokens = torch.randint(0, vocab, (2, sum(steps)), generator=torch.Generator().manual_seed(1))
    cache, start = KVCache(sum(steps)), 0
    with torch.no_grad():
        for size in steps:
            positions = torch.arange(start, start + size).expand(2, -1)
            cached = model.generate_step(tokens[:, start:start + size], positions, cache)
            start += size
            assert relative_error(cached, model(tokens[:, :start])[:, -1, :vocab]) < EXACT, (name, start)


def test_the_comparison_sees_a_wrong_position():
    """A step run at the wrong position (as a cache that forgot its length would) fails the same bound."""
    model, vocab = _model(MODELS["gpt_rope_tied"])
    tokens = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = KVCache(6)
    with torch.no_grad():
        model.generate_step(tokens[:, :5], torch.arange(5)[None], cache)
        wrong = model.generate_step(tokens[:, 5:], torch.tensor([[4]]), cache)
        assert relative_error(wrong, model(tokens)[:, -1, :vocab]) > 1e-3


def test_generate_step_refuses_a_partial_model():
    from ppctl.model.from_config import build_chunk
    from ppctl.parallel.layout import StageLayers

    config = compose_config(["parallel=single", "data=synthetic"])
    chunk = build_chunk(config, StageLayers(0, (0, 1), True, False))
    with pytest.raises(ValueError, match="whole model in one process"):
        chunk.generate_step(torch.zeros(1, 2, dtype=torch.int64), torch.arange(2)[None], KVCache(2))


# --- greedy against transformers ----------------------------------------------------------------------------------

def _hf_greedy(hf, prompt, max_new_tokens):
    """transformers' greedy ids after ``prompt`` and its step logits."""
    tokens = torch.tensor([prompt])  # the whole prompt attended to (generate masks ids equal to pad_token_id)
    out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False, max_new_tokens=max_new_tokens,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def _ppctl_greedy(chunk, prompt, max_new_tokens):
    """ppctl's greedy ids after ``prompt`` and its step logits."""
    logits, step = [], chunk.generate_step
    chunk.generate_step = lambda *args: logits.append(step(*args)) or logits[-1]
    try:
        ids = list(generate_ids(chunk, prompt, max_new_tokens, GREEDY))
    finally:
        del chunk.generate_step
    return ids, torch.cat(logits)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A tiny GPT-2 (tied, with GPT-2's own tanh GELU ``gelu_new``) and StarCoder2 (untied, the exact GELU) folder,
    each with a character tokenizer of its vocabulary."""
    folders = {}
    for architecture, tie, activation in ((GPT2, True, "gelu_new"), (STARCODER2, False, "gelu")):
        folder = save_tiny(tmp_path_factory.mktemp(architecture), architecture, tie, activation=activation)
        save_char_tokenizer(folder, VOCAB)
        folders[architecture] = folder
    return folders


@pytest.mark.parametrize("architecture", [GPT2, STARCODER2])
def test_greedy_equals_transformers_generate_through_init_from(hf_folders, architecture):
    model = load_model(hf_folders[architecture], precision="fp64")
    prompt = model.prompt_ids("Hello", 11)
    ids, logits = _ppctl_greedy(model.chunk, prompt, 11)
    with torch.no_grad():
        expected_ids, expected_logits = _hf_greedy(hf_model(hf_folders[architecture]), prompt, 11)
    assert ids == expected_ids
    assert relative_error(logits, expected_logits) < FLOAT32_LOGITS


LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0)


def test_llama_greedy_equals_transformers_generate_through_init_from(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(1.0, 0.1) if name.endswith("norm.weight") else param.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    save_char_tokenizer(tmp_path, VOCAB)
    hf = hf_model(tmp_path)  # its RMS norms and rotary angles in float64
    model = load_model(tmp_path, precision="fp64")
    prompt = model.prompt_ids("Llamas", 16)
    ids, logits = _ppctl_greedy(model.chunk, prompt, 16)
    with torch.no_grad():
        expected_ids, expected_logits = _hf_greedy(hf, prompt, 16)
    assert ids == expected_ids
    assert relative_error(logits, expected_logits) < FLOAT32_LOGITS


def test_mixtral_greedy_equals_transformers_generate_through_init_from(tmp_path):
    """A Mixtral folder (``config.json``'s mixture set as ``model.moe``) decodes as transformers does."""
    from tests.harness.hf_models import MIXTRAL

    folder = save_tiny(tmp_path / "mixtral", MIXTRAL, seed=3)
    save_char_tokenizer(folder, VOCAB)
    model = load_model(folder, precision="fp64")
    from ppctl.model.moe.layer import moe_mlps

    assert sorted(moe_mlps(model.chunk)) == [0, 1, 2, 3]  # every layer routes, to the folder's 4 experts
    assert {mlp.shape.num_experts for mlp in moe_mlps(model.chunk).values()} == {4}
    prompt = model.prompt_ids("Mix", 8)
    ids, logits = _ppctl_greedy(model.chunk, prompt, 8)
    with torch.no_grad():
        expected_ids, expected_logits = _hf_greedy(hf_model(folder), prompt, 8)
    assert ids == expected_ids
    assert relative_error(logits, expected_logits) < FLOAT32_LOGITS


# --- sampling ------------------------------------------------------------------------------------------------------

def _sampled(model, seed, sampling=Sampling(temperature=1.0)):
    return list(generate_ids(model, [1, 2, 3], 20, sampling, seed))


def test_sampling_is_reproducible_from_the_seed_and_differs_with_another():
    model, _ = _model(MODELS["gpt_learned"])
    assert _sampled(model, 7) == _sampled(model, 7)
    assert _sampled(model, 7) != _sampled(model, 8)
    top = Sampling(temperature=0.8, top_k=20, top_p=0.9)
    assert _sampled(model, 7, top) == _sampled(model, 7, top) != _sampled(model, 8, top)


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    model, _ = _model(MODELS["llama_gqa_bias"])
    greedy = _sampled(model, 0, GREEDY)
    assert _sampled(model, 5, Sampling(temperature=2.0, top_k=1)) == greedy
    assert _sampled(model, 5, Sampling(temperature=2.0, top_p=1e-9)) == greedy


def test_top_k_and_top_p_keep_the_right_tokens():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps the first two (0.5 < 0.8 <= 0.8), top_k=3 three."""
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    drawn = lambda sampling: {int(next_token(logits, sampling, torch.Generator().manual_seed(seed)))
                              for seed in range(300)}
    assert drawn(Sampling(top_p=0.8)) == {1, 3}
    assert drawn(Sampling(top_p=0.81)) == {0, 1, 3}
    assert drawn(Sampling(top_k=3)) == {0, 1, 3}
    assert drawn(Sampling()) == {0, 1, 2, 3}


@pytest.mark.parametrize("sampling, option", [(Sampling(temperature=-0.5), "--temperature=-0.5"),
                                              (Sampling(temperature=float("nan")), "--temperature=nan"),
                                              (Sampling(top_p=0.0), "--top-p=0.0"),
                                              (Sampling(top_p=1.5), "--top-p=1.5"),
                                              (Sampling(top_k=-1), "--top-k=-1")])
def test_sampling_settings_refused_in_one_line(sampling, option):
    problem = sampling.problem()
    assert problem.startswith(option) and "\n" not in problem


def test_generation_stops_at_an_end_of_text_id():
    model, _ = _model(MODELS["gpt_learned"])
    first = _sampled(model, 0, GREEDY)[0]
    assert list(generate_ids(model, [1, 2, 3], 20, GREEDY, stop_ids=frozenset({first}))) == [first]


# --- text ------------------------------------------------------------------------------------------------------------

def test_the_text_stream_holds_back_an_unfinished_character():
    from ppctl.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer.decode, tokenizer.encode("caf"), tokenizer.vocab_size)
    pieces = [stream.push(token) for token in [*"é!".encode(), tokenizer.eod_id]]
    assert pieces == ["", "é", "!", ""] and stream.text == "é!"
    unfinished = TextStream(tokenizer.decode, [65], tokenizer.vocab_size)
    assert unfinished.push("é".encode()[0]) == "" and unfinished.finish() == "\ufffd"


def test_generate_streams_the_text_it_returns(hf_folders):
    model = load_model(hf_folders[GPT2])
    pieces = []
    result = generate(model.chunk, model.tokenizer, model.prompt_ids("Hi", 10), 10, Sampling(), 3, model.stop_ids,
                      pieces.append)
    assert "".join(pieces) == result.text == model.tokenizer.decode(result.ids) and len(result.ids) == 10
    assert result.stopped == "max_new_tokens" and result.tokens_per_second > 0


# --- refusals ------------------------------------------------------------------------------------------------------

def test_a_prompt_beyond_max_seq_length_is_refused(hf_folders):
    model = load_model(hf_folders[GPT2])  # 16 learned positions
    with pytest.raises(GenerateError, match=r"--prompt is 17 tokens; .* beyond model.max_seq_length=16: shorten"):
        model.prompt_ids("a" * 17, 1)
    with pytest.raises(GenerateError, match=r"that is 20, beyond model.max_seq_length=16: use --max-new-tokens 6"):
        model.prompt_ids("a" * 10, 10)
    with pytest.raises(GenerateError, match="--prompt is empty"):
        model.prompt_ids("", 1)


def test_folders_and_runs_it_cannot_use_are_refused_in_one_line(tmp_path, hf_folders):
    from ppctl.resolve import to_yaml

    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(compose_config(["data=synthetic"])))
    no_tokenizer = save_tiny(tmp_path / "no_tokenizer")
    cases = {tmp_path / "absent": "no such run directory or model folder",
             tmp_path / "empty": "neither a run directory",
             run: "no checkpoint to generate from",
             no_tokenizer: "no tokenizer.json in it"}
    for path, message in cases.items():
        with pytest.raises(GenerateError, match=message) as error:
            load_model(path)
        assert "\n" not in str(error.value)


def test_a_prompt_id_beyond_the_vocabulary_is_refused():
    from ppctl.data.tokenizer import ByteTokenizer
    from ppctl.generate.source import Model

    model = Model(chunk=None, tokenizer=ByteTokenizer(), stop_ids=frozenset(), max_seq_length=64, vocab_size=128)
    assert model.prompt_ids("abc", 8) == [97, 98, 99]
    with pytest.raises(GenerateError, match="token id 195 is beyond the model's vocabulary of 128 ids"):
        model.prompt_ids("é", 8)


def test_a_run_on_synthetic_data_or_with_a_changed_tokenizer_is_refused(tmp_path):
    from ppctl.generate.source import run_tokenizer

    with pytest.raises(GenerateError, match="data.source=synthetic, random ids that stand for no text"):
        run_tokenizer(compose_config(["data=synthetic"]), {}, tmp_path)
    config = compose_config(["data=text", f"data.path={tmp_path}"])
    saved = {"data": {"tokenizer": {"name": "byte", "vocab_sha256": "0" * 64}}}
    with pytest.raises(GenerateError, match=r"its tokenizer byte changed since the checkpoint was saved \(vocabulary "
                                            r"000000000000 then, [0-9a-f]{12} now\)"):
        run_tokenizer(config, saved, tmp_path)
    assert run_tokenizer(config, {}, tmp_path).eod_id == 256
