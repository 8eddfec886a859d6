"""A checkpoint records the tokenizer it was trained with, and a resume with another vocabulary is refused.

Two tokenizers with as many ids would otherwise resume silently, each embedding row then standing for
another token. The vocabulary's digest tells them apart; a file rewritten without changing its
vocabulary (formatting, another path) keeps it.
"""

import json
from types import SimpleNamespace

from ppctl.checkpoint.files import resume_problem
from ppctl.checkpoint.state import checkpoint_index
from ppctl.resolve import compose_config
from ppctl.data.tokenizer import build_tokenizer, tokenizer_record
from tests.unit.test_checkpoint_files import INDEX
from tests.unit.test_prepare_corpus import save_word_tokenizer

BYTE = {"name": "byte", "vocab_size": 257, "vocab_sha256": "b" * 64}
WORDS = {"name": "words.json", "path": "/corpora/words.json", "sha256": "1" * 64, "vocab_size": 257,
         "vocab_sha256": "a" * 64}
REFUSED_END = ("each embedding row would stand for another token; resume with the tokenizer it was trained with, "
               "or start a new run without trainer.resume_from")


def saved_with(tokenizer) -> dict:
    """A checkpoint index at step 4 whose data record names ``tokenizer`` (None: saved before the record)."""
    data = dict(INDEX["data"]) if tokenizer is None else {**INDEX["data"], "tokenizer": tokenizer}
    return {**INDEX, "step": 4, "data": data}


def problem(saved, current):
    return resume_problem(saved_with(saved), dict(INDEX["model"]), dict(INDEX["data"]), "fp32", 10,
                          tokenizer=current)


def test_the_vocabulary_digest_tells_tokens_apart_and_not_the_files_bytes(tmp_path):
    first = save_word_tokenizer(tmp_path / "first.json", ["the cat sat on a mat"], [])
    other = save_word_tokenizer(tmp_path / "other.json", ["one two six ten big red"], [])
    rewritten = tmp_path / "rewritten.json"
    rewritten.write_text(json.dumps(json.loads(first.read_text()), indent=4))
    first_tokenizer, other_tokenizer, rewritten_tokenizer = (build_tokenizer(str(path))
                                                             for path in (first, other, rewritten))
    assert first_tokenizer.vocab_size == other_tokenizer.vocab_size
    assert first_tokenizer.vocabulary_sha256 != other_tokenizer.vocabulary_sha256
    assert first_tokenizer.sha256 != rewritten_tokenizer.sha256
    assert first_tokenizer.vocabulary_sha256 == rewritten_tokenizer.vocabulary_sha256
    record = tokenizer_record(SimpleNamespace(source="text", tokenizer=str(first)))
    assert record == {"name": "first.json", "path": str(first.resolve()), "sha256": first_tokenizer.sha256,
                      "vocab_size": first_tokenizer.vocab_size, "vocab_sha256": first_tokenizer.vocabulary_sha256}
    assert tokenizer_record(SimpleNamespace(source="synthetic", tokenizer=str(first))) is None


def test_a_checkpoint_records_the_tokenizer_of_its_data():
    config = compose_config(["data=text", "data.path=/corpora/any.txt"])
    layout = SimpleNamespace(world_size=1, tp=1, pp=1, vpp=1, dp=1, cp=1, ep=1)
    trainer = SimpleNamespace(config=config, context=SimpleNamespace(layout=layout))
    index = checkpoint_index(trainer, 3, "end", 3)
    byte = build_tokenizer("byte")
    assert index["data"]["tokenizer"] == {"name": "byte", "vocab_size": 257, "vocab_sha256": byte.vocabulary_sha256}


def test_a_resume_with_another_tokenizer_of_as_many_ids_is_refused():
    assert problem(BYTE, BYTE) is None
    assert problem(BYTE, WORDS) == ("it was trained with tokenizer byte; this run's data.tokenizer is "
                                    f"/corpora/words.json (same vocabulary size, different tokens): {REFUSED_END}")
    edited = {**WORDS, "vocab_sha256": "e" * 64}
    assert problem(edited, WORDS) == ("it was trained with tokenizer /corpora/words.json (vocabulary eeeeeeeeeeee); "
                                      "this run's data.tokenizer is /corpora/words.json (vocabulary aaaaaaaaaaaa) "
                                      f"(same vocabulary size, different tokens): {REFUSED_END}")
    larger = {**WORDS, "vocab_size": 1001}  # model.vocab_size set above both: the model's shape is the same
    assert f"(257 ids then, 1,001 now): {REFUSED_END}" in problem(BYTE, larger)


def test_a_checkpoint_without_the_record_resumes_as_before():
    assert problem(None, WORDS) is None  # saved before ppctl recorded the tokenizer
    assert problem(BYTE, None) is None  # this run's data is synthetic: its ids stand for no token
