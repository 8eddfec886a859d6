"""Bad chat rows through ``ppctl prepare-data`` (issue 56): refused in one line naming the file and its line, exit 2,
or with ``data.bad_rows=skip`` counted by kind in the summary. ``tests/unit/test_chat_data.py`` proves the same on
``prepare_corpus``; here the command line's own path (its error line, its exit code, what it prints) is checked, in
this process (the Typer app: no Python start, no workers, under a second a case)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.harness.chat_folder import CONVERSATIONS, LLAMA3, save_chat_folder, write_rows

pytestmark = pytest.mark.cli

BAD_ROWS = {  # the Done-when's four kinds: the row, what the line says of it
    "no messages": ({"text": "no messages here"}, 'has no "messages" list of messages'),
    "unknown role": ({"messages": [{"role": "robot", "content": "beep"}]}, "message 0 has role 'robot'"),
    "template fails": ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                                     {"role": "assistant", "content": "ok"}]},
                       "the chat template fails to render it: a system message must come first"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "anyone?"}]}, "has no assistant turn"),
}


def prepare(tmp_path, rows: list, *extra: str):
    """``ppctl prepare-data data=chat`` over ``rows`` (a jsonl file) with a Llama-3-like template folder."""
    from ppctl.cli.app import app

    folder = save_chat_folder(tmp_path / "folder", LLAMA3)
    path = write_rows(tmp_path / "rows" / "chat.jsonl", rows)
    args = ["prepare-data", "data=chat", f"data.path={path}", f"data.tokenizer={folder / 'tokenizer.json'}",
            f"data.cache_dir={tmp_path / 'cache'}", "trainer.eval_every=0", "trainer.seq_length=16", *extra]
    return CliRunner().invoke(app, args), path


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_a_bad_chat_row_is_refused_in_one_line_naming_the_file_and_line(kind, tmp_path):
    row, says = BAD_ROWS[kind]
    result, path = prepare(tmp_path, [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1]}, row])
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert result.stderr.startswith(f"error: {path} line 3: ") and says in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "data.bad_rows=skip" in result.stderr
    assert not list((tmp_path / "cache").glob("*.bin"))  # nothing half-made is left to be reused


def test_with_bad_rows_skip_each_kind_is_counted_in_the_summary_line(tmp_path):
    rows = [{"messages": CONVERSATIONS[0]}, *(row for row, _ in BAD_ROWS.values()), {"messages": CONVERSATIONS[1]}]
    result, _path = prepare(tmp_path, rows, "data.bad_rows=skip")
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    summary = [line for line in result.stdout.splitlines() if "chat row(s)" in line]
    assert len(summary) == 1 and "from 2 chat row(s) of 6" in summary[0], result.stdout
    for kind in BAD_ROWS:
        assert f"1 skipped ({kind})" in summary[0], (kind, summary[0])
