"""The schema imports nothing of ppctl's, so what it says about other parts is written literally:
these tests catch the day one of those parts changes and the schema does not (drift)."""

import re
from dataclasses import fields

import pytest

from ppctl.config import DataConfig, PpctlConfig, ScheduleConfig, fill_unset
from ppctl.resolve import compose_config
from ppctl.config.schema import BACKENDS, DATA_SOURCES, POSITION_EMBEDDINGS, PRECISIONS, SYNTHETIC_VOCAB_SIZE
from ppctl.data.cache import TOKEN_DTYPES
from ppctl.data.tokenizer import build_tokenizer
from ppctl.optim.lr import DECAY_STYLES
from ppctl.parallel.layout import CP_COMM_MODES
from ppctl.pipeline.schedules import SCHEDULE_SPECS


def doc(section: type, name: str) -> str:
    return next(item for item in fields(section) if item.name == name).metadata["doc"]


def default(section: type, name: str):
    return next(item for item in fields(section) if item.name == name).default


def quoted(text: str) -> set[str]:
    """The words a doc string sets in backticks."""
    return set(re.findall(r"`([^`]+)`", text))


def section_of(key: str) -> type:
    return next(item.default_factory for item in fields(PpctlConfig) if item.name == key)


def test_synthetic_vocabulary_is_the_byte_tokenizers():
    assert SYNTHETIC_VOCAB_SIZE == build_tokenizer("byte").vocab_size


def test_vocabulary_docs_state_the_byte_tokenizers_numbers():
    byte = build_tokenizer("byte")
    vocab_doc = doc(section_of("model"), "vocab_size")
    assert f"{byte.vocab_size} for `byte`" in vocab_doc
    assert f"{SYNTHETIC_VOCAB_SIZE} for synthetic data" in vocab_doc
    assert f"{byte.eod_id} = end of document" in doc(section_of("data"), "tokenizer")


def test_vpp_doc_names_the_schedules_that_place_a_fixed_number_of_chunks():
    fixed = {name: spec.chunks_per_rank for name, spec in SCHEDULE_SPECS.items() if spec.chunks_per_rank}
    vpp_doc = doc(section_of("parallel"), "vpp")
    named = quoted(vpp_doc) & set(SCHEDULE_SPECS)
    multi = {name for name, spec in SCHEDULE_SPECS.items() if spec.multi_chunk and not spec.chunks_per_rank}
    assert named - multi == set(fixed), vpp_doc
    assert set(fixed.values()) == {2} and "exactly 2 with" in vpp_doc and "(2 for those five, else 1)" in vpp_doc
    assert len(fixed) == 5


@pytest.mark.parametrize("section, name, allowed", [
    ("model", "position_embedding", POSITION_EMBEDDINGS),
    ("parallel", "cp_comm", CP_COMM_MODES),
    ("data", "source", DATA_SOURCES),
    ("data", "token_dtype", TOKEN_DTYPES),
    ("optimizer", "lr_decay_style", DECAY_STYLES),
    ("trainer", "precision", PRECISIONS),
    ("launcher", "backend", BACKENDS),
])
def test_docs_name_every_allowed_value_and_the_default_is_one(section, name, allowed):
    text = doc(section_of(section), name)
    assert set(allowed) <= quoted(text), f"{section}.{name}: {text}"
    assert default(section_of(section), name) in allowed


def test_the_default_schedule_is_registered():
    assert default(ScheduleConfig, "name") in SCHEDULE_SPECS


def test_unset_settings_are_filled_from_the_schedule_and_the_tokenizer_where_a_config_is_composed():
    config = PpctlConfig(schedule=ScheduleConfig(name="zbv"), data=DataConfig(source="synthetic"))
    assert config.parallel.vpp is None and config.model.vocab_size is None  # the schema alone knows neither
    fill_unset(config)
    assert config.parallel.vpp == SCHEDULE_SPECS["zbv"].chunks_per_rank
    assert config.model.vocab_size == SYNTHETIC_VOCAB_SIZE
    composed = compose_config([])
    assert composed.parallel.vpp == 1 and composed.model.vocab_size == build_tokenizer("byte").vocab_size


def test_the_activations_are_those_the_gpt_family_computes_reads_and_writes():
    from ppctl.model.gpt.hf import EXPORTED_ACTIVATIONS, HF_ACTIVATIONS
    from ppctl.model.gpt.model import GELU_APPROXIMATIONS
    from ppctl.model.gpt.settings import ACTIVATIONS, GPTSettings

    text = doc(GPTSettings, "activation")
    assert set(ACTIVATIONS) <= quoted(text) and default(GPTSettings, "activation") in ACTIVATIONS, text
    assert tuple(GELU_APPROXIMATIONS) == tuple(HF_ACTIVATIONS) == ACTIVATIONS
    assert all(tuple(exported) == ACTIVATIONS for exported in EXPORTED_ACTIVATIONS.values())
