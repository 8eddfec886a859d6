"""Blends (``data.blend``): the greedy order's proportions within its bound, resume, layouts, the sources read,
the settings refused in one line, and prepare-data's line per source."""

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ppctl.config import ConfigError, DataConfig, PpctlConfig, fill_unset  # noqa: E402
from ppctl.resolve import compose_config, validate  # noqa: E402
from ppctl.resolve.compose import load_config_file, to_yaml  # noqa: E402
from ppctl.config.schema import BlendSource  # noqa: E402
from ppctl.data import blend as blend_module  # noqa: E402
from ppctl.data.blend import (BlendedDataset, BlendOrder, assign_positions, build_blended_dataset,  # noqa: E402
                              deficit_bound, normalised_weights)
from ppctl.data.corpus import BlendSpec, CorpusSpec  # noqa: E402
from ppctl.data.dataset import SyntheticDataset, build_dataset, step_microbatches  # noqa: E402

WEIGHTS = (6.0, 1.0, 1.0)
GLOBAL_BATCH_SIZE = 16
NUM_BATCHES = 1000


def synthetic_blend(weights=WEIGHTS, sizes=(50, 30, 7)) -> BlendedDataset:
    """A blend of synthetic sources of ``sizes`` windows (cheap: the order is what is tested, not the tokens)."""
    return BlendedDataset([SyntheticDataset(size, 8, 16, seed=index) for index, size in enumerate(sizes)], weights)


def source_counts_per_batch(dataset: BlendedDataset, num_batches: int, seed: int = 3) -> np.ndarray:
    """``[batch, source]``: how many samples of each global batch come from each source."""
    counts = np.zeros((num_batches, len(dataset.datasets)), dtype=np.int64)
    for step in range(num_batches):
        for sample_id in dataset.batch_sample_ids(seed, step, GLOBAL_BATCH_SIZE):
            counts[step, dataset.source_of(sample_id)] += 1
    return counts


def proportion_violations(counts: np.ndarray, weights) -> list[str]:
    """Where the per-batch or running counts leave the greedy rule's bound (``deficit_bound``) around the
    weights' shares; empty when every batch and every prefix of batches is inside it."""
    shares, num_sources = np.array(normalised_weights(weights)), len(weights)
    low, high = deficit_bound(num_sources)
    violations = []
    for step, batch in enumerate(counts):  # a batch's counts are a difference of two prefixes: within S
        if np.any(np.abs(batch - shares * GLOBAL_BATCH_SIZE) >= num_sources):
            violations.append(f"batch {step}: {batch.tolist()}")
    running = np.cumsum(counts, axis=0)
    positions = GLOBAL_BATCH_SIZE * np.arange(1, len(counts) + 1)[:, None]
    deficits = shares * positions - running
    for step in np.flatnonzero(np.any((deficits <= low) | (deficits >= high), axis=1)):
        violations.append(f"after batch {step}: {running[step].tolist()}")
    return violations


def test_the_greedy_rule_worked_by_hand_and_megatrons_normalisation():
    """Weights 2:1:1 -> shares .5/.25/.25. Position 0 (t=1): deficits .5 .25 .25 -> 0; 1 (t=1): -.5 .25 .25 -> 1;
    2: 0 -.5 .5 -> 2; 3: .5 -.25 -.25 -> 0; 4: 0 0 0 -> 0 (a tie goes to the first); 5: -.5 .25 .25 -> 1; ..."""
    sources, draws, counts = assign_positions(normalised_weights([2, 1, 1]), (0, 0, 0), 0, 8)
    assert sources.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert draws.tolist() == [0, 0, 0, 1, 2, 1, 1, 3] and counts == (4, 2, 2)
    weights = [0.3, 0.1, 7.0]
    assert normalised_weights(weights) == tuple((np.array(weights, dtype=np.float64) / np.sum(weights)).tolist())


def test_proportions_over_1000_batches_stay_within_the_rules_bound_and_uniform_draws_do_not():
    """Every global batch holds each source's share of 16 samples to within S=3, and after every batch the running
    counts are within (-1, S-1) of the shares (the bound ``deficit_bound`` proves). The broken twin, a blend whose
    order ignores the weights (uniform), is checked against the same weights and fails."""
    counts = source_counts_per_batch(synthetic_blend(), NUM_BATCHES)
    assert counts.sum() == NUM_BATCHES * GLOBAL_BATCH_SIZE
    assert proportion_violations(counts, WEIGHTS) == []
    assert np.allclose(counts.sum(axis=0) / counts.sum(), np.array(WEIGHTS) / sum(WEIGHTS), atol=3 / counts.sum())
    uniform = source_counts_per_batch(synthetic_blend(weights=(1.0, 1.0, 1.0)), NUM_BATCHES)
    assert len(proportion_violations(uniform, WEIGHTS)) > NUM_BATCHES


def test_each_source_is_drawn_epoch_by_epoch_each_in_its_own_order():
    """Source s's draws 0..n_s-1 are each of its windows once, the next n_s again in another order."""
    dataset = synthetic_blend()
    stream = [sample_id for step in range(60) for sample_id in dataset.batch_sample_ids(3, step, GLOBAL_BATCH_SIZE)]
    for source, dataset_size in enumerate(len(part) for part in dataset.datasets):
        local = [sample_id - int(dataset.offsets[source]) for sample_id in stream
                 if dataset.source_of(sample_id) == source]
        first, second = local[:dataset_size], local[dataset_size:2 * dataset_size]
        assert sorted(first) == sorted(second) == list(range(dataset_size)) and first != second
    assert stream != [sample_id for step in range(60) for sample_id in dataset.batch_sample_ids(4, step, 16)]


@pytest.mark.parametrize("block_positions", [blend_module.BLOCK_POSITIONS, 40])
def test_a_resumed_run_draws_what_the_uninterrupted_one_drew(block_positions, monkeypatch):
    """Steps k.. from a fresh dataset (a restarted process: nothing remembered) equal the uninterrupted run's steps
    k..; with 40-position blocks the restart falls inside a block, after several, and the order equals the rule
    applied in one pass from position 0."""
    monkeypatch.setattr(blend_module, "BLOCK_POSITIONS", block_positions)
    uninterrupted = synthetic_blend()
    steps = [uninterrupted.batch_sample_ids(5, step, GLOBAL_BATCH_SIZE) for step in range(30)]
    for resume_step in (0, 7, 13, 29):
        restarted = synthetic_blend()
        assert [restarted.batch_sample_ids(5, step, GLOBAL_BATCH_SIZE) for step in range(resume_step, 30)] == \
            steps[resume_step:]
    one_pass, _, _ = assign_positions(normalised_weights(WEIGHTS), (0, 0, 0), 0, 30 * GLOBAL_BATCH_SIZE)
    assert [uninterrupted.source_of(sample_id) for batch in steps for sample_id in batch] == one_pass.tolist()
    assert BlendOrder(WEIGHTS).counts(30 * GLOBAL_BATCH_SIZE) == tuple(np.bincount(one_pass).tolist())


def test_two_layouts_draw_the_same_samples():
    """The global batch's windows, in order, at dp=1 mbs=4, dp=2 mbs=2 and dp=4 mbs=1 (as every DP rank reads its
    part), equal the blend order's samples of that step."""
    dataset = synthetic_blend()
    for step in (0, 9):
        expected = torch.stack([dataset[sample_id] for sample_id in dataset.batch_sample_ids(2, step, 8)])
        for dp_size, micro_batch_size in ((1, 4), (2, 2), (4, 1)):
            microbatches = [part for dp_rank in range(dp_size)
                            for part in step_microbatches(dataset, 2, step, 8, micro_batch_size, dp_rank, dp_size)]
            assert torch.equal(torch.cat([microbatch.tokens for microbatch in microbatches]), expected[:, :-1])
            assert torch.equal(torch.cat([microbatch.labels for microbatch in microbatches]), expected[:, 1:])


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """A folder with text files of one repeated letter each (a window names its source) and a token cache the
    tests of this module share (each source is prepared once)."""
    folder = tmp_path_factory.mktemp("letters")
    for letter, length in (("a", 600), ("b", 300), ("c", 90)):
        (folder / f"{letter}.txt").write_text(letter * length)
    return folder


def letter_sources(folder, letters="abc") -> list[BlendSource]:
    """The blend entries of the files ``letters`` in ``folder``, each weighted by its length."""
    return [BlendSource(path=str(folder / f"{letter}.txt"), weight=float(len((folder / f"{letter}.txt").read_text())))
            for letter in letters]


def test_the_blend_reads_each_sources_prepared_windows(letters):
    """``build_blended_dataset`` prepares each text source as one source is prepared (its own cache entry) and
    a sample is that source's window: its letter, equal to the source's own dataset's window."""
    cache_dir = letters / "cache"
    blend = BlendSpec.of(DataConfig(source="text", cache_dir=str(cache_dir), blend=letter_sources(letters)))
    dataset = build_blended_dataset(blend, 7, 257, 0)
    alone = [build_dataset(spec, 7, 257, 0) for spec in blend.specs]
    assert len(list(cache_dir.glob("*/index.json"))) == 3
    for sample_id in dataset.batch_sample_ids(0, 3, 32):
        source = dataset.source_of(sample_id)
        window = dataset[sample_id]
        assert torch.equal(window, alone[source][sample_id - int(dataset.offsets[source])])
        assert set(window.tolist()) - {256} == {ord("abc"[source])}
    with pytest.raises(ValueError, match=r"^data.blend\[2\]: data.path=.*c.txt: the validation split holds 4 tokens"):
        build_blended_dataset(blend, 7, 257, 0, split="validation")  # the last 5% of 91 ids: fewer than a window of 8
    two = BlendSpec.of(DataConfig(source="text", cache_dir=str(cache_dir), blend=letter_sources(letters, "ab")))
    held_out = build_blended_dataset(two, 7, 257, 0, split="validation")
    assert [len(part) for part in held_out.datasets] == [3, 1]  # the last 5% of 601 and 301 ids: 30 and 15
    assert {held_out.source_of(sample_id) for sample_id in held_out.batch_sample_ids(0, 0, 4)} == {0, 1}


def blend_config(entries, **data) -> PpctlConfig:
    """A config reading ``entries`` as ``data.blend``, resolved as composing resolves it."""
    config = PpctlConfig(data=DataConfig(blend=entries, **data))
    fill_unset(config)
    return config


def test_blend_settings_are_refused_in_one_line(letters, tmp_path):
    good = letter_sources(letters)
    missing = str(tmp_path / "nope.txt")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "completion": "b"}\n')
    instruction = [good[0], BlendSource(source="prompt_completion", path=str(pairs))]
    for entries, data, fragment in [
        (good[:1], {}, "data.blend holds 1 source(s); a blend takes at least 2"),
        ([good[0], BlendSource(path=good[1].path, weight=0.0)], {},
         "data.blend[1].weight=0.0 must be a finite number > 0"),
        ([good[0], BlendSource(path=good[1].path, weight=-2.0)], {}, "data.blend[1].weight=-2.0 must be"),
        ([BlendSource(path=good[1].path, weight=math.inf), good[0]], {}, "data.blend[0].weight=inf must be"),
        ([BlendSource(path=good[1].path, weight=math.nan), good[0]], {}, "data.blend[0].weight=nan must be"),
        ([good[0], BlendSource(path=missing)], {}, f"data.blend[1]: data.path={missing}: no such file, folder or glob"),
        ([good[0], BlendSource(source="synthetic")], {}, "data.blend[1].source='synthetic': a blend draws from token "
                                                         "files; sources: python_stdlib, text, chat, "
                                                         "prompt_completion, indexed"),
        ([good[0], BlendSource(source="python_stdlib", path="x.txt")], {}, "data.blend[1]: data.source=python_stdlib "
                                                                           "takes no data.path"),
        (good, {"path": good[0].path}, f"data.blend names each source's path; unset data.path={good[0].path}"),
        (good, {"source": "synthetic"}, "data.source=synthetic with data.blend: a blend draws from token files"),
        (instruction, {}, "data.blend[1].source=prompt_completion with data.packing=packed and data.documents=joined "
                          "lets each row attend to the rows packed before it"),
    ]:
        with pytest.raises(ConfigError) as error:
            validate(blend_config(entries, **data))
        assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)
    validate(blend_config([good[0], BlendSource(source="python_stdlib", weight=0.5)]))
    validate(blend_config([good[0], BlendSource(path="owner/hub-name", weight=2.0)]))  # tried when preparing
    validate(blend_config(good, documents="separate"))
    validate(blend_config(instruction, documents="separate"))
    validate(blend_config(instruction, packing="padded"))


def test_an_override_and_a_yaml_file_write_the_same_blend(tmp_path):
    """``data.blend=[{path: ..., weight: ...}, {source: python_stdlib, ...}]`` on the command line, the same list in a
    YAML config tree, and the run's config.yaml read back all give the same entries."""
    path = tmp_path / "a.txt"
    override = f"data.blend=[{{path: {path}, weight: 3}}, {{source: python_stdlib, weight: 0.5}}]"
    expected = [BlendSource(path=str(path), weight=3.0), BlendSource(source="python_stdlib", weight=0.5)]
    from_override = compose_config([override])
    assert from_override.data.blend == expected
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(
        f"defaults:\n  - ppctl_config\n  - _self_\ndata:\n  blend:\n    - path: {path}\n      weight: 3\n"
        f"    - source: python_stdlib\n      weight: 0.5\n")
    assert compose_config([], config_dir=tmp_path / "conf").data.blend == expected
    (tmp_path / "config.yaml").write_text(to_yaml(from_override))
    assert load_config_file(tmp_path / "config.yaml").data.blend == expected
    with pytest.raises(ConfigError, match="Key 'weigth' not in 'BlendSource'"):
        compose_config([f"data.blend=[{{path: {path}, weigth: 3}}, {{source: python_stdlib}}]"])


def test_prepare_data_says_each_sources_tokens_weight_and_epochs(letters, tmp_path):
    """``ppctl prepare-data`` (in this process) prints one line per source: 600 a's + eod = 601 tokens, 95% train
    -> 571 -> 71 windows of 8; 40 steps of 8 = 320 samples, shares 600:300:90 -> counts from the blend order."""
    from typer.testing import CliRunner

    from ppctl.cli.app import app

    entries = letter_sources(letters)
    blend_items = ", ".join(f"{{path: {entry.path}, weight: {entry.weight:g}}}" for entry in entries)
    arguments = ["prepare-data", f"data.blend=[{blend_items}]", f"data.cache_dir={letters / 'cache'}",
                 "trainer.seq_length=7", "trainer.max_steps=40", "trainer.global_batch_size=8", "trainer.eval_every=0"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    draws = BlendOrder([600, 300, 90]).counts(320)
    assert len(lines) == 3 and sum(draws) == 320
    for index, (line, tokens, windows) in enumerate(zip(lines, (601, 301, 91), (71, 35, 10))):
        assert line.startswith(f"data.blend[{index}] (data.path={entries[index].path}): {tokens} tokens, weight "
                               f"{entries[index].weight:g} ({entries[index].weight / 990:.1%} of the samples), "
                               f"{draws[index] / windows:.2f} epochs in trainer.max_steps=40 ({draws[index]} samples "
                               f"from its {windows} train windows); "), line
    missing = tmp_path / "c.txt"
    refused = CliRunner().invoke(app, [*arguments[:1], arguments[1].replace(entries[2].path, str(missing)),
                                       *arguments[2:]])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith(f"error: data.blend[2]: data.path={missing}: no such file"), refused.stderr


def test_the_configured_dataset_is_the_blend(letters):
    """``dataset_of`` (what the trainer and the single-process reference read) gives the blend of ``data.blend``,
    its train and its validation split, and one source without it."""
    from ppctl.model.from_config import dataset_of

    config = blend_config(letter_sources(letters, "ab"), cache_dir=str(letters / "cache"))
    config.trainer.seq_length = 7
    train, held_out = dataset_of(config), dataset_of(config, "validation")
    assert isinstance(train, BlendedDataset) and isinstance(held_out, BlendedDataset)
    assert [len(part) for part in train.datasets] == [71, 35] and [len(part) for part in held_out.datasets] == [3, 1]
    config.data.blend, config.data.source, config.data.path = [], "text", str(letters / "a.txt")
    assert not isinstance(dataset_of(config), BlendedDataset) and len(dataset_of(config)) == 71


# --- documents kept apart, and instruction sources, inside a blend ------------------------------------------------

MIXED_SEQ_LENGTH = 47


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A config blending a text corpus of short documents, chat conversations and prompt-completion pairs (one
    ChatML tokenizer folder), documents kept apart and instruction rows packed: windows hold several documents,
    begin inside one, and the instruction ones carry stored loss weights."""
    from tests.harness.chat_folder import CHATML, CONVERSATIONS, save_chat_folder, write_rows

    root = tmp_path_factory.mktemp("mixed")
    folder = save_chat_folder(root / "folder", CHATML)
    texts = write_rows(root / "texts.jsonl", [{"text": "word " * (1 + (3 * row) % 17)} for row in range(40)])
    chats = write_rows(root / "chats.jsonl", [{"messages": conversation} for conversation in CONVERSATIONS * 6])
    pairs = write_rows(root / "pairs.jsonl", [{"prompt": f"Sum {row}+{row}? ", "completion": f"{2 * row}."}
                                              for row in range(30)])
    entries = [BlendSource(path=str(texts), weight=2.0), BlendSource(source="chat", path=str(chats), weight=1.0),
               BlendSource(source="prompt_completion", path=str(pairs), weight=1.0)]
    config = blend_config(entries, tokenizer=str(folder / "tokenizer.json"), cache_dir=str(root / "cache"),
                          validation_fraction=0.0, documents="separate")
    config.trainer.seq_length, config.trainer.eval_every, config.model.vocab_size = MIXED_SEQ_LENGTH, 0, 128
    return config


def alone_datasets(config: PpctlConfig) -> list:
    """Each source of ``config``'s blend read as its own dataset (its own ``data.source``), as a run reading that
    source alone builds it."""
    from ppctl.data.instruction_dataset import build_instruction_dataset

    data, trainer = config.data, config.trainer
    datasets = []
    for spec in BlendSpec.of(data).specs:
        if spec.source == "text":
            datasets.append(build_dataset(spec, trainer.seq_length, config.model.vocab_size, trainer.seed,
                                          eod_mask_loss=data.eod_mask_loss, separate_documents=True))
        else:
            datasets.append(build_instruction_dataset(spec, trainer.seq_length, config.model.vocab_size,
                                                      eod_mask_loss=data.eod_mask_loss, separate_documents=True))
    return datasets


def differences_from_sources(blend: BlendedDataset, alone: list, steps, micro_batch_size: int = 4) -> list[str]:
    """Where a row of the blend's microbatches (tokens, labels, positions, segment ids, loss weights) differs from
    the same sample's microbatch built from its source dataset alone; empty when every row is its source's own."""
    from ppctl.data.dataset import build_microbatch

    differences = []
    for step in steps:
        microbatches = step_microbatches(blend, 0, step, 8, micro_batch_size, 0, 1)
        sample_ids = blend.batch_sample_ids(0, step, 8)
        for number, microbatch in enumerate(microbatches):
            for row in range(micro_batch_size):
                source, local = blend.locate(sample_ids[number * micro_batch_size + row])
                expected = build_microbatch(alone[source], [local])
                for name in ("tokens", "labels", "position_ids", "segment_ids", "loss_mask"):
                    got, want = getattr(microbatch, name), getattr(expected, name)
                    if got is None or want is None or not torch.equal(got[row], want[0]):
                        differences.append(f"step {step} microbatch {number} row {row} (source {source}): {name}")
    return differences


def test_a_blended_microbatch_keeps_each_sources_documents_and_loss_weights(mixed):
    """Under ``data.documents=separate`` every row of the blend's microbatches (``dataset_of``, what a run reads)
    equals that sample's microbatch from its source alone: tokens, segment ids, restarting positions and loss
    weights (the chat and prompt-completion sources' stored ones). The proof is not vacuous: all three sources,
    rows of several documents and partly trained rows occur. The sample order is the joined blend's."""
    from ppctl.model.from_config import dataset_of

    blend, alone = dataset_of(mixed), alone_datasets(mixed)
    assert isinstance(blend, BlendedDataset) and blend.separate_documents and not blend.loss_mask_all_ones
    assert [len(part) for part in blend.datasets] == [len(part) for part in alone]
    steps = range(6)
    assert differences_from_sources(blend, alone, steps) == []
    microbatches = [part for step in steps for part in step_microbatches(blend, 0, step, 8, 4, 0, 1)]
    sample_ids = [sample_id for step in steps for sample_id in blend.batch_sample_ids(0, step, 8)]
    assert {blend.source_of(sample_id) for sample_id in sample_ids} == {0, 1, 2}
    assert any(int(part.segment_ids.max()) >= 2 for part in microbatches)
    assert any(0 < float(part.loss_mask.sum()) < part.loss_mask.numel() for part in microbatches)
    joined = PpctlConfig(**{**vars(mixed), "data": DataConfig(**{**vars(mixed.data), "documents": "joined"})})
    assert [blend.batch_sample_ids(0, step, 8) for step in steps] == \
        [dataset_of(joined).batch_sample_ids(0, step, 8) for step in steps]
    from ppctl.data.dataset import global_loss_tokens

    assert global_loss_tokens(blend, 0, 2, 8) == sum(float(part.loss_mask.sum()) for part in microbatches[4:6])


def _joined_fields(self, sample_ids, inputs):
    """A broken blend: it drops its sources' documents (one segment per row, positions running on)."""
    return torch.arange(inputs.shape[-1]).repeat(inputs.shape[0], 1), torch.zeros_like(inputs)


def test_a_blend_that_drops_its_sources_segments_or_weights_differs(mixed, monkeypatch):
    """Broken twins of the proof above: a blend reading its rows' documents itself as one segment each, and a
    blend weighing every label by its own end-of-document rule instead of the source's stored weights."""
    from ppctl.data.dataset import WindowDataset
    from ppctl.model.from_config import dataset_of

    alone = alone_datasets(mixed)
    with monkeypatch.context() as patch:
        patch.setattr(BlendedDataset, "samples_document_fields", _joined_fields)
        dropped = differences_from_sources(dataset_of(mixed), alone, range(3))
    assert any("position_ids" in line for line in dropped) and any("segment_ids" in line for line in dropped)
    with monkeypatch.context() as patch:
        patch.setattr(BlendedDataset, "sample_loss_mask", WindowDataset.sample_loss_mask)
        unweighted = differences_from_sources(dataset_of(mixed), alone, range(3))
    assert unweighted and all("loss_mask" in line and "(source 0)" not in line for line in unweighted)


def test_prepare_data_counts_an_instruction_sources_samples_as_its_dataset(mixed):
    """``blend_lines``' windows of each source are its dataset's samples: token windows, packed documents each cut
    to a window, or one per conversation when padded."""
    from ppctl.data.prepare import prepare_corpus

    blend = BlendSpec.of(mixed.data)
    for packing in ("packed", "padded"):
        specs = [spec if spec.source == "text" else CorpusSpec(**{**vars(spec), "packing": packing})
                 for spec in blend.specs]
        for spec in specs:
            alone = blend_module.source_dataset(spec, MIXED_SEQ_LENGTH, 128, 0, "train", False, True)
            assert blend_module.train_windows(spec, prepare_corpus(spec), MIXED_SEQ_LENGTH) == len(alone)
