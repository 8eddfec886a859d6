"""Instruction data (issue 56, section 2): chat rendered with the folder's template, the loss on the assistant's
tokens only, proven against transformers (its assistant mask, its loss with labels -100, in float64); prompt-completion
pairs; the tokenizer's own beginning-of-text token on plain text; packing, padding, truncation; bad rows in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ppctl.config import ConfigError, DataConfig, ModelConfig, PpctlConfig, fill_unset  # noqa: E402
from ppctl.resolve import validate  # noqa: E402
from ppctl.data.cache import read_index  # noqa: E402
from ppctl.data.chat import TemplateError, assistant_spans, load_chat_template, token_mask  # noqa: E402
from ppctl.data.corpus import CorpusSpec, DataError  # noqa: E402
from ppctl.data.dataset import build_microbatch, global_loss_tokens  # noqa: E402
from ppctl.data.instruction_dataset import InstructionWindowDataset  # noqa: E402
from ppctl.data.prepare import prepare_corpus  # noqa: E402
from ppctl.model.from_config import dataset_of  # noqa: E402
from ppctl.model.stages import MaskedTokenLoss  # noqa: E402
from tests.harness.chat_folder import (CHATML, CONVERSATIONS, LLAMA3, TEMPLATES, save_chat_folder,  # noqa: E402
                                       without_marks, write_rows)

REPOSITORY = Path(__file__).resolve().parents[2]


def chat_spec(tmp_path: Path, folder: Path, rows: list, **options) -> CorpusSpec:
    """The spec of ``data=chat`` over ``rows`` written to a jsonl file, with ``folder``'s tokenizer."""
    path = write_rows(tmp_path / "rows" / "chat.jsonl", rows)
    return CorpusSpec("chat", str(path), tmp_path / "cache", str(folder / "tokenizer.json"),
                      validation_fraction=0.0, **options)


def stored_documents(prepared) -> list[tuple[list[int], list[int]]]:
    """Each stored document's (ids, weights), read back from the cache's files."""
    tokens = np.fromfile(prepared.location, dtype=prepared.index["dtype"]).tolist()
    weights = np.asarray(prepared.loss_weights()).tolist()
    ends = [0, *prepared.document_table()[:, 0].tolist()]
    return [(tokens[start:end], weights[start:end]) for start, end in zip(ends, ends[1:])]


def hf_tokenizer(folder: Path):
    """transformers' tokenizer of ``folder`` (its template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def hf_assistant_mask(tokenizer, conversation: list) -> tuple[list[int], list[int]]:
    """transformers' ids and ``assistant_masks`` of ``conversation``."""
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


# --- the mask: transformers' generation marks, and the same template without them --------------------------------

@pytest.mark.parametrize("style", [LLAMA3, CHATML])
def test_mask_equals_transformers_assistant_mask_with_and_without_generation_marks(style, tmp_path):
    marked = save_chat_folder(tmp_path / "marked", style)
    unmarked = save_chat_folder(tmp_path / "unmarked", style, marks=False)
    expected = [hf_assistant_mask(hf_tokenizer(marked), conversation) for conversation in CONVERSATIONS]
    rows = [{"messages": conversation} for conversation in CONVERSATIONS]
    for folder in (marked, unmarked):
        prepared = prepare_corpus(chat_spec(tmp_path / folder.name, folder, rows))
        eod = prepared.index["eod_id"]
        for (ids, weights), (hf_ids, hf_mask) in zip(stored_documents(prepared), expected):
            assert ids == hf_ids + [eod] and weights == hf_mask + [0]  # the end of the document: never trained
            assert sum(hf_mask) > 0 and 0 < sum(weights) < len(weights)


def test_a_folder_saved_by_transformers_renders_from_its_chat_template_jinja(tmp_path):
    saved = tmp_path / "saved"
    hf_tokenizer(save_chat_folder(tmp_path / "folder", LLAMA3)).save_pretrained(str(saved))
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    assert (saved / "chat_template.jinja").is_file()  # transformers 5 keeps the template there
    prepared = prepare_corpus(chat_spec(tmp_path, saved, [{"messages": CONVERSATIONS[0]}]))
    (ids, weights), = stored_documents(prepared)
    hf_ids, hf_mask = hf_assistant_mask(hf_tokenizer(saved), CONVERSATIONS[0])
    assert ids == hf_ids + [prepared.index["eod_id"]] and weights == hf_mask + [0]


def test_a_mask_shifted_by_one_token_is_not_transformers_mask(tmp_path):
    """Broken twin: the comparison above tells a mask one token off from the right one."""
    folder = save_chat_folder(tmp_path / "folder", LLAMA3)
    prepared = prepare_corpus(chat_spec(tmp_path, folder, [{"messages": CONVERSATIONS[0]}]))
    (ids, weights), = stored_documents(prepared)
    _, hf_mask = hf_assistant_mask(hf_tokenizer(folder), CONVERSATIONS[0])
    shifted = [0] + weights[:-1]
    assert weights[:-1] == hf_mask and shifted[:-1] != hf_mask


def test_spans_found_prefix_by_prefix_equal_the_generation_marks():
    template = load_chat_template_text(TEMPLATES[CHATML])
    text, spans = assistant_spans(template, CONVERSATIONS[2])
    _, marks = template.render(CONVERSATIONS[2], add_generation_prompt=False)
    assert spans == marks and [text[start:end] for start, end in spans] == ["1, 2, 3.<|im_end|>\n",
                                                                             "Welcome!<|im_end|>\n"]


def load_chat_template_text(text: str, tmp_path_factory=None):
    """A ``ChatTemplate`` of ``text`` (through a temporary ``tokenizer_config.json``)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="chat-template-"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": text, "bos_token": "<s>"}))
    return load_chat_template(folder)


def test_token_mask_marks_every_token_overlapping_a_span():
    offsets = [(0, 2), (2, 3), (3, 6), (6, 7), (7, 9)]
    assert token_mask(offsets, [(3, 6)]) == [0, 0, 1, 0, 0]
    assert token_mask(offsets, [(1, 4), (8, 9)]) == [1, 1, 1, 0, 1]


# --- the loss: transformers' loss with labels -100 outside the assistant's tokens, in float64 ---------------------

def tiny_llama(vocab_size: int):
    """A tiny random transformers Llama in float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def ppctl_loss(model, microbatch, normalizer: float) -> torch.Tensor:
    """ppctl's loss of one microbatch (``MaskedTokenLoss``) on the model's per-token cross-entropy."""
    logits = model(input_ids=microbatch.tokens, position_ids=microbatch.position_ids).logits
    token_losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), microbatch.labels, reduction="none")
    return MaskedTokenLoss(normalizer)(token_losses, microbatch)[0]


def hf_loss(model, ids: list[int], mask: list[int]) -> tuple[torch.Tensor, int]:
    """transformers' loss of ``ids`` with labels -100 where ``mask`` is 0, and how many labels it averages.

    transformers' ``ForCausalLMLoss`` casts the logits to float32 even for a float64 model, so its semantics (labels
    shifted by one inside the loss, -100 ignored, the mean over the rest) are taken in float64 on the same logits,
    and its own float32 ``loss`` is checked to agree to float32 rounding.
    """
    ids_tensor = torch.tensor([ids])
    labels = torch.where(torch.tensor([mask]) == 1, ids_tensor, torch.full_like(ids_tensor, -100))
    output = model(input_ids=ids_tensor, labels=labels)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    assert output.loss.dtype == torch.float32 and abs(float(output.loss) - float(loss)) < 1e-5 * float(loss)
    return loss, int(sum(mask[1:]))


@pytest.mark.parametrize("style", [LLAMA3, CHATML])
def test_masked_loss_equals_transformers_loss_float64(style, tmp_path):
    folder = save_chat_folder(tmp_path / "folder", style, marks=False)
    rows = [{"messages": conversation} for conversation in CONVERSATIONS]
    prepared = prepare_corpus(chat_spec(tmp_path, folder, rows))
    seq_length = max(len(ids) for ids, _ in stored_documents(prepared))
    dataset = InstructionWindowDataset(prepared, seq_length, packing="padded")
    model = tiny_llama(prepared.index["vocab_size"])
    tokenizer = hf_tokenizer(save_chat_folder(tmp_path / "truth", style))  # the marked template: the truth
    truths = [hf_loss(model, *hf_assistant_mask(tokenizer, conversation)) for conversation in CONVERSATIONS]
    with torch.no_grad():
        for sample, (loss, _) in enumerate(truths):  # each conversation alone
            alone = build_microbatch(dataset, [sample])
            assert torch.allclose(ppctl_loss(model, alone, float(alone.loss_mask.sum())), loss, rtol=0, atol=1e-12)
        # the batch: the sum over every trained token over their count (ppctl's normalizer)
        batch = build_microbatch(dataset, list(range(len(CONVERSATIONS))))
        normalizer = global_loss_tokens(dataset, 0, 0, len(dataset)) if len(dataset) == len(CONVERSATIONS) else None
        assert normalizer == float(batch.loss_mask.sum()) == sum(count for _, count in truths)
        expected = sum(loss * count for loss, count in truths) / normalizer
        assert torch.allclose(ppctl_loss(model, batch, normalizer), expected, rtol=0, atol=1e-12)
        # broken twin: the mask one token late trains on other tokens, and the loss moves
        shifted = build_microbatch(dataset, [0])
        shifted.loss_mask = torch.roll(shifted.loss_mask, 1, dims=1)
        assert abs(float(ppctl_loss(model, shifted, float(shifted.loss_mask.sum())) - truths[0][0])) > 1e-3


# --- templates that cannot be split, marks that disagree ---------------------------------------------------------

def test_a_template_whose_turns_cannot_be_found_is_refused_in_one_line(tmp_path):
    counting = "{{ messages | length }}|" + TEMPLATES[CHATML]  # every prefix renders another header
    folder = save_chat_folder(tmp_path / "folder", CHATML, template=counting)
    with pytest.raises(DataError, match=r"chat\.jsonl line 1: the chat template of .* cannot be split into turns") \
            as error:
        prepare_corpus(chat_spec(tmp_path, folder, [{"messages": CONVERSATIONS[1]}], bad_rows="skip"))
    assert "\n" not in str(error.value)


def test_generation_marks_that_disagree_with_the_turns_are_refused(tmp_path):
    narrow = TEMPLATES[CHATML].replace("{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
                                       "{% endgeneration %}",
                                       "{% generation %}{{ message['content'] }}{% endgeneration %}"
                                       "{{ '<|im_end|>' + '\n' }}")
    assert narrow != TEMPLATES[CHATML]
    folder = save_chat_folder(tmp_path / "folder", CHATML, template=narrow)
    with pytest.raises(DataError, match=r"marks generations at characters .* but its assistant turns"):
        prepare_corpus(chat_spec(tmp_path, folder, [{"messages": CONVERSATIONS[1]}]))
    with pytest.raises(TemplateError):
        assistant_spans(load_chat_template(folder), CONVERSATIONS[1])


# --- bad rows: refused naming the file and row, or counted --------------------------------------------------------

BAD_ROWS = [
    ({"text": "no messages here"}, 'has no "messages" list of messages'),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "message 0 has role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "ok"}]},
     "the chat template fails to render it: a system message must come first"),
    ({"messages": [{"role": "user", "content": "anyone?"}]}, "has no assistant turn"),
    ("{not json", "is not JSON"),
]


@pytest.mark.parametrize("row, fragment", BAD_ROWS)
def test_a_bad_row_is_refused_naming_the_file_and_row(row, fragment, tmp_path):
    folder = save_chat_folder(tmp_path / "folder", LLAMA3)
    rows = [{"messages": CONVERSATIONS[0]}, row]
    with pytest.raises(DataError) as error:
        prepare_corpus(chat_spec(tmp_path, folder, rows))
    message = str(error.value)
    assert "chat.jsonl line 2: " in message and fragment in message and "data.bad_rows=skip" in message
    assert "\n" not in message


def test_with_bad_rows_skip_each_bad_row_is_counted_in_the_summary(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", LLAMA3)
    rows = [{"messages": CONVERSATIONS[0]}, *(row for row, _ in BAD_ROWS), {"messages": CONVERSATIONS[1]}]
    prepared = prepare_corpus(chat_spec(tmp_path, folder, rows, bad_rows="skip"))
    assert prepared.index["num_documents"] == 2 and prepared.index["num_rows"] == 7
    assert prepared.index["skipped_rows"] == {"no messages": 2, "unknown role": 1, "template fails": 1,
                                              "no assistant turn": 1, "no prompt or completion": 0}
    summary = prepared.summary()
    assert "from 2 chat row(s) of 7" in summary and "2 skipped (no messages)" in summary
    assert "1 skipped (template fails)" in summary and "\n" not in summary


# --- packing, padding, truncation ---------------------------------------------------------------------------------

def test_packed_windows_carry_the_stored_weights_and_the_document_of_each_token(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", CHATML)
    prepared = prepare_corpus(chat_spec(tmp_path, folder, [{"messages": c} for c in CONVERSATIONS * 3]))
    documents = stored_documents(prepared)
    longest = max(len(ids) for ids, _ in documents)
    dataset = InstructionWindowDataset(prepared, longest + 5, packing="packed")
    stream = [token for ids, _ in documents for token in ids]
    weights = [weight for _, stored in documents for weight in stored]
    document_of = [number for number, (ids, _) in enumerate(documents) for _ in ids]
    window = longest + 6
    assert len(dataset) == len(stream) // window
    for index in range(len(dataset)):
        part = slice(index * window, (index + 1) * window)
        assert dataset[index].tolist() == stream[part]
        # the label at input t predicts token t+1: its weight is that token's
        assert dataset.sample_loss_mask(index, dataset[index]).tolist() == weights[part][1:]
        segments = dataset.window_segment_ids(index).tolist()
        assert segments == [number - document_of[part][0] for number in document_of[part]]


def test_padded_samples_are_one_row_each_and_padding_is_never_trained(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", CHATML)
    prepared = prepare_corpus(chat_spec(tmp_path, folder, [{"messages": c} for c in CONVERSATIONS]))
    documents = stored_documents(prepared)
    seq_length = max(len(ids) for ids, _ in documents) + 3
    dataset = InstructionWindowDataset(prepared, seq_length, packing="padded")
    eod = prepared.index["eod_id"]
    assert len(dataset) == len(CONVERSATIONS)
    for index, (ids, weights) in enumerate(documents):
        padding = seq_length + 1 - len(ids)
        assert dataset[index].tolist() == ids + [eod] * padding
        assert dataset.sample_loss_mask(index, dataset[index]).tolist() == (weights + [0] * padding)[1:]
        assert dataset.window_segment_ids(index).tolist() == [0] * len(ids) + [1] * padding


def test_a_row_longer_than_the_window_is_truncated_and_counted_or_refused(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", CHATML)
    spec = chat_spec(tmp_path, folder, [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[0]}])
    prepared = prepare_corpus(spec)
    (short, _), (long_ids, long_weights) = stored_documents(prepared)
    seq_length = len(short) + 1
    assert len(long_ids) > seq_length + 1
    dataset = InstructionWindowDataset(prepared, seq_length, packing="padded")
    eod = prepared.index["eod_id"]
    assert dataset[1].tolist() == long_ids[:seq_length] + [eod]  # cut, its end kept, not trained
    assert dataset.sample_loss_mask(1, dataset[1]).tolist() == long_weights[1:seq_length] + [0]
    assert "1 longer than a window of trainer.seq_length+1=" in prepared.summary(seq_length)
    refusing = prepare_corpus(CorpusSpec(**{**vars(spec), "too_long": "refuse"}))
    with pytest.raises(DataError, match=r"chat\.jsonl line 2: holds \d+ tokens, longer than a window of "
                                        r"trainer\.seq_length\+1=\d+ \(1 such row\(s\)\); set data\.too_long=truncate"):
        InstructionWindowDataset(refusing, seq_length, packing="packed")


def test_rows_holding_the_end_of_document_id_inside_are_refused_with_documents_kept_apart(tmp_path):
    """A template that writes the end-of-text token between turns (as Llama 2's writes </s>) would have each
    conversation cut into several documents where boundaries are read from that id: refused, padded joined is not."""
    between = TEMPLATES[CHATML].replace("{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}",
                                        "{{ message['content'] + '<|im_end|><|endoftext|>' + '\n' }}"
                                        "{% endgeneration %}")
    assert between != TEMPLATES[CHATML]
    folder = save_chat_folder(tmp_path / "folder", CHATML, template=between)
    prepared = prepare_corpus(chat_spec(tmp_path, folder, [{"messages": CONVERSATIONS[2]}]))
    assert prepared.index["rows_with_inner_eod"] == 1
    with pytest.raises(DataError, match=r"1 row\(s\) hold the end-of-document id \d+ before their end .* use "
                                        r"data\.packing=padded with data\.documents=joined"):
        InstructionWindowDataset(prepared, 200, packing="packed", separate_documents=True)
    assert len(InstructionWindowDataset(prepared, 200, packing="padded")) == 1


# --- prompt-completion --------------------------------------------------------------------------------------------

def test_prompt_completion_trains_on_the_completion_and_its_end(tmp_path):
    rows = [{"question": "2+2=", "answer": "4"}, {"question": "Sky? ", "answer": "Blue."}]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    spec = CorpusSpec("prompt_completion", str(path), tmp_path / "cache", "byte", validation_fraction=0.0,
                      prompt_field="question", completion_field="answer")
    documents = stored_documents(prepare_corpus(spec))
    assert documents[0] == ([*b"2+2=", *b"4", 256], [0, 0, 0, 0, 1, 1])
    assert documents[1][1] == [0] * 5 + [1] * 5 + [1]
    folder = save_chat_folder(tmp_path / "folder", LLAMA3)  # its post-processor puts <|begin_of_text|> first
    spec = CorpusSpec(**{**vars(spec), "tokenizer": str(folder / "tokenizer.json")})
    prepared = prepare_corpus(spec)
    (ids, weights), _ = stored_documents(prepared)
    expected_ids = hf_tokenizer(folder)("2+2=4")["input_ids"] + [prepared.index["eod_id"]]
    assert ids == expected_ids and weights == [0, 0, 0, 0, 0, 1, 1]
    with pytest.raises(DataError, match=r'pairs\.jsonl line 1: has no text "question" and non-empty text "answer"'):
        write_rows(path, [{"question": "q"}])
        prepare_corpus(spec)


# --- the tokenizer's own beginning- and end-of-text tokens on plain text ----------------------------------------

def test_plain_text_gets_the_beginning_of_text_token_the_post_processor_puts(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", LLAMA3)
    texts = ["Hello world.", "Second one"]
    path = write_rows(tmp_path / "docs.jsonl", [{"text": text} for text in texts])
    prepared = prepare_corpus(CorpusSpec("text", str(path), tmp_path / "cache", str(folder / "tokenizer.json"),
                                         validation_fraction=0.0))
    tokenizer = hf_tokenizer(folder)
    eod = prepared.index["eod_id"]
    assert eod == tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    expected = [token for text in texts for token in tokenizer(text)["input_ids"] + [eod]]
    assert prepared.tokens()[:].tolist() == expected
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert prepared.index["format_version"] == 5


# --- settings and the shipped example ----------------------------------------------------------------------------

def config_of(**data) -> PpctlConfig:
    """A config with these data settings (rows kept apart, as the ``data=chat`` option composes), resolved as
    composing resolves it."""
    config = PpctlConfig(model=ModelConfig(), data=DataConfig(**{"documents": "separate", **data}))
    fill_unset(config)
    return config


def test_chat_settings_are_validated_in_one_line(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    cases = [
        (dict(source="chat", path=str(path)), "data=chat needs data.tokenizer=<a Hugging Face tokenizer.json>"),
        (dict(source="chat", path=str(path), packing="stacked"), "data.packing='stacked' must be one of packed"),
        (dict(source="chat", path=str(path), too_long="drop"), "data.too_long='drop' must be one of truncate"),
        (dict(source="prompt_completion", path=str(path), bad_rows="ignore"), "data.bad_rows='ignore' must be"),
        (dict(source="chat", path=str(path), tokenizer=str(save_chat_folder(tmp_path / "f", CHATML) /
                                                           "tokenizer.json"), chat_template=str(tmp_path / "nope")),
         "nope: no such file, nor a tokenizer_config.json or chat_template.jinja in it"),
        (dict(source="chat", path=str(path), documents="joined"),
         "data.source=chat with data.packing=packed and data.documents=joined lets each row attend to the rows "
         "packed before it"),
    ]
    for data, fragment in cases:
        with pytest.raises(ConfigError) as error:
            validate(config_of(**data))
        assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_shipped_example_prepares_as_docs_data_md_says(tmp_path):
    example = REPOSITORY / "data" / "chat"
    assert "data.path=data/chat/tiny_chat.jsonl data.tokenizer=data/chat/tokenizer.json" in \
        (REPOSITORY / "docs" / "data.md").read_text()
    spec = CorpusSpec("chat", str(example / "tiny_chat.jsonl"), tmp_path / "cache", str(example / "tokenizer.json"))
    prepared = prepare_corpus(spec)
    assert prepared.index["num_documents"] == len((example / "tiny_chat.jsonl").read_text().splitlines())
    assert 0 < prepared.index["num_trained_tokens"] < prepared.index["num_tokens"]
    config = config_of(source="chat", path=str(example / "tiny_chat.jsonl"), tokenizer=str(example / "tokenizer.json"),
                       cache_dir=str(tmp_path / "cache"), packing="padded")
    config.trainer.seq_length = 96  # as the docs' command: the longest conversation is not cut
    validate(config)
    dataset = dataset_of(config)  # what each worker builds
    assert isinstance(dataset, InstructionWindowDataset) and len(dataset) > 0
    batch = build_microbatch(dataset, [0])
    assert 0 < batch.loss_mask.sum() < batch.loss_mask.numel()
