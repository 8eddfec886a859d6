"""``ppctl export`` of a ``data=chat`` run carries the chat template it trained with (issue 56).

Without it the exported folder's tokenizer has no ``chat_template`` (transformers' ``apply_chat_template`` raises),
and the ``bos_token`` the export wrote (the end-of-document token) would render another text from a template that
writes ``{{ bos_token }}``. The folder's ``tokenizer_config.json`` now holds the run's template and the special
tokens it renders with: transformers renders every conversation to the ids and assistant mask the source folder
gives. A template no longer readable at export time is a note, as a changed tokenizer file is. The end-to-end
check (the exported model's loss on held-out conversations) is ``tests/cli/test_cli_chat_finetune.py``.
"""

from __future__ import annotations

import pytest

from ppctl.checkpoint.hf_export import tokenizer_files, write_tokenizer
from ppctl.data.tokenizer import tokenizer_record
from ppctl.resolve import compose_config
from tests.harness.chat_folder import CHATML, CONVERSATIONS, LLAMA3, save_chat_folder


def chat_config(tokenizer: str, *extra: str):
    """A ``data=chat`` config reading ``tokenizer`` (its folder's template unless ``extra`` names another)."""
    return compose_config(["data=chat", "data.path=/corpora/chat.jsonl", f"data.tokenizer={tokenizer}", *extra])


def rendered(tokenizer, conversation: list) -> tuple[list[int], list[int]]:
    """transformers' ids and ``assistant_masks`` of ``conversation``."""
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("style", [LLAMA3, CHATML])
def test_the_export_of_a_chat_run_renders_conversations_as_the_run_did(style, tmp_path):
    from transformers import AutoTokenizer

    folder = save_chat_folder(tmp_path / "folder", style)
    config = chat_config(str(folder / "tokenizer.json"))
    tokenizer, notes = tokenizer_files(config, {"data": {"tokenizer": tokenizer_record(config.data)}})
    assert notes == []
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(out, tokenizer, {"max_position_embeddings": 64})
    exported, source = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(folder))
    for conversation in CONVERSATIONS:
        assert rendered(exported, conversation) == rendered(source, conversation)


def test_a_template_gone_since_the_run_is_a_note(tmp_path):
    folder = save_chat_folder(tmp_path / "folder", CHATML)
    config = chat_config(str(folder / "tokenizer.json"), f"data.chat_template={tmp_path / 'gone.jinja'}")
    tokenizer, notes = tokenizer_files(config, {"data": {"tokenizer": tokenizer_record(config.data)}})
    assert tokenizer["chat_template"] is None and len(notes) == 1
    assert notes[0].startswith(f"note: the run's chat template cannot be read ({tmp_path / 'gone.jinja'}: no such "
                               f"file") and notes[0].endswith("no chat template written") and "\n" not in notes[0]
