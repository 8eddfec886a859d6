"""End to end (issue 56): chat fine-tuning of a Hugging Face folder at tp=2 pp=2, exported, measured by transformers.

A tiny Llama saved by transformers shares its folder with a character tokenizer and a Llama-3-like chat template
(``tests/harness/chat_folder.py``). One ``ppctl train model.init_from=<folder> data=chat`` launch (4 workers,
float64; rows packed and kept apart, ``data=chat``'s default) fine-tunes it for 2 steps on the shipped
``data/chat/tiny_chat.jsonl`` and takes the validation loss; ``ppctl export`` writes the checkpoint as a folder
transformers loads. The validation split is the last two conversations, and the window is exactly their tokens
(each followed by the end-of-document id): so the one validation window holds both, packed, and ppctl's logged
validation loss must equal transformers' loss of each conversation run alone (its ids as the exported folder's
tokenizer renders them, the labels -100 outside ``assistant_masks``), summed and divided by the trained-token
count. That covers, in one run: the rendering and the mask, the block-causal mask and the restarting positions
at tp=2 pp=2 (the second conversation sees nothing of the first), the trained-token mean, the weights' round trip.
The export's own tokenizer must render the conversations as the run did: it carries the run's chat template
and the template's special tokens (it wrote neither before; ``tests/unit/test_export_chat_template.py``).

The tolerance: both sides compute in float64 (``hf_model``'s float32 rotary angles and RMSNorm in float64 too);
what may differ is the order of the sums (the TP halves of each matmul, another CPU's kernels), each of at most
~10^2 terms: ~sqrt(n) u = 10 u per operation, through 2 layers and the loss's sum of 17 tokens a few hundred u at
most (measured: 0, the same float64 on a 2-core x86 CPU). ``LOSS`` = 1e-12 (~4500 u) leaves that room and is 10^9
below what the broken twins show on this run (the second conversation seeing the first with positions running on:
0.9e-2 relative; the loss on every token: 4e-2; the mask shifted by one token: 4e-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.harness.chat_folder import LLAMA3, save_chat_folder
from tests.harness.hf_models import HIDDEN, KV_HEADS, HEADS, FFN, NORM_EPSILON, hf_model, save_random

pytestmark = [pytest.mark.cli, pytest.mark.timeout(300)]

REPOSITORY = Path(__file__).resolve().parents[2]
ROWS = REPOSITORY / "data" / "chat" / "tiny_chat.jsonl"
HELD_OUT = 2  # the validation split: the last two conversations, one window
LOSS = 1e-12  # relative; see the module
GLOBAL_BATCH = 2  # two microbatches of one sample: the least that keeps both pipeline stages at work


def save_chat_llama(folder: Path) -> Path:
    """A tiny random Llama (2 layers: one per pipeline stage; 2 key/value heads: one per TP rank) with the
    tokenizer and chat template of ``chat_folder``'s Llama 3 style in the same folder."""
    from transformers import AutoTokenizer, LlamaConfig

    save_chat_folder(folder, LLAMA3)
    vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         rms_norm_eps=NORM_EPSILON, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return save_random(folder, config)


def rendered(tokenizer, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids of ``conversation`` and its ``assistant_masks``."""
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def split_sizes(tokenizer, eod_id: int) -> tuple[int, float]:
    """``(trainer.seq_length, data.validation_fraction)`` that make the validation split the last ``HELD_OUT``
    conversations and one window of exactly their tokens (each row is its rendering and the end-of-document id)."""
    lengths = [len(rendered(tokenizer, json.loads(line)["messages"])[0]) + 1 for line in ROWS.read_text().splitlines()]
    held_out = sum(lengths[-HELD_OUT:])
    assert tokenizer.convert_tokens_to_ids("<|end_of_text|>") == eod_id
    return held_out - 1, (held_out + 0.5) / sum(lengths)  # floor(fraction * tokens) is the held-out tokens


def hf_loss_sum(model, ids: list[int], labels: list[int], positions: list[int] | None = None) -> tuple[float, int]:
    """``(summed cross-entropy, trained labels)`` of ``ids`` under an HF model from its float64 logits, labels -100
    not counted (transformers' own ``loss`` is float32 even for a float64 model)."""
    with torch.no_grad():
        position_ids = None if positions is None else torch.tensor([positions])
        logits = model(input_ids=torch.tensor([ids]), position_ids=position_ids).logits[0]
    labels_tensor = torch.tensor(labels)
    losses = torch.nn.functional.cross_entropy(logits, labels_tensor, ignore_index=-100, reduction="sum")
    return float(losses), int((labels_tensor != -100).sum())


def assistant_labels(ids: list[int], mask: list[int]) -> list[int]:
    """Labels of ``ids`` as inputs: the next id where it is the assistant's, -100 elsewhere and after the last."""
    return [label if trained else -100 for label, trained in zip(ids[1:], mask[1:])] + [-100]


def held_out_loss(model, conversations: list[tuple[list[int], list[int]]]) -> float:
    """The held-out conversations' mean assistant-token loss, each conversation run alone."""
    sums = [hf_loss_sum(model, ids, assistant_labels(ids, mask)) for ids, mask in conversations]
    return sum(total for total, _ in sums) / sum(count for _, count in sums)


def twin_losses(model, conversations: list[tuple[list[int], list[int]]], eod_id: int) -> dict[str, float]:
    """What the broken twins would log: the conversations joined in one sequence (the second sees the first,
    positions run on), the loss on every token, the mask shifted by one token."""
    (first, first_mask), (second, second_mask) = conversations
    joined_ids = first + [eod_id] + second
    joined_labels = assistant_labels(first, first_mask)[:-1] + [-100, -100] + assistant_labels(second, second_mask)
    total, count = hf_loss_sum(model, joined_ids, joined_labels)
    every = [hf_loss_sum(model, ids, ids[1:] + [-100]) for ids, _ in conversations]
    shifted = [(ids, mask[1:] + [0]) for ids, mask in conversations]
    return {"joined": total / count, "every token": sum(t for t, _ in every) / sum(c for _, c in every),
            "shifted": held_out_loss(model, shifted)}


def fine_tune(folder: Path, seq_length: int, fraction: float, tmp_path: Path) -> Path:
    """``ppctl train model.init_from=<folder> data=chat`` at tp=2 pp=2 in float64, 2 steps, the validation loss after
    them (a subprocess, as a user runs it); the run directory."""
    from tests.cli.conftest import run_ppctl

    run = tmp_path / "run"
    result = run_ppctl("train", f"model.init_from={folder}", "data=chat", f"data.path={ROWS}",
                       f"data.validation_fraction={fraction}", f"data.cache_dir={tmp_path / 'cache'}",
                       f"trainer.seq_length={seq_length}", "parallel.tp=2", "parallel.pp=2", "trainer.precision=fp64",
                       f"trainer.global_batch_size={GLOBAL_BATCH}", "trainer.micro_batch_size=1", "trainer.max_steps=2",
                       "trainer.eval_every=2", "trainer.eval_iters=1", "trainer.tensorboard=false",
                       f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def export(run: Path, out: Path) -> Path:
    """``ppctl export RUN OUT`` (the Typer app in this process); ``out``."""
    from ppctl.cli.app import app

    result = CliRunner().invoke(app, ["export", str(run), str(out)])
    assert result.exit_code == 0, (result.stderr, result.exception)
    return out


def test_chat_finetune_at_tp2_pp2_exports_a_model_whose_held_out_loss_is_the_logged_one(tmp_path):
    from transformers import AutoTokenizer

    from ppctl.data.tokenizer import build_tokenizer
    from ppctl.run.logging import read_metrics

    folder = save_chat_llama(tmp_path / "chat_llama")
    eod_id = build_tokenizer(str(folder / "tokenizer.json")).eod_id
    source = AutoTokenizer.from_pretrained(str(folder))
    run = fine_tune(folder, *split_sizes(source, eod_id), tmp_path)
    logged = [record for record in read_metrics(run / "metrics.jsonl") if "val_loss" in record]
    assert [record["step"] for record in logged] == [1]

    exported = export(run, tmp_path / "exported")
    conversations = [json.loads(line)["messages"] for line in ROWS.read_text().splitlines()[-HELD_OUT:]]
    tokenizer = AutoTokenizer.from_pretrained(str(exported))  # the export's own tokenizer and chat template
    held_out = [rendered(tokenizer, conversation) for conversation in conversations]
    assert held_out == [rendered(source, conversation) for conversation in conversations]  # as the run rendered
    model = hf_model(exported)
    expected = held_out_loss(model, held_out)
    # the one validation window fills each of the batch's GLOBAL_BATCH samples: the mean is its own
    assert logged[0]["val_trained_tokens"] == GLOBAL_BATCH * sum(sum(mask[1:]) for _, mask in held_out)
    assert logged[0]["val_loss"] == pytest.approx(expected, rel=LOSS, abs=0)
    for name, twin in twin_losses(model, held_out, eod_id).items():
        assert abs(twin - expected) > 1e6 * LOSS * expected, name  # each defect is far outside the tolerance
    assert abs(held_out_loss(hf_model(folder), held_out) - expected) > 1e6 * LOSS * expected  # the run trained
