"""Unit tests for ppctl.data: tokenizer, token-file preparation, windows, order, microbatches, CP slicing."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ppctl.data import prepare as prepare_module  # noqa: E402
from ppctl.data.indexed import read_indexed  # noqa: E402
from ppctl.data.corpus import CorpusSpec, stdlib_source_files  # noqa: E402
from ppctl.data.dataset import (  # noqa: E402
    SyntheticDataset, TokenWindowDataset, build_dataset, global_batch_sample_ids, global_loss_tokens,
    slice_for_context_parallel, step_microbatches,
)
from ppctl.data.iterator import ALL_FIELDS, PipelineDataIterator  # noqa: E402
from ppctl.data.prepare import prepare_corpus  # noqa: E402
from ppctl.data.tokenizer import build_tokenizer  # noqa: E402

TINY_SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")


SYNTHETIC = CorpusSpec("synthetic")


def text_corpus(path, cache_dir, **options) -> CorpusSpec:
    """The spec of ``data=text data.path=path`` cached in ``cache_dir``."""
    return CorpusSpec("text", str(path), cache_dir, **options)


def prepare_text(path, cache_dir, **options):
    """Prepare ``data=text data.path=path``; return the prepared corpus."""
    return prepare_corpus(text_corpus(path, cache_dir, **options))


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    """A cache dir holding the prepared stdlib corpus, and that corpus."""
    cache_dir = tmp_path_factory.mktemp("cache")
    return cache_dir, prepare_corpus(CorpusSpec("python_stdlib", cache_dir=cache_dir))


class EodMaskedDataset(SyntheticDataset):
    """Synthetic data whose loss mask drops labels equal to 0, exercising the general mask path."""

    loss_mask_all_ones = False

    def loss_mask(self, window):
        return (window[1:] != 0).to(torch.float32)


# --- tokenizer ---------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tokenizer = build_tokenizer("byte")
    text = "def f(x):\n    return 'héllo ✓'\n"
    token_ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 257 and tokenizer.eod_id == 256
    assert all(0 <= token < 256 for token in token_ids)
    assert tokenizer.decode(token_ids) == text
    assert tokenizer.decode(token_ids + [tokenizer.eod_id]) == text
    assert tokenizer.encode_array(text).tolist() == token_ids


def test_unknown_tokenizer_says_what_is_known():
    with pytest.raises(ValueError, match="data.tokenizer=gpt9: unknown tokenizer; use `byte` or the path of a"):
        build_tokenizer("gpt9")


# --- preparation -------------------------------------------------------------------------------

def test_stdlib_preparation_writes_tokens_and_index(stdlib_cache):
    _, prepared = stdlib_cache
    metadata = json.loads((prepared.location / "index.json").read_text())
    (token_file,) = prepared.token_files()  # 4.7 MB of input: one shard
    tokens = np.fromfile(token_file, dtype=np.uint16)
    record = json.loads(token_file.with_suffix(".json").read_text())
    assert metadata["source"] == "python_stdlib" and metadata["tokenizer"] == {"name": "byte"}
    assert metadata["num_files"] == len(stdlib_source_files()) == metadata["num_documents"] == metadata["num_rows"]
    assert metadata["skipped_rows"] == {"missing": 0, "empty": 0} and metadata["max_token_id"] == 256
    assert record["bin_stat"] == [token_file.stat().st_size, token_file.stat().st_mtime_ns]
    assert read_indexed(token_file).document_bounds()[1:].tolist() == (np.flatnonzero(tokens == 256) + 1).tolist()
    assert metadata["num_tokens"] == tokens.size > 1_000_000
    assert int((tokens == 256).sum()) == metadata["num_documents"]
    assert tokens[-1] == 256
    first_text = stdlib_source_files()[0].read_text(encoding="utf-8")
    first_doc_length = int(np.argmax(tokens == 256))
    assert build_tokenizer("byte").decode(tokens[:first_doc_length].tolist()) == first_text
    assert sorted(os.listdir(prepared.location)) == ["index.json", "shard-00000.bin", "shard-00000.idx",
                                                    "shard-00000.json"]  # no scratch, no temporary
    assert metadata["splits"] == {"train": [0, metadata["num_tokens"] - int(metadata["num_tokens"] * 0.05)],
                                  "validation": [metadata["num_tokens"] - int(metadata["num_tokens"] * 0.05),
                                                 metadata["num_tokens"]]}


def test_second_preparation_reuses_cache(stdlib_cache, monkeypatch):
    cache_dir, prepared = stdlib_cache
    files = [*prepared.location.iterdir()]
    mtimes = [file.stat().st_mtime_ns for file in files]

    def fail_build(*args):
        raise AssertionError("re-tokenised although the cache is valid")

    monkeypatch.setattr(prepare_module, "_build_entry", fail_build)
    assert prepare_corpus(CorpusSpec("python_stdlib", cache_dir=cache_dir)).location == prepared.location
    assert [file.stat().st_mtime_ns for file in files] == mtimes


def test_truncated_cache_is_rebuilt(tmp_path):
    text_file = tmp_path / "tiny.txt"
    text_file.write_text("hello world\n" * 10)
    prepared = prepare_text(text_file, tmp_path / "cache")
    (token_file,) = prepared.token_files()
    token_file.write_bytes(token_file.read_bytes()[:-2])
    assert prepare_text(text_file, tmp_path / "cache").location == prepared.location
    assert token_file.stat().st_size == 2 * prepared.index["num_tokens"] == 2 * 121


def test_edited_text_file_gets_new_cache(tmp_path):
    text_file = tmp_path / "tiny.txt"
    text_file.write_text("first version\n")
    first = prepare_text(text_file, tmp_path).location
    text_file.write_text("second version\n")
    assert prepare_text(text_file, tmp_path).location != first


@pytest.mark.skipif(not TINY_SHAKESPEARE.is_file(), reason="tinyshakespeare.txt is absent")
def test_text_source_on_tiny_shakespeare(tmp_path):
    prepared = prepare_text(TINY_SHAKESPEARE, tmp_path)
    tokens = prepared.tokens()[:]
    expected = TINY_SHAKESPEARE.read_text(encoding="utf-8").encode("utf-8")
    assert tokens.size == len(expected) + 1 and tokens[-1] == 256
    assert bytes(tokens[:-1].astype(np.uint8)) == expected
    index = prepared.index
    assert index["source_path"] == str(TINY_SHAKESPEARE.resolve()) and index["num_documents"] == 1
    validation = int(tokens.size * 0.05)
    cut = tokens.size - validation
    assert index["splits"] == {"train": [0, cut], "validation": [cut, tokens.size]}
    train = build_dataset(text_corpus(TINY_SHAKESPEARE, tmp_path), 256, vocab_size=257, seed=0)
    held_out = build_dataset(text_corpus(TINY_SHAKESPEARE, tmp_path), 256, 257, 0, split="validation")
    assert isinstance(held_out, TokenWindowDataset) and held_out.split == "validation"
    assert (len(train), len(held_out)) == (cut // 257, validation // 257)
    assert held_out[0].tolist() == tokens[cut:cut + 257].tolist()


def test_source_errors_are_one_line(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=f"data.path={missing}: no such file, folder or glob$"):
        prepare_text(missing, tmp_path)
    with pytest.raises(ValueError, match="data.source=text needs data.path"):
        prepare_corpus(CorpusSpec("text", None, tmp_path))
    with pytest.raises(ValueError, match="data.source='web' has no token file; token-file sources: python_stdlib"):
        prepare_corpus(CorpusSpec("web", None, tmp_path))
    with pytest.raises(ValueError, match="data.source=python_stdlib takes no data.path"):
        prepare_corpus(CorpusSpec("python_stdlib", "x.txt", tmp_path))


# --- datasets ----------------------------------------------------------------------------------

def test_windows_and_shifted_labels(stdlib_cache):
    cache_dir, prepared = stdlib_cache
    seq_length = 64
    dataset = build_dataset(CorpusSpec("python_stdlib", cache_dir=cache_dir), seq_length, vocab_size=320, seed=0)
    tokens = prepared.tokens()[:]
    assert len(dataset) == (tokens.size - int(tokens.size * 0.05)) // (seq_length + 1)
    for index in (0, 1, len(dataset) - 1):
        window = dataset[index]
        assert window.dtype == torch.int64 and window.shape == (seq_length + 1,)
        start = index * (seq_length + 1)
        assert window.tolist() == tokens[start:start + seq_length + 1].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    microbatch = step_microbatches(dataset, 0, 0, 4, 2, 0, 1)[0]
    assert torch.equal(microbatch.tokens[:, 1:], microbatch.labels[:, :-1])
    assert microbatch.position_ids.tolist() == [list(range(seq_length))] * 2
    assert microbatch.loss_mask.dtype == torch.float32 and bool((microbatch.loss_mask == 1).all())


def test_vocab_smaller_than_tokenizer_is_rejected(stdlib_cache):
    cache_dir, _ = stdlib_cache
    with pytest.raises(ValueError, match="vocab_size=256 is smaller than the 'byte' tokenizer's 257 ids"):
        build_dataset(CorpusSpec("python_stdlib", cache_dir=cache_dir), 32, vocab_size=256, seed=0)


def test_too_short_token_file_is_rejected(tmp_path):
    text_file = tmp_path / "short.txt"
    text_file.write_text("abc")
    with pytest.raises(ValueError, match="the train split holds 4 tokens, fewer than one window of "
                                         r"trainer.seq_length\+1=17; use a larger corpus"):
        build_dataset(text_corpus(text_file, tmp_path), 16, vocab_size=257, seed=0)


def test_synthetic_samples_depend_on_seed_and_index_only():
    dataset = build_dataset(SYNTHETIC, 16, vocab_size=1000, seed=3)
    again = SyntheticDataset(len(dataset), 16, 1000, seed=3)
    assert torch.equal(dataset[5], again[5]) and not torch.equal(dataset[5], dataset[6])
    assert not torch.equal(dataset[5], SyntheticDataset(len(dataset), 16, 1000, seed=4)[5])
    assert int(dataset[7].max()) < 1000 and dataset[7].shape == (17,)


# --- order and microbatches --------------------------------------------------------------------

def _stacked(microbatches, field):
    return torch.cat([getattr(microbatch, field) for microbatch in microbatches])


@pytest.mark.parametrize("step", [0, 3])
def test_global_batch_is_the_same_for_every_dp_and_mbs(step):
    dataset = SyntheticDataset(50, 8, 97, seed=1)
    global_batch_size = 8
    reference = torch.stack([dataset[i] for i in global_batch_sample_ids(5, step, global_batch_size, 50)])
    for dp_size in (1, 2, 4):
        for micro_batch_size in (1, 2):
            per_rank = [
                step_microbatches(dataset, 5, step, global_batch_size, micro_batch_size, dp_rank, dp_size)
                for dp_rank in range(dp_size)
            ]
            assert all(len(mbs) == global_batch_size // dp_size // micro_batch_size for mbs in per_rank)
            union = [microbatch for rank_microbatches in per_rank for microbatch in rank_microbatches]
            assert torch.equal(_stacked(union, "tokens"), reference[:, :-1])
            assert torch.equal(_stacked(union, "labels"), reference[:, 1:])


def test_order_is_a_function_of_seed_and_step():
    first = global_batch_sample_ids(seed=0, step=0, global_batch_size=8, num_samples=100)
    assert first == global_batch_sample_ids(0, 0, 8, 100)
    assert first != global_batch_sample_ids(0, 1, 8, 100)
    assert first != global_batch_sample_ids(1, 0, 8, 100)
    assert len(set(first)) == 8


def test_epochs_wrap_and_cover_every_sample():
    num_samples, global_batch_size = 10, 4
    stream = [
        sample for step in range(7) for sample in global_batch_sample_ids(2, step, global_batch_size, num_samples)
    ]
    first_epoch, second_epoch = stream[:10], stream[10:20]
    assert sorted(first_epoch) == list(range(10)) and sorted(second_epoch) == list(range(10))
    assert first_epoch != second_epoch
    assert global_batch_sample_ids(2, 0, 25, num_samples) == stream[:25]  # a batch may span epochs


def test_microbatch_sizes_must_divide():
    dataset = SyntheticDataset(20, 4, 10, seed=0)
    with pytest.raises(ValueError, match=r"multiple of micro_batch_size\*dp_size=2\*4=8"):
        step_microbatches(dataset, 0, 0, 12, 2, 0, 4)
    with pytest.raises(ValueError, match="dp_rank=2 out of range"):
        step_microbatches(dataset, 0, 0, 8, 2, 2, 2)


def test_global_loss_tokens_fast_path_and_general_path():
    dataset = SyntheticDataset(30, 6, 50, seed=0)
    assert global_loss_tokens(dataset, 0, 2, 8) == 8 * 6
    masked = EodMaskedDataset(30, 6, 3, seed=0)
    per_rank = [step_microbatches(masked, 0, 2, 8, 2, dp_rank, 2) for dp_rank in range(2)]
    expected = sum(float(mb.loss_mask.sum()) for rank_mbs in per_rank for mb in rank_mbs)
    assert 0 < expected < 8 * 6
    assert global_loss_tokens(masked, 0, 2, 8) == expected


def test_iterator_without_tp_group_reads_locally():
    dataset = SyntheticDataset(30, 6, 50, seed=0)
    expected = step_microbatches(dataset, 4, 1, 8, 2, 1, 2)

    def iterator(needs_inputs, needs_labels):
        fields = (("tokens", "position_ids") if needs_inputs else ()) + (("labels", "loss_mask") if needs_labels else ())
        return PipelineDataIterator(dataset, 4, 8, 2, 6, 1, 2, None, 0, True, fields)

    both = iterator(True, True).microbatches(1)
    assert len(both) == 2
    for got, want in zip(both, expected):
        for field in ("tokens", "position_ids", "labels", "loss_mask"):
            assert torch.equal(getattr(got, field), getattr(want, field))
    first_stage = iterator(True, False).microbatches(1)[0]
    assert first_stage.labels is None and first_stage.loss_mask is None
    assert torch.equal(first_stage.tokens, expected[0].tokens)
    last_stage = iterator(False, True)
    assert last_stage.global_loss_tokens(1, last_stage.microbatches(1)) == 8 * 6
    assert iterator(False, False).microbatches(1)[1].tokens is None
    with pytest.raises(RuntimeError, match="last pipeline stage"):
        iterator(True, False).global_loss_tokens(1, [])
    with pytest.raises(ValueError, match="must be its own TP source"):
        PipelineDataIterator(dataset, 4, 8, 2, 6, 1, 2, None, 0, False, ("tokens",))
    with pytest.raises(ValueError, match="unknown microbatch fields"):
        PipelineDataIterator(dataset, 4, 8, 2, 6, 1, 2, None, 0, True, ("tokens", "images"))
    middle_rotary_stage = PipelineDataIterator(dataset, 4, 8, 2, 6, 1, 2, None, 0, True, ("position_ids",))
    only_positions = middle_rotary_stage.microbatches(1)[0]
    assert only_positions.tokens is None and torch.equal(only_positions.position_ids, expected[0].position_ids)


# --- context parallel --------------------------------------------------------------------------

def test_context_parallel_slicing():
    tensor = torch.arange(2 * 8).reshape(2, 8)
    assert slice_for_context_parallel(tensor, 0, 1) is tensor
    assert slice_for_context_parallel(tensor, 0, 2)[0].tolist() == [0, 1, 6, 7]
    assert slice_for_context_parallel(tensor, 1, 2)[1].tolist() == [10, 11, 12, 13]
    parts = [slice_for_context_parallel(tensor, cp_rank, 4) for cp_rank in range(4)]
    assert [part[0].tolist() for part in parts] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert sorted(torch.cat(parts, dim=1)[1].tolist()) == list(range(8, 16))
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 6"):
        slice_for_context_parallel(tensor, 0, 3)


def test_iterator_keeps_each_cp_rank_tokens_of_every_field_and_the_global_token_count():
    # documents kept apart, so that every field (the documents too) is there to be cut
    dataset = build_dataset(SYNTHETIC, 8, vocab_size=16, seed=3, eod_mask_loss=True, separate_documents=True)
    whole = PipelineDataIterator(dataset, 4, 8, 2, 8, 0, 1, None, 0, True, ALL_FIELDS)
    parts = [PipelineDataIterator(dataset, 4, 8, 2, 8, 0, 1, None, 0, True, ALL_FIELDS, cp_rank=rank, cp_size=2)
             for rank in range(2)]
    for name in ALL_FIELDS:
        full = getattr(whole.microbatches(1)[2], name)
        halves = [getattr(part.microbatches(1)[2], name) for part in parts]
        assert halves[0].shape == (2, 4)
        assert torch.equal(halves[0], torch.cat([full[:, 0:2], full[:, 6:8]], dim=1)), name
        assert torch.equal(halves[1], full[:, 2:6]), name
    # positions stay global: CP rank 1 holds tokens 2..5 of each sequence (documents joined)
    joined = build_dataset(SYNTHETIC, 8, vocab_size=16, seed=3)
    rank_1 = PipelineDataIterator(joined, 4, 8, 2, 8, 0, 1, None, 0, True, ALL_FIELDS, cp_rank=1, cp_size=2)
    assert rank_1.microbatches(0)[0].position_ids[0].tolist() == [2, 3, 4, 5]
    # the count is the global batch's: here one rank's CP parts add up to it (across ranks, the all-reduce adds them)
    shares = [part.global_loss_tokens(1, part.microbatches(1)) for part in parts]
    assert sum(shares) == whole.global_loss_tokens(1, whole.microbatches(1)) == global_loss_tokens(dataset, 4, 1, 8)
