"""``ppctl generate`` reads a Hugging Face folder's prompt and stop ids as transformers does, and refuses bad inputs.

The prompt is encoded as ``AutoTokenizer.from_pretrained(folder)(prompt)`` encodes it: the special tokens the
``tokenizer.json``'s post-processor adds (Llama 3's ``<|begin_of_text|>``) stay. Generation stops where
``generate`` stops with the model's own ``generation_config``: the ``eos_token_id`` of ``generation_config.json``
when the folder has one (``config.json``'s is then not read; none there: no stop), else ``config.json``'s; a
tokenizer's end-of-text token is no stop of its own. Each is checked against transformers itself: a tiny Llama
(float64) whose greedy tokens after ``tokenizer(prompt)`` must be transformers' greedy ``generate`` tokens.

Refusals, one line each, through the command in this process (``CliRunner``): every folder reader's failure (a
malformed safetensors file, a bad ``config.json``, a malformed ``generation_config.json``), a prompt that is not
UTF-8 (bytes a shell passes, surrogate-escaped by Python) whatever the tokenizer, a seed outside 64 bits, a
tokenizer with an empty vocabulary, and one larger than the model's vocabulary. A temperature so small that the
logits divided by it overflow (``1e-40``) samples among the most likely tokens, as its limit, instead of drawing
from nan probabilities.
"""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from ppctl.data.tokenizer import ByteTokenizer, TokenizerFile
from ppctl.generate.decode import generate
from ppctl.generate.sampling import Sampling, next_token
from ppctl.generate.source import GenerateError, Model, load_model
from tests.harness.char_tokenizer import CHARACTERS
from tests.harness.hf_models import LLAMA, VOCAB, hf_model, save_tiny

GREEDY = Sampling(temperature=0.0)
BEGIN, END = "<|begin_of_text|>", "<|end_of_text|>"
NOT_UTF8 = b"ab\xff\xfecd".decode("utf-8", "surrogateescape")  # what Python makes of $'ab\xff\xfecd' in argv
NEW_TOKENS = 10  # with a prompt of up to 6 tokens, the tiny model's 16 positions


def save_bos_tokenizer(folder, vocab_size: int = VOCAB):
    """Llama 3's kind of tokenizer: characters, ``<unk>``, then ``<|begin_of_text|>`` that its post-processor puts
    before every text and ``<|end_of_text|>``; with the ``tokenizer_config.json`` Llama 3 has."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = [*CHARACTERS[:vocab_size - 3], "<unk>", BEGIN, END]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([BEGIN, END])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BEGIN} $A", pair=f"{BEGIN} $A {BEGIN} $B",
                                                             special_tokens=[(BEGIN, vocab[BEGIN])])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BEGIN, "eos_token": END}))
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama folder (no end-of-text ids in its configs) with a tokenizer that adds a BOS."""
    return save_bos_tokenizer(save_tiny(tmp_path_factory.mktemp("llama_bos") / "llama", LLAMA))


def _copy(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


def _transformers(folder, prompt: str, max_new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """transformers' ``tokenizer(prompt)`` ids and its greedy ``generate`` ids after them, with the folder's own
    generation config (float64)."""
    from transformers import AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf_model(folder).generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def _ppctl(folder, prompt: str, max_new_tokens: int = NEW_TOKENS):
    """ppctl's prompt ids and what greedy generation gives after them (float64)."""
    model = load_model(folder, precision="fp64")
    prompt_ids = model.prompt_ids(prompt, max_new_tokens)
    return prompt_ids, generate(model.chunk, model.tokenizer, prompt_ids, max_new_tokens, GREEDY, 0, model.stop_ids)


def _edit_json(path, **changes):
    content = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**content, **changes}))


# --- as transformers encodes and stops -----------------------------------------------------------------------------

def test_the_prompt_keeps_the_tokens_the_tokenizer_adds_and_decodes_as_transformers(llama):
    expected_prompt, expected = _transformers(llama, "Llama")
    prompt_ids, generated = _ppctl(llama, "Llama")
    begin = json.loads((llama / "tokenizer.json").read_text())["post_processor"]["special_tokens"][BEGIN]["ids"][0]
    assert prompt_ids == expected_prompt and prompt_ids[0] == begin
    assert generated.ids == expected and len(expected) == NEW_TOKENS


def test_generation_stops_where_transformers_stops(llama, tmp_path):
    """``config.json`` and ``generation_config.json`` name different end-of-text ids: transformers stops at the
    latter's, and at ``config.json``'s only without a ``generation_config.json``."""
    folder = _copy(llama, tmp_path)
    _, free = _transformers(folder, "Hi")
    firsts = [token for index, token in enumerate(free) if token not in free[:index]]
    assert len(firsts) >= 2, free  # two tokens to stop at, the second first met later
    config_eos, generation_eos = firsts[0], firsts[1]
    _edit_json(folder / "config.json", eos_token_id=config_eos)
    _edit_json(folder / "generation_config.json", eos_token_id=[generation_eos])
    _, expected = _transformers(folder, "Hi")
    _, generated = _ppctl(folder, "Hi")
    assert generated.ids == expected == free[:free.index(generation_eos) + 1]
    assert generated.stopped == "end_of_text"
    (folder / "generation_config.json").unlink()
    _, expected = _transformers(folder, "Hi")
    _, generated = _ppctl(folder, "Hi")
    assert generated.ids == expected == free[:free.index(config_eos) + 1]
    _edit_json(folder / "generation_config.json", bos_token_id=None)  # a generation config naming no end of text
    _, expected = _transformers(folder, "Hi")
    _, generated = _ppctl(folder, "Hi")
    assert generated.ids == expected == free and generated.stopped == "max_new_tokens"


@pytest.mark.parametrize("content, message", [
    ("{not json", "its generation_config.json is unreadable (JSONDecodeError"),
    ('["eos"]', "its generation_config.json is not a JSON object"),
    ('{"eos_token_id": "end"}', "its generation_config.json has eos_token_id='end': an id or a list of ids"),
    ('{"eos_token_id": [3, 2.5]}', "its generation_config.json has eos_token_id=[3, 2.5]: an id or a list of ids"),
])
def test_a_generation_config_it_cannot_read_is_refused(llama, tmp_path, content, message):
    folder = _copy(llama, tmp_path)
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(GenerateError) as refused:
        load_model(folder)
    assert str(refused.value).startswith(f"{folder}: {message}") and "\n" not in str(refused.value)


# --- the prompt, the tokenizer, the sampling settings --------------------------------------------------------------

def _bpe(path):
    """A small byte-level BPE ``tokenizer.json`` trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["abcd abcd cdab"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    tokenizer.save(str(path))
    return path


def test_a_prompt_that_is_not_utf8_is_refused_whatever_the_tokenizer(tmp_path):
    from ppctl.resolve import compose_config
    from ppctl.generate.source import run_tokenizer

    bpe = _bpe(tmp_path / "bpe.json")
    (tmp_path / "corpus.txt").write_text("abcd\n")
    run = run_tokenizer(compose_config(["data=text", f"data.path={tmp_path / 'corpus.txt'}", f"data.tokenizer={bpe}"]),
                        {}, tmp_path)
    for tokenizer in (ByteTokenizer(), TokenizerFile(bpe), run):
        model = Model(chunk=None, tokenizer=tokenizer, stop_ids=frozenset(), max_seq_length=64, vocab_size=512)
        assert model.prompt_ids("abcd", 4)
        with pytest.raises(GenerateError) as refused:
            model.prompt_ids(NOT_UTF8, 4)
        assert str(refused.value) == ("--prompt is not UTF-8 text (byte 0xff at character 2): give the prompt as "
                                      "UTF-8")


def test_a_tiny_temperature_samples_among_the_most_likely_tokens():
    """Logits over 1e-40 overflow to inf and their softmax is nan; their limit is the most likely token (ties
    drawn among)."""
    tiny = Sampling(temperature=1e-40)
    for logits, expected in (([1.0, 3.0, 2.0], {1}), ([3.0, 3.0, 1.0], {0, 1})):
        drawn = {int(next_token(torch.tensor([logits]), tiny, torch.Generator().manual_seed(seed)))
                 for seed in range(40)}
        assert drawn == expected
    top = Sampling(temperature=1e-40, top_k=2, top_p=0.5)
    assert int(next_token(torch.tensor([[1.0, 3.0, 2.0]]), top, torch.Generator().manual_seed(0))) == 1


def _invoke(*args: str):
    from ppctl.cli.app import app

    return CliRunner().invoke(app, ["generate", *args])


def _one_line(result, start: str) -> str:
    assert result.exit_code == 2 and result.stdout == "", (result.stderr, result.exception)
    assert result.stderr.startswith(f"error: {start}") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("seed, ok", [(2**64, False), (-2**63 - 1, False), (2**64 - 1, True), (-2**63, True)])
def test_a_seed_outside_64_bits_is_refused(llama, seed, ok):
    result = _invoke(str(llama), "--prompt", "Hi", "--max-new-tokens", "2", "--seed", str(seed))
    if ok:
        assert result.exit_code == 0, (result.stderr, result.exception)
    else:
        _one_line(result, f"--seed={seed} must be an integer in -2**63 .. 2**64-1 (a 64-bit seed)")


def test_a_prompt_that_is_not_utf8_is_refused_on_the_command_line(llama):
    _one_line(_invoke(str(llama), "--prompt", NOT_UTF8, "--max-new-tokens", "2"),
              "--prompt is not UTF-8 text (byte 0xff at character 2)")


def test_a_tokenizer_with_an_empty_vocabulary_is_refused(llama, tmp_path):
    from tokenizers import Tokenizer, models

    folder = _copy(llama, tmp_path)
    (folder / "tokenizer_config.json").unlink()
    Tokenizer(models.WordLevel({}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    _one_line(_invoke(str(folder), "--prompt", "Hi", "--max-new-tokens", "2"),
              f"{folder}: its tokenizer.json has an empty vocabulary: no token to read the prompt with")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(llama, tmp_path):
    """Refused up front, even for a prompt whose ids fit."""
    folder = _copy(llama, tmp_path)
    save_bos_tokenizer(folder, VOCAB + 10)
    _one_line(_invoke(str(folder), "--prompt", "ab", "--max-new-tokens", "2"),
              f"{folder}: its tokenizer.json has {VOCAB + 10} ids, more than the model's vocabulary of {VOCAB} "
              f"(config.json's vocab_size): a tokenizer of another model?")


@pytest.mark.parametrize("break_folder, names", [
    (lambda folder: (folder / "model.safetensors").write_bytes(b"\x10" * 64), "model.safetensors"),
    (lambda folder: (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:200]),
     "model.safetensors"),
    (lambda folder: (folder / "config.json").write_text("{"), "config.json"),
    (lambda folder: _edit_json(folder / "config.json", num_hidden_layers=2.0), "num_hidden_layers"),
    (lambda folder: _edit_json(folder / "config.json", num_hidden_layers="2"), "num_hidden_layers"),
], ids=["random_bytes", "truncated", "config_not_json", "float_layers", "string_layers"])
def test_every_folder_reader_failure_is_one_line(llama, tmp_path, break_folder, names):
    folder = _copy(llama, tmp_path)
    break_folder(folder)
    assert names in _one_line(_invoke(str(folder), "--prompt", "Hi", "--max-new-tokens", "2"), f"{folder}: ")

