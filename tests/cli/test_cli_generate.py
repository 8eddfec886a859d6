"""End to end: ``ppctl generate`` from a trained run and from a Hugging Face folder, and its refusals.

The run trains 6 float64 steps at tp=2 on a small text file (byte tokenizer) and saves at its end; greedy
generation from it must give the tokens of the single-process reference trained in this process on the same
steps, so the checkpoint's weights (fused QKV and padded vocabulary rows saved by two TP ranks) reach the
chunk intact. The streamed text is the ``--json`` text. A tiny GPT-2 folder with a character tokenizer
generates transformers' greedy tokens. Every refusal is one line on stderr and exit status 2.
"""

import json
import random

import pytest
import torch

from tests.harness.char_tokenizer import save_char_tokenizer
from tests.harness.hf_models import VOCAB, hf_model, save_tiny

pytestmark = [pytest.mark.cli, pytest.mark.timeout(400)]

WORDS = "the quick brown fox jumps over the lazy dog and then runs away into the forest".split()
PROMPT = "the quick "


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory trained 6 steps in float64 at tp=2, with a checkpoint at its end."""
    from tests.cli.conftest import run_ppctl

    folder = tmp_path_factory.mktemp("generate")
    rng = random.Random(0)
    (folder / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)))
    result = run_ppctl("train", "data=text", f"data.path={folder / 'corpus.txt'}", f"data.cache_dir={folder / 'cache'}",
                       "parallel.tp=2", "parallel.pp=1", "trainer.precision=fp64", "trainer.max_steps=6",
                       "trainer.seq_length=32", "model.max_seq_length=32", "trainer.tensorboard=false",
                       "trainer.eval_every=0", "data.validation_fraction=0", f"trainer.out_dir={folder / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


def _json(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_greedy_from_a_run_is_the_reference_models(ppctl, run):
    from ppctl.resolve import load_config_file
    from ppctl.generate.decode import generate_ids
    from ppctl.generate.sampling import Sampling
    from ppctl.run.reference import reference_model, run_reference

    generated = _json(ppctl("generate", str(run), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "20",
                            "--json"))
    config = load_config_file(run / "config.yaml")
    model, trained = reference_model(config), run_reference(config).parameters
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(trained[name])
    expected = list(generate_ids(model, list(PROMPT.encode()), 20, Sampling(temperature=0.0), 0, frozenset({256})))
    assert generated["prompt_ids"] == list(PROMPT.encode())
    assert generated["generated_ids"] == expected
    assert generated["text"] == bytes(token for token in expected if token < 256).decode(errors="replace")


def test_the_streamed_text_is_the_json_text(ppctl, run):
    args = ("generate", str(run / "checkpoints"), "--prompt", PROMPT, "--max-new-tokens", "15", "--seed", "4",
            "--top-k", "5", "--top-p", "0.9", "--temperature", "0.8")
    streamed, as_json = ppctl(*args), _json(ppctl(*args, "--json"))
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == as_json["text"] + "\n"
    assert streamed.stderr.startswith(f"{len(as_json['generated_ids'])} tokens in ") and "tokens/s" in streamed.stderr


def test_greedy_from_a_hugging_face_folder_is_transformers(ppctl, tmp_path):
    folder = save_tiny(tmp_path / "gpt2", tie=True)
    save_char_tokenizer(folder, VOCAB)
    generated = _json(ppctl("generate", str(folder), "--prompt", "Hello", "--temperature", "0", "--max-new-tokens",
                            "10", "--json"))
    model = hf_model(folder).float()
    with torch.no_grad():
        prompt = torch.tensor([generated["prompt_ids"]])
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10,
                                  pad_token_id=0)
    assert generated["generated_ids"] == expected[0, 5:].tolist()


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature=-1.0 must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
    (["--max-new-tokens", "40"], "--prompt is 10 tokens; with --max-new-tokens 40 that is 50, beyond "
                                 "model.max_seq_length=32: use --max-new-tokens 22 or less"),
])
def test_refusals_are_one_line(ppctl, run, args, message):
    result = ppctl("generate", str(run), "--prompt", PROMPT, *args)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1


def test_a_run_without_a_checkpoint_is_refused(ppctl, run, tmp_path):
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text())
    result = ppctl("generate", str(tmp_path), "--prompt", PROMPT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {tmp_path}: no checkpoint to generate from")
