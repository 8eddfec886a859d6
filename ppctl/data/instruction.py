"""Instruction data: chat conversations and prompt-completion pairs as tokens with a loss weight per token.

``data=chat`` reads jsonl (or json) rows whose ``data.messages_field`` holds OpenAI-style messages
(``role``, ``content``), renders each with the chat template (``chat.py``) and tokenises the text as
transformers' ``apply_chat_template(tokenize=True)`` does (no special tokens added: the template
writes them); weight 1 marks the assistant's tokens. ``data=prompt_completion`` reads a prompt
and a completion field; the pair is tokenised as one text with the tokenizer's own beginning- and
end-of-text tokens, weight 1 on the completion, the end-of-text tokens after it and the end of the
document. Each row is one document, followed by the end-of-document id (weight 0 after a chat,
where the template's own end-of-turn token is the one trained on). A bad row (no messages, an
unknown role, a template that fails on it, no assistant turn, no prompt or completion) is refused
naming its file and row, or with ``data.bad_rows=skip`` counted and skipped; a template whose
assistant turns cannot be found is always refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ppctl.data.chat import TOKENIZER_CONFIG, ChatError, ChatTemplate, TemplateError, assistant_spans, \
    check_messages, load_chat_template, token_mask
from ppctl.data.corpus import Corpus, DataError
from ppctl.data.tokenizer import Tokenizer, TokenizerFile

BAD_ROWS = ("refuse", "skip")
FAULT_KINDS = ("no messages", "unknown role", "template fails", "no assistant turn", "no prompt or completion")


@dataclass(frozen=True)
class InstructionOptions:
    """The ``data`` settings that shape instruction data's tokens and weights."""

    source: str
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    bad_rows: str = "refuse"

    def fields(self) -> str:
        """What the fingerprint records of the fields read."""
        if self.source == "chat":
            return f"messages={self.messages_field}"
        return f"prompt={self.prompt_field}|completion={self.completion_field}"


def chat_template_of(options: InstructionOptions, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template ``data=chat`` renders with: ``data.chat_template``, else the ``tokenizer_config.json``
    beside ``data.tokenizer``; None for other sources. ``DataError`` in one line when there is none."""
    if options.source != "chat":
        return None
    if options.chat_template is None and not isinstance(tokenizer, TokenizerFile):
        raise DataError("data=chat needs data.tokenizer=<a Hugging Face tokenizer.json> whose folder holds a "
                        f"{TOKENIZER_CONFIG} with a chat_template (or data.chat_template=<that file>); "
                        f"data.tokenizer={tokenizer.name} has none")
    if not isinstance(tokenizer, TokenizerFile):
        raise DataError(f"data=chat needs data.tokenizer=<a Hugging Face tokenizer.json>, not {tokenizer.name}: "
                        f"the template's special tokens must be tokens of it")
    try:
        return load_chat_template(options.chat_template or tokenizer.path.parent)
    except TemplateError as error:
        raise DataError(f"data.chat_template: {error}") from None


def template_fingerprint(template: ChatTemplate | None) -> str:
    """SHA-256 of the template's text and special tokens (empty without a template)."""
    if template is None:
        return ""
    return hashlib.sha256(json.dumps([template.text, template.special_tokens]).encode()).hexdigest()


def read_rows(file: Path) -> Iterator[tuple[int, object]]:
    """``(row number, record)`` of a jsonl file (lines from 1, blank lines skipped) or a json list (records from
    0); a line that is not JSON gives a ``ChatError`` as its record."""
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json":
        try:
            records = json.loads(text)
        except ValueError as error:
            raise DataError(f"{file}: not JSON ({error})") from None
        if not isinstance(records, list):
            raise DataError(f"{file}: holds a JSON {type(records).__name__}, not a list of records")
        yield from enumerate(records)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as error:
            yield number, ChatError("no messages", f"is not JSON ({error})")


class InstructionEncoder:
    """Turns one row into ``(ids, weights)``: its document's token ids and the loss weight of each."""

    def __init__(self, options: InstructionOptions, tokenizer: Tokenizer, template: ChatTemplate | None):
        self.options, self.tokenizer, self.template = options, tokenizer, template

    def encode(self, record) -> tuple[list[int], list[int]]:
        """The row's ids and weights, ended by the end-of-document id; ``ChatError`` for a bad row,
        ``TemplateError`` for a template whose turns cannot be found."""
        if isinstance(record, ChatError):
            raise record
        if self.options.source == "chat":
            ids, weights = self._conversation(record)
        else:
            ids, weights = self._prompt_completion(record)
        if not ids or ids[-1] != self.tokenizer.eod_id:
            ids, weights = ids + [self.tokenizer.eod_id], weights + [int(self.options.source != "chat")]
        return ids, weights

    def _conversation(self, record) -> tuple[list[int], list[int]]:
        """A conversation rendered with the template; weight 1 on the tokens of its assistant turns."""
        field = self.options.messages_field
        messages = check_messages(record.get(field) if isinstance(record, dict) else None, field)
        text, spans = assistant_spans(self.template, messages)
        ids, offsets, _ = self.tokenizer.encode_with_offsets(text, add_special_tokens=False)
        weights = token_mask(offsets, spans)
        if not any(weights):
            raise ChatError("no assistant turn", "its assistant turns render no text (nothing to train on)")
        return list(ids), weights

    def _prompt_completion(self, record) -> tuple[list[int], list[int]]:
        """The prompt and completion as one text; weight 1 on the completion and the end-of-text after it."""
        prompt_field, completion_field = self.options.prompt_field, self.options.completion_field
        prompt = record.get(prompt_field) if isinstance(record, dict) else None
        completion = record.get(completion_field) if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise ChatError("no prompt or completion", f"has no text \"{prompt_field}\" and non-empty text "
                                                       f"\"{completion_field}\"")
        if not isinstance(self.tokenizer, TokenizerFile):  # bytes: the two texts' bytes, one after the other
            prompt_ids, completion_ids = self.tokenizer.encode(prompt), self.tokenizer.encode(completion)
            return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
        ids, offsets, special = self.tokenizer.encode_with_offsets(prompt + completion, add_special_tokens=True)
        weights = token_mask(offsets, [(len(prompt), len(prompt) + len(completion))])
        last_text = max((index for index, flag in enumerate(special) if not flag), default=-1)
        return list(ids), [1 if index > last_text else weight for index, weight in enumerate(weights)]


def tokenise_instructions(corpus: Corpus, options: InstructionOptions, tokenizer: Tokenizer,
                          template: ChatTemplate | None, dtype: str, staged: dict[str, Path]) -> dict:
    """Write every row's tokens, weights and ``[end, file, row]`` into the staged files (``""``: tokens,
    ``.weights``, ``.docs``); return what the index says of the content."""
    import numpy as np

    encoder = InstructionEncoder(options, tokenizer, template)
    skipped = dict.fromkeys(FAULT_KINDS, 0)
    num_rows = num_tokens = num_trained = inner_eod = 0
    documents = []
    with open(staged[""], "wb") as tokens, open(staged[".weights"], "wb") as weights_out:
        for file_number, file in enumerate(corpus.files):
            for row, record in read_rows(file):
                num_rows += 1
                try:
                    ids, weights = encoder.encode(record)
                except ChatError as error:
                    _refuse_or_count(options, file, row, error, skipped)
                    continue
                except TemplateError as error:
                    raise DataError(f"{file} {_row_word(file)} {row}: {error}") from None
                np.asarray(ids, dtype=dtype).tofile(tokens)
                np.asarray(weights, dtype=np.uint8).tofile(weights_out)
                num_tokens += len(ids)
                num_trained += sum(weights)
                inner_eod += tokenizer.eod_id in ids[:-1]
                documents.append((num_tokens, file_number, row))
    if not documents:
        raise DataError(f"{corpus.label}: no row gives a {options.source} document ({num_rows} row(s) read)")
    np.asarray(documents, dtype=np.int64).tofile(staged[".docs"])
    return {"files": [str(file) for file in corpus.files], "num_rows": num_rows, "num_documents": len(documents),
            "num_tokens": num_tokens, "num_trained_tokens": num_trained, "rows_with_inner_eod": inner_eod,
            "skipped_rows": skipped,
            "bad_rows": options.bad_rows, "fields": options.fields(),
            "chat_template": None if template is None else template.origin}


def _row_word(file: Path) -> str:
    """``line`` for a jsonl file's rows, ``record`` for a json list's."""
    return "record" if file.suffix.lower() == ".json" else "line"


def _refuse_or_count(options: InstructionOptions, file: Path, row: int, error: ChatError, skipped: dict) -> None:
    """``data.bad_rows=refuse``: ``DataError`` naming the file and row; ``skip``: count it by its kind."""
    if options.bad_rows == "skip":
        skipped[error.kind] += 1
        return
    raise DataError(f"{file} {_row_word(file)} {row}: {error}; fix the row or set data.bad_rows=skip to skip and "
                    f"count such rows")
